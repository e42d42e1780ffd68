"""The two stages of a job, each one unit, and the loops that run them.

* :mod:`~mpi_fnas.stages.search` and :mod:`~mpi_fnas.stages.augment`: one module per stage, holding rank 0's side,
  the party's side and the outcome, behind the interface of :mod:`~mpi_fnas.stages.base`;
* rank 0: :mod:`~mpi_fnas.stages.rank0_driver` (:func:`~mpi_fnas.stages.rank0_driver.serve`: a stage from plan to
  outcome, fresh or resumed), the stage's setup (:mod:`~mpi_fnas.stages.setup`) and its iteration loop
  (:class:`~mpi_fnas.stages.rank0_loop.ServerLoop`);
* a party: :mod:`~mpi_fnas.stages.party_driver` (:func:`~mpi_fnas.stages.party_driver.participate`), its step loop
  (:func:`~mpi_fnas.stages.party_loop.party_steps`) and its examples (:mod:`~mpi_fnas.stages.party_data`);
* :mod:`~mpi_fnas.stages.iteration`: what both stages share around their iterations (step control, test hooks);
* :mod:`~mpi_fnas.stages.job`: the whole job on every rank, the server/party split at the top;
  :mod:`~mpi_fnas.stages.summary`: the text rank 0 prints at its end.

What an iteration computes and exchanges is :mod:`mpi_fnas.federation` (Algorithm 1:
:mod:`mpi_fnas.federation.algorithm`); a stage only says which iteration runs when.
"""
