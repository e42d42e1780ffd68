"""The mechanics of one iteration, below the stages: what rank 0 and a party compute, exchange and keep.

* one iteration: ``algorithm`` (Algorithm 1, both roles side by side); ``global_model`` (rank 0's W and A, their
  optimizers and schedule); ``local_model`` (a party's local computation) on its examples (``shard``), with its
  keystreams (``randomness``); ``adadp``, ``schedules``; ``selection``, with SecProbe's ``probe`` and ``aux_set``;
* before the iterations: ``job_plan`` (both stages planned on rank 0), ``memory`` (each rank's expected peak),
  ``inventory`` (a local partition's folders), ``handshake`` (the setup round), ``verify`` (a party's checks of its
  assignment), ``placement`` (each rank's device), ``topology`` (the exchange pattern);
* the wire: ``comm`` (the only MPI module on the hot path), ``pending`` (what its waits poll), ``flat`` (W, A and
  gradients as flat float32 vectors);
* a party's own disk: ``party_disk``.
"""
