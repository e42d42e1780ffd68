"""mpi_fnas: differentially-private federated neural architecture search over MPI.

Commands: ``run`` (one job), ``sweep``, ``baseline``, ``scaling``, ``bench``, ``report`` and ``identities``, on the
launch layer they share (``cli``). Below them: ``stages`` (each stage of a job, rank 0's side and a party's),
``federation`` (one iteration's mechanics), ``privacy``, ``secagg``, ``space``, ``data``, ``runlog`` and ``config``;
and the support modules ``checkpoint``, ``evaluation``, ``progress``, ``optim``, ``wire``, ``keystream``,
``refusal``, ``op_names`` and ``cpu_kernels``. The layers: docs/development.md. An old module path still imports,
with a DeprecationWarning naming its new one (:mod:`mpi_fnas.moved`).
"""

from mpi_fnas import moved

__version__ = "0.1.0"

moved.install()
