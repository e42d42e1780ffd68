"""The candidate op names of each search space kind, and the choice of ``space.ops`` among them.

Torch-free, so the config can check ``space.ops`` without building a network: the networks' modules take their
op lists from here (``mpi_fnas.space.ops.PRIMITIVES``, ``mpi_fnas.space.dpnas.ops.PRIMITIVES``) and map each name
to a constructor.
"""

from __future__ import annotations

from collections.abc import Sequence

#: DARTS' candidate ops, in alpha-column order.
DARTS_PRIMITIVES: tuple[str, ...] = (
    "none",
    "max_pool_3x3",
    "avg_pool_3x3",
    "skip_connect",
    "sep_conv_3x3",
    "sep_conv_5x5",
    "dil_conv_3x3",
    "dil_conv_5x5",
)

#: DPNAS: the activations of its conv ops, and the prefix that names a conv op by its activation.
DPNAS_ACTIVATIONS: tuple[str, ...] = ("relu", "selu", "tanh", "linear", "hardtanh", "sigmoid")
DPNAS_CONV_PREFIX = "conv_3x3_"
DPNAS_POOLS: tuple[str, ...] = ("max_pool_3x3", "avg_pool_3x3")

#: DPNAS' convolutions, one per activation: the built-in ``space.ops`` (docs/log/benchmarks.md, "A search space of
#: convolutions only": a cell with a parameter-free op on an edge trains worse under DP).
DPNAS_CONVS: tuple[str, ...] = tuple(DPNAS_CONV_PREFIX + name for name in DPNAS_ACTIVATIONS)

#: DPNAS' candidate ops, in alpha-column order (the order of the authors' released primitive list).
DPNAS_PRIMITIVES: tuple[str, ...] = (
    "none",
    *DPNAS_POOLS,
    "skip_connect",
    *DPNAS_CONVS,
)

#: Every kind's ops, by ``space.kind``.
PRIMITIVES_BY_KIND: dict[str, tuple[str, ...]] = {"darts": DARTS_PRIMITIVES, "dpnas": DPNAS_PRIMITIVES}


def candidate_ops(primitives: tuple[str, ...], chosen: Sequence[str]) -> tuple[str, ...]:
    """The ops of ``space.ops`` (`chosen`) in `primitives` order, the alpha's column order; all of `primitives`
    when `chosen` is empty. ValueError for an op of another space, one named twice, or no op but ``none``."""
    if not chosen:
        return primitives
    unknown = [op for op in chosen if op not in primitives]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(map(str, unknown))}; expected ops of {', '.join(primitives)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"an op is named twice in {', '.join(chosen)}")
    if all(op == "none" for op in chosen):
        raise ValueError("needs at least one op other than none (none is no edge)")
    return tuple(op for op in primitives if op in chosen)
