"""The released sizes n_W and n_A of a run, from its config: what the cost model needs to count the values on rank
0's link. The log does not store them; they follow from the config and the data's shape (public), so the supernet is
built once per distinct config, as rank 0's plan builds it (torch is imported here, and only here)."""

from __future__ import annotations

from functools import lru_cache

from mpi_fnas.config import ConfigError, config_from_text


@lru_cache(maxsize=32)
def release_sizes(config_text: str) -> tuple[int, int]:
    """(n_W, n_A): the supernet's weight and architecture values for the resolved config `config_text` (a log's
    ``config``). ConfigError (one line) when the config or its data cannot be opened here."""
    from mpi_fnas.federation.flat import numel
    from mpi_fnas.federation.job_plan import open_split
    from mpi_fnas.space import search_space

    cfg = config_from_text(config_text, stored=True)
    test = open_split(cfg, "test")  # SetupError (a ConfigError) when the data is not on this machine
    supernet = search_space(cfg.space.kind).build_supernet(cfg.space, seed=cfg.seed, in_channels=test.in_channels,
                                                           num_classes=test.num_classes)
    sizes = numel(supernet.weights()), numel(supernet.alphas())
    if min(sizes) < 1:
        raise ConfigError(f"the config's supernet releases {sizes[0]} weight and {sizes[1]} architecture values")
    return sizes
