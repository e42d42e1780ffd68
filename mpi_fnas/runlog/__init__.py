"""HDF5 run log of one search (``search.h5``): written by rank 0 only, readable while the run is going (SWMR).

The search's augment stage (training the derived genotype from scratch) appends its ``/augment`` group to the
same file. docs/hdf5.md documents the file name by name. Modules: ``schema`` (names and layout, one
``StageLayout`` per stage group), ``liveness`` (the writer's liveness record and the dead-writer rule), ``writer``
(``RunLog``, the file), ``stage_log`` (``StageLog``, one writer per stage group), ``h5file`` (rank 0's opens of the
file), ``reader`` (``read_run``).
"""

from mpi_fnas.runlog.reader import DEFAULT_STALE_SECONDS, read_run
from mpi_fnas.runlog.schema import (
    AUGMENT_LAYOUT,
    AUGMENT_METRICS,
    RELEASE_FIELDS,
    SEARCH_LAYOUT,
    SEARCH_METRICS,
    SelectionSchema,
    StageLayout,
    StagePrivacy,
)
from mpi_fnas.runlog.writer import HEARTBEAT_SECONDS, RunLog, StageLog

__all__ = [
    "AUGMENT_LAYOUT",
    "AUGMENT_METRICS",
    "DEFAULT_STALE_SECONDS",
    "HEARTBEAT_SECONDS",
    "RELEASE_FIELDS",
    "SEARCH_LAYOUT",
    "SEARCH_METRICS",
    "RunLog",
    "SelectionSchema",
    "StageLayout",
    "StageLog",
    "StagePrivacy",
    "read_run",
]
