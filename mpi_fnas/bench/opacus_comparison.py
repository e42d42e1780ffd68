"""The private step of the configured augmentation network (a hand-designed ``augment.network`` or a cell) beside
Opacus's on the same network, weights, inputs and threads (:func:`compare_opacus`): an outside reference for what
our DP step costs."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from mpi_fnas.bench.augment_step import make_augment_party
from mpi_fnas.bench.party_step import timed
from mpi_fnas.config import HANDCRAFTED_NETWORKS, Config


def compare_opacus(cfg: Config, repeats: int) -> dict[str, Any]:
    """The private step of the configured augmentation network beside Opacus's, interleaved, medians of CPU
    seconds: the hand-designed ``augment.network``, or the cell of ``augment.genotype`` (unset: the genotype the
    supernet starts from). A ScatterNet's batch is its examples' scattering (computed once, outside both steps).

    Ours: the augmentation party's release of one Poisson batch at rate 1 (exactly ``augment.batch_size``
    examples, in the passes ``runtime.max_physical_batch`` sets: per-example gradients, clip, Gaussian noise from
    the AES keystream, ÷ B). Theirs: the same network
    (a copy, same weights) in ``GradSampleModule``, one forward and backward on the same batch, then
    ``DPOptimizer.step`` (clip, Gaussian noise from torch's generator, ÷ B, the SGD update: O(P), negligible
    here). Same clip, σ and B (the ``augment`` section). ``dp_step_vs_opacus`` = ours / theirs: ≤ 1 means ours
    is no slower. Without Opacus installed (the ``test`` extra has it), or for a network that cannot train under DP,
    only ``opacus_note`` says why.
    """
    try:
        from opacus import GradSampleModule
        from opacus import __version__ as opacus_version
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return {"opacus_note": "Opacus is not installed (pip install opacus; the test extra installs it)"}
    import copy

    import torch
    import torch.nn.functional as F

    augment = dataclasses.replace(cfg.augment, drop_path=0.0, auxiliary_weight=0.0, cutout=0, crop_padding=0,
                                  flip=False)
    from mpi_fnas.privacy.validators import PrivacyError

    try:
        ours = make_augment_party(dataclasses.replace(cfg, augment=augment), private=True)
    except PrivacyError as exc:  # e.g. a DARTS cell with BatchNorm: it has no private step to compare
        return {"opacus_note": f"not compared: {exc}"}
    network = cfg.augment.network
    if network not in HANDCRAFTED_NETWORKS:
        network = f"cell {ours.model.genotype.to_string()}"
    x, y = ours.train.x, ours.train.y  # the whole pool: the Poisson batch at rate 1
    theirs = GradSampleModule(copy.deepcopy(ours.model))
    optimizer = DPOptimizer(torch.optim.SGD(theirs.parameters(), lr=augment.lr),
                            noise_multiplier=augment.noise_multiplier, max_grad_norm=augment.clip,
                            expected_batch_size=augment.batch_size)

    def opacus_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(theirs(x), y).backward()
        optimizer.step()

    cpu: dict[str, list[float]] = {"ours": [], "opacus": []}
    for i in range(repeats + 1):
        for key, job in (("ours", ours.w_release), ("opacus", opacus_step)):
            _, seconds = timed(job)
            if i:  # the first round warms up allocators and kernels
                cpu[key].append(seconds)
    mine, other = statistics.median(cpu["ours"]), statistics.median(cpu["opacus"])
    return {"opacus_version": opacus_version, "opacus_network": network,
            "opacus_network_params": sum(p.numel() for p in ours.model.parameters()),
            "network_dp_step_cpu_seconds": mine, "opacus_dp_step_cpu_seconds": other,
            "dp_step_vs_opacus": mine / other}
