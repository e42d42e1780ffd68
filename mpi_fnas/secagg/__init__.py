"""Secure aggregation with distributed discrete noise (docs/privacy.md §8): a party's release is encoded to
integers, noised with its share of the discrete noise and masked pairwise, so that rank 0 learns only the sum.

The building blocks, each MPI-free and autograd-free:

* :mod:`~mpi_fnas.secagg.discrete_gaussian`: the exact discrete Gaussian sampler (Canonne, Kamath & Steinke 2020);
* :mod:`~mpi_fnas.secagg.encoding`: rotation, scaling, conditional randomized rounding and the modular wrap of
  Kairouz, Liu & Steinke (ICML 2021), and the server's decoding of the sum;
* :mod:`~mpi_fnas.secagg.masks`: pairwise masks from X25519 key agreement (Bonawitz et al., CCS 2017);
* :mod:`~mpi_fnas.secagg.series`: one kind of secure release in a stage, sealed by a party, its sum opened by rank 0;
* :mod:`~mpi_fnas.secagg.keyset` (the relayed key set a party accepts) and :mod:`~mpi_fnas.secagg.identities`
  (the parties' long-lived keys that authenticate the relay);
* :mod:`~mpi_fnas.secagg.accounting`: ε of a party's records when only the noised sum is seen.
"""
