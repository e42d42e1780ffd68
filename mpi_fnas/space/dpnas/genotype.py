"""DPNAS cell topology, the discrete cell (genotype), its derivation from the alphas and its string form.

Topology: one input node (state 0, a 1x1 conv of the cell's input) and ``nodes`` intermediate nodes; node ``i``
(0-based) is state ``i + 1`` and takes one edge from every earlier state ``j = 0 .. i``: ``nodes · (nodes + 1) / 2``
edges, enumerated node by node, then by input state (row ``e`` of the alpha matrix belongs to
``edge_endpoints(nodes)[e]``). The cell's output is the concatenation of every intermediate node.

Derivation (:func:`derive_dpnas_genotype`): the strongest op of every edge, ``none`` ("no edge") included; when that
cuts the cell off from its input, the strongest non-``none`` edge out of state 0 is kept too, so a search always
yields a trainable cell (a cut-off genotype written by hand builds no network).

String form (``DpnasGenotype.to_string`` / ``from_string``): ``dpnas=OP@0|OP@0,OP@1|...``, ``|`` between nodes, every
edge of a node in input order (``none`` included), then ``;stem=...`` and ``;head=...`` when the search chose them.
The parser never evaluates the text and raises ``ValueError`` naming the node or field. Rules: docs/dpnas.md.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpi_fnas.space.dpnas.ops import PRIMITIVES

NUM_CELL_INPUTS = 1  # state 0: the 1x1 conv of the cell's input
FIELD = "dpnas"
#: The network choices a search may make beside the cell, with their candidates (``space.stem``, ``space.head``).
CHOICES: dict[str, tuple[str, ...]] = {"stem": ("conv", "scattering"), "head": ("pool", "dpnas")}
_INDEX = re.compile(r"[0-9]+")


def num_edges(nodes: int) -> int:
    """Edges (alpha rows) of a DPNAS cell with ``nodes`` intermediate nodes: ``nodes · (nodes + 1) / 2``."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    return nodes * (nodes + 1) // 2


def edge_endpoints(nodes: int) -> list[tuple[int, int]]:
    """``(node, input_state)`` per edge, in alpha-row order (node 0 first, then input state ascending)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    return [(i, j) for i in range(nodes) for j in range(i + NUM_CELL_INPUTS)]


def nodes_of(edges: int) -> int:
    """The node count whose cell has ``edges`` edges; ValueError when ``edges`` is not such a count."""
    nodes = (math.isqrt(8 * edges + 1) - 1) // 2
    if nodes < 1 or num_edges(nodes) != edges:
        raise ValueError(f"{edges} edges is not the edge count of a DPNAS cell (1, 3, 6, 10, 15, ...)")
    return nodes


@dataclass(frozen=True)
class DpnasGenotype:
    """The discrete DPNAS cell: ``ops[e]`` is the op of edge ``e`` (alpha-row order), ``none`` for no edge.

    Shared by every cell of the network (the space has no reduction cell). Validated on construction: the count
    is a cell's edge count and every op is a DPNAS primitive.
    """

    ops: tuple[str, ...]
    stem: str | None = None  # the stem the search chose (space.stem: search), else None: the config's
    head: str | None = None  # the head the search chose (space.head: search), else None: the config's

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):
            raise ValueError("DPNAS genotype: ops must be a sequence of op names, not one string")
        ops = tuple(self.ops)
        object.__setattr__(self, "ops", ops)
        nodes_of(len(ops))
        unknown = sorted({op for op in ops if op not in PRIMITIVES}, key=str)
        if unknown:
            raise ValueError(f"DPNAS genotype: unknown op(s) {unknown}; expected ops of {', '.join(PRIMITIVES)}")
        for name, candidates in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in candidates:
                raise ValueError(f"DPNAS genotype: {name} {value!r}; expected one of {', '.join(candidates)}")

    @property
    def nodes(self) -> int:
        """Number of intermediate nodes."""
        return nodes_of(len(self.ops))

    def node_edges(self, node: int) -> list[tuple[str, int]]:
        """The kept (non-``none``) edges into ``node``: ``(op, input_state)`` by input state."""
        first = num_edges(node) if node > 0 else 0
        return [(op, j) for j, op in enumerate(self.ops[first : first + node + NUM_CELL_INPUTS]) if op != "none"]

    def live_nodes(self) -> list[int]:
        """Intermediate nodes whose value depends on the cell input: reached by a kept edge from state 0 or from
        another live node. The others are zero maps, or constants made from them."""
        live_states = {0}
        for node in range(self.nodes):
            if any(j in live_states for _, j in self.node_edges(node)):
                live_states.add(node + NUM_CELL_INPUTS)
        return [state - NUM_CELL_INPUTS for state in sorted(live_states) if state >= NUM_CELL_INPUTS]

    @property
    def connected(self) -> bool:
        """Whether the cell's output depends on its input at all (some intermediate node is live)."""
        return bool(self.live_nodes())

    def op_counts(self) -> dict[str, int]:
        """How many edges use each primitive (``none`` included), in ``PRIMITIVES`` order."""
        counts = Counter(self.ops)
        return {name: counts.get(name, 0) for name in PRIMITIVES}

    def to_string(self) -> str:
        """``dpnas=...`` as in the module docstring; ``from_string`` inverts it exactly."""
        nodes_text = []
        for node in range(self.nodes):
            first = num_edges(node) if node > 0 else 0
            row = self.ops[first : first + node + NUM_CELL_INPUTS]
            nodes_text.append(",".join(f"{op}@{j}" for j, op in enumerate(row)))
        choices = "".join(f";{name}={getattr(self, name)}" for name in CHOICES if getattr(self, name) is not None)
        return f"{FIELD}={'|'.join(nodes_text)}{choices}"

    @classmethod
    def from_string(cls, text: str) -> DpnasGenotype:
        """Parse ``to_string`` output; ValueError naming the node for malformed text."""
        if not isinstance(text, str):
            raise ValueError(f"genotype string must be str, got {type(text).__name__}")
        cell_text, *extra = text.strip().split(";")
        key, sep, value = cell_text.partition("=")
        if not sep or key.strip() != FIELD:
            raise ValueError(f"DPNAS genotype string: expected '{FIELD}=OP@0|OP@0,OP@1|...', got {text.strip()[:60]!r}")
        choices: dict[str, str] = {}
        for field_text in extra:
            name, sep, choice = (t.strip() for t in field_text.partition("="))
            if not sep or name not in CHOICES or name in choices or choice not in CHOICES.get(name, ()):
                raise ValueError(f"DPNAS genotype string: expected ';stem=conv|scattering' or ';head=pool|dpnas' after "
                                 f"the cell, got {field_text.strip()[:40]!r}")
            choices[name] = choice
        ops: list[str] = []
        for node, node_text in enumerate(value.split("|")):
            edge_texts = node_text.split(",")
            if len(edge_texts) != node + NUM_CELL_INPUTS:
                raise ValueError(f"DPNAS genotype string: node {node} lists {len(edge_texts)} edge(s), expected "
                                 f"{node + NUM_CELL_INPUTS} (one per input 0..{node})")
            for expected, edge_text in enumerate(edge_texts):
                op, at, index = (t.strip() for t in edge_text.partition("@"))
                if not at or not _INDEX.fullmatch(index):
                    raise ValueError(f"DPNAS genotype string: node {node}: expected 'op@state', "
                                     f"got {edge_text.strip()!r}")
                if int(index) != expected:
                    raise ValueError(f"DPNAS genotype string: node {node}: edge {expected} must come from state "
                                     f"{expected}, got {int(index)}")
                if op not in PRIMITIVES:
                    raise ValueError(f"DPNAS genotype string: node {node}: unknown op {op!r}; expected one of "
                                     f"{', '.join(PRIMITIVES)}")
                ops.append(op)
        return cls(tuple(ops), **choices)


def check_connected(genotype: DpnasGenotype) -> None:
    """ValueError unless the cell's output depends on its input (the decision for cut-off cells: refused, since a
    network of them outputs a constant and has nothing to learn but the classifier's bias)."""
    if not genotype.connected:
        raise ValueError(
            "DPNAS genotype: no intermediate node is reached from the cell input (every path is cut by 'none' "
            f"edges), so its network would output a constant; refusing to build {genotype.to_string()!r}")


def check_primitives(primitives: Sequence[str]) -> tuple[str, ...]:
    """`primitives` as a tuple: DPNAS primitives, each at most once, at least one of them not ``none`` (a search
    space's candidate ops, the alpha's columns); ValueError otherwise."""
    names = tuple(primitives)
    unknown = [name for name in names if name not in PRIMITIVES]
    if unknown or len(set(names)) != len(names) or all(name == "none" for name in names):
        raise ValueError(f"primitives must be distinct DPNAS primitives ({', '.join(PRIMITIVES)}), at least one "
                         f"of them not none; got {list(names)}")
    return names


def derive_dpnas_genotype(weights: Any, nodes: int, primitives: Sequence[str] = PRIMITIVES) -> DpnasGenotype:
    """The strongest op of every edge, ``none`` included: ``weights`` (num_edges(nodes), len(primitives)), numpy
    or torch (softmax weights or raw alphas; the argmax is the same); `primitives` names its columns (every DPNAS
    primitive, or the space's candidates: ``space.ops``). Ties go to the earlier op in ``primitives``.
    The DARTS rule (two strongest non-``none`` inputs per node) does not apply: ``none`` is how this space says
    "no edge".

    Why the repair: a search whose alphas favour ``none`` (an undertrained W makes the zero map the lowest-loss
    op, notably under DP noise) would otherwise end in a cell whose output is a constant, and a searched arm that
    cannot be trained. If the argmax cell is cut off from its input, the strongest non-``none`` (edge, op) among
    the edges out of state 0 replaces its edge's ``none``: one edge, the least change to the argmax that connects
    the cell (node 0's only input is state 0, so such an edge always exists)."""
    names = list(check_primitives(primitives))
    if hasattr(weights, "detach"):  # torch tensor, possibly on an accelerator or in low precision
        weights = weights.detach().cpu().double().numpy()
    w = np.asarray(weights, dtype=np.float64)
    expected = (num_edges(nodes), len(names))
    if w.shape != expected:
        raise ValueError(f"DPNAS weights: expected shape {expected} (edges, ops) for nodes={nodes}, got {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("DPNAS weights contain non-finite values")
    # argmax returns the first maximum: the earliest op in `primitives` on ties.
    ops = [names[k] for k in np.argmax(w, axis=1)]
    if DpnasGenotype(tuple(ops)).connected:
        return DpnasGenotype(tuple(ops))
    from_input = [e for e, (_, j) in enumerate(edge_endpoints(nodes)) if j == 0]
    kept = [k for k, name in enumerate(names) if name != "none"]
    candidates = w[np.ix_(from_input, kept)]  # (edges out of state 0, non-none ops); argmax: first on ties
    row, col = np.unravel_index(int(np.argmax(candidates)), candidates.shape)
    ops[from_input[row]] = names[kept[col]]
    return DpnasGenotype(tuple(ops))


def max_dpnas_genotype_length(nodes: int) -> int:
    """Upper bound on ``len(g.to_string())`` (ASCII bytes) for any DPNAS genotype with ``nodes`` nodes: every edge
    with the longest op name."""
    longest = max(len(p) for p in PRIMITIVES)
    edges = sum(longest + 1 + len(str(j)) for _, j in edge_endpoints(nodes))
    commas = sum(node for node in range(nodes))  # node i lists i + 1 edges
    choices = sum(len(f";{name}=") + max(map(len, values)) for name, values in CHOICES.items())
    return len(FIELD) + 1 + edges + commas + (nodes - 1) + choices
