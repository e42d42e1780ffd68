"""The two stages of a job, each one unit, and the loops that run them.

* :mod:`~mpi_fnas.stages.search` and :mod:`~mpi_fnas.stages.augment`: one module per stage, holding rank 0's side,
  the party's side and the outcome, behind the interface of :mod:`~mpi_fnas.stages.base`;
* rank 0: :func:`~mpi_fnas.stages.serve.serve` (a stage from plan to outcome, fresh or resumed) and its
  :class:`~mpi_fnas.stages.server_loop.ServerLoop`;
* a party: :func:`~mpi_fnas.stages.participate.participate` and its :func:`~mpi_fnas.stages.party_loop.party_steps`;
* :mod:`~mpi_fnas.stages.job`: the whole job on every rank, the server/party split at the top.

What an iteration computes and exchanges is :mod:`mpi_fnas.federation` (Algorithm 1:
:mod:`mpi_fnas.federation.algorithm`); a stage only says which iteration runs when.
"""
