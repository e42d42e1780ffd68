"""The fixed scattering stem of a ScatterNet (``augment.network`` scatter-linear or scatter-cnn) on one party's
shard: the seconds it takes, once per party and stage, and the memory it leaves (the features the party keeps in
place of its images) and needs while it runs."""

from __future__ import annotations

from typing import Any

from mpi_fnas.bench.party_step import input_shape, timed
from mpi_fnas.config import Config


def party_pool_size(cfg: Config, parties: int) -> int:
    """Examples in one party's augmentation pool: its share of the train split (both search shards under
    ``augment.pool: all``, its train shard under ``train``)."""
    from mpi_fnas.federation.memory import _default_train_size

    train = (cfg.data.train_size or _default_train_size(cfg)) - cfg.data.holdout
    share = train / max(parties, 1)
    return max(1, int(share if cfg.augment.pool == "all" else share * (1 - cfg.data.val_fraction)))


def time_scattering(cfg: Config, parties: int) -> dict[str, Any]:
    """``scatter_*``: one party's pool of random images through the scattering stem of ``augment.network`` (empty
    for a network without one): examples, wall and CPU seconds, the features' MB, and the growth of this process's
    peak resident memory while it ran (measured before anything else of the bench allocated)."""
    import torch

    from mpi_fnas.federation.memory import peak_rss_mb
    from mpi_fnas.space import augment_network
    from mpi_fnas.space.scattering import fixed_stem_of

    if not cfg.augment.network.startswith("scatter-"):
        return {}
    c, h, _, classes = input_shape(cfg)
    stem = fixed_stem_of(augment_network(cfg, None, seed=cfg.seed, in_channels=c, num_classes=classes))
    n = party_pool_size(cfg, parties)
    images = torch.randn(n, c, h, h, generator=torch.Generator().manual_seed(0))
    before = peak_rss_mb()
    out: list[torch.Tensor] = []
    wall, cpu = timed(lambda: out.append(stem(images)))
    return {"scatter_examples": n, "scatter_seconds": wall, "scatter_cpu_seconds": cpu,
            "scatter_ms_per_example": 1e3 * wall / n, "scatter_features_mb": out[0].numel() * 4 / 1e6,
            "scatter_peak_growth_mb": peak_rss_mb() - before}
