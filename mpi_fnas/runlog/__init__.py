"""HDF5 run log of one search (``search.h5``): written by rank 0 only, readable while the run is going (SWMR).

The search's augment stage (training the derived genotype from scratch) appends its ``/augment`` group to the
same file. docs/hdf5.md documents the file name by name. Modules: ``schema`` (names and layout, one
``StageLayout`` per stage group), ``liveness`` (the writer's liveness record and the dead-writer rule), ``writer``
(``RunLog``, the file, and ``StageLog``, one writer per stage group), ``reader`` (``read_run``).
"""

from mpi_fnas.runlog.reader import DEFAULT_STALE_SECONDS, read_run
from mpi_fnas.runlog.schema import (
    AUGMENT_LAYOUT,
    AUGMENT_METRICS,
    SEARCH_LAYOUT,
    SEARCH_METRICS,
    AugmentPrivacySchema,
    PrivacySchema,
    SelectionSchema,
    StageLayout,
)
from mpi_fnas.runlog.writer import HEARTBEAT_SECONDS, RunLog, StageLog

__all__ = [
    "AUGMENT_LAYOUT",
    "AUGMENT_METRICS",
    "DEFAULT_STALE_SECONDS",
    "HEARTBEAT_SECONDS",
    "SEARCH_LAYOUT",
    "SEARCH_METRICS",
    "AugmentPrivacySchema",
    "PrivacySchema",
    "RunLog",
    "SelectionSchema",
    "StageLayout",
    "StageLog",
    "read_run",
]
