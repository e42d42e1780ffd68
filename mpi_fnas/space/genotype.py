"""Cell topology, discrete genotypes, and their string form.

Cell topology (shared by the search cell and genotype derivation): two input states (0 and 1, the outputs of the
previous two cells) and ``nodes`` intermediate nodes; node ``i`` (0-based) is state ``i + 2`` and takes one edge from
every earlier state ``j = 0 .. i + 1``. Edges are enumerated node by node, then by input state: ``sum_{i < nodes}
(i + 2)`` edges (14 for 4 nodes); row ``e`` of an alpha matrix belongs to ``edge_endpoints(nodes)[e]``.

String form (``Genotype.to_string`` / ``Genotype.from_string``), ASCII, no whitespace, fields in this order::

    normal=OP@J,OP@J|OP@J,OP@J|...;normal_concat=K,K,...;reduce=OP@J,OP@J|...;reduce_concat=K,K,...

``|`` separates nodes (node 0 first), ``,`` a node's two edges; ``OP@J`` is op OP applied to state J (``0 .. i + 1``
for node ``i``; a node's two inputs are distinct); ``*_concat`` lists the states concatenated into the cell output
(``2 .. nodes + 1``). The parser accepts the fields in any order (each exactly once) and whitespace around tokens,
never evaluates the text (no ``eval``/``literal_eval``), and raises ``ValueError`` on malformed text.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpi_fnas.space.ops import PRIMITIVES

EDGES_PER_NODE = 2  # DARTS keeps the two strongest incoming edges of every intermediate node.
NUM_CELL_INPUTS = 2  # states 0 and 1: outputs of the two previous cells

_OP_NAME = re.compile(r"[A-Za-z0-9_]+")
_INDEX = re.compile(r"[0-9]+")
_CELL_FIELDS = ("normal", "reduce")
_FIELDS = ("normal", "normal_concat", "reduce", "reduce_concat")


def num_edges(nodes: int) -> int:
    """Number of edges (alpha rows) of a search cell with ``nodes`` intermediate nodes."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    return sum(i + NUM_CELL_INPUTS for i in range(nodes))


def edge_endpoints(nodes: int) -> list[tuple[int, int]]:
    """``(node, input_state)`` per edge, in alpha-row order (node 0 first, then input state ascending)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    return [(i, j) for i in range(nodes) for j in range(i + NUM_CELL_INPUTS)]


@dataclass(frozen=True)
class Genotype:
    """A discrete cell pair derived from the supernet.

    ``normal`` / ``reduce``: ``2 * nodes`` pairs ``(op_name, input_state)``; entries ``2i`` and ``2i + 1``
    are the two edges into node ``i`` (state ``i + 2``). ``normal_concat`` / ``reduce_concat``: states
    concatenated into the cell output. Lists are converted to tuples; the structure (counts, state
    indices, distinct inputs, concat range) is validated on construction, op names against a primitive
    list only by ``from_string``.
    """

    normal: tuple[tuple[str, int], ...]
    normal_concat: tuple[int, ...]
    reduce: tuple[tuple[str, int], ...]
    reduce_concat: tuple[int, ...]

    def __post_init__(self) -> None:
        nodes = None
        for field in _CELL_FIELDS:
            edges = _as_edges(getattr(self, field), field)
            object.__setattr__(self, field, edges)
            if len(edges) == 0 or len(edges) % EDGES_PER_NODE:
                raise ValueError(
                    f"genotype {field}: expected {EDGES_PER_NODE} edges per node (a non-zero even count), "
                    f"got {len(edges)} edges"
                )
            cell_nodes = len(edges) // EDGES_PER_NODE
            if nodes is not None and cell_nodes != nodes:
                raise ValueError(f"genotype: normal has {nodes} nodes but reduce has {cell_nodes}")
            nodes = cell_nodes
            _check_cell(edges, field)
        assert nodes is not None
        for field in ("normal_concat", "reduce_concat"):
            concat = _as_indices(getattr(self, field), field)
            object.__setattr__(self, field, concat)
            _check_concat(concat, nodes, field)

    @property
    def nodes(self) -> int:
        """Number of intermediate nodes per cell."""
        return len(self.normal) // EDGES_PER_NODE

    def to_string(self) -> str:
        """Compact string in the format of the module docstring; ``from_string`` inverts it exactly."""
        parts = []
        for field in _CELL_FIELDS:
            edges: tuple[tuple[str, int], ...] = getattr(self, field)
            node_texts = [
                ",".join(f"{op}@{j}" for op, j in edges[k : k + EDGES_PER_NODE])
                for k in range(0, len(edges), EDGES_PER_NODE)
            ]
            concat: tuple[int, ...] = getattr(self, f"{field}_concat")
            parts.append(f"{field}={'|'.join(node_texts)}")
            parts.append(f"{field}_concat={','.join(str(k) for k in concat)}")
        return ";".join(parts)

    @classmethod
    def from_string(cls, text: str, *, primitives: Sequence[str] = PRIMITIVES) -> Genotype:
        """Parse ``to_string`` output. Op names must be in ``primitives`` and not ``none``.

        Raises ``ValueError`` naming the offending field/node for: missing/duplicate/unknown fields, a node
        without exactly two edges, an unknown op, a malformed or out-of-range state index, a bad concat list.
        """
        if not isinstance(text, str):
            raise ValueError(f"genotype string must be str, got {type(text).__name__}")
        allowed = [p for p in primitives if p != "none"]
        values: dict[str, str] = {}
        for part in text.strip().split(";"):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"genotype string: expected 'field=value', got {part.strip()!r}")
            if key not in _FIELDS:
                raise ValueError(f"genotype string: unknown field {key!r}; expected {', '.join(_FIELDS)}")
            if key in values:
                raise ValueError(f"genotype string: field {key!r} given twice")
            values[key] = value
        missing = [f for f in _FIELDS if f not in values]
        if missing:
            raise ValueError(f"genotype string: missing field(s) {', '.join(missing)}")

        cells = {}
        for field in _CELL_FIELDS:
            edges: list[tuple[str, int]] = []
            for i, node_text in enumerate(values[field].split("|")):
                edge_texts = node_text.split(",")
                if len(edge_texts) != EDGES_PER_NODE:
                    raise ValueError(
                        f"genotype string: {field} node {i} has {len(edge_texts)} edge(s), "
                        f"expected {EDGES_PER_NODE}: {node_text.strip()!r}"
                    )
                for edge_text in edge_texts:
                    op, sep, index = (t.strip() for t in edge_text.partition("@"))
                    if not sep:
                        raise ValueError(
                            f"genotype string: {field} node {i}: expected 'op@state', "
                            f"got {edge_text.strip()!r}"
                        )
                    if op not in allowed:
                        raise ValueError(
                            f"genotype string: {field} node {i}: unknown op {op!r}; "
                            f"expected one of {', '.join(allowed)}"
                        )
                    edges.append((op, _parse_index(index, f"{field} node {i}")))
            cells[field] = tuple(edges)
        concats = {
            f"{field}_concat": tuple(
                _parse_index(k, f"{field}_concat") for k in values[f"{field}_concat"].split(",")
            )
            for field in _CELL_FIELDS
        }
        return cls(
            normal=cells["normal"],
            normal_concat=concats["normal_concat"],
            reduce=cells["reduce"],
            reduce_concat=concats["reduce_concat"],
        )


def derive_genotype(
    weights_normal: Any, weights_reduce: Any, nodes: int, primitives: Sequence[str] = PRIMITIVES
) -> Genotype:
    """Discretise softmax op weights, each ``(num_edges(nodes), len(primitives))``, numpy or torch (DARTS).

    For every node, each incoming edge is scored by its strongest non-``none`` op; the two best-scoring edges
    are kept, each with that op. ``none`` is never chosen, even where it has the largest weight.

    Ties, made deterministic: between ops of one edge the earlier op in ``primitives`` wins; between edges of
    one node the lower input state wins. The two kept edges of a node are listed by ascending input state (not
    by score), so the genotype depends only on the chosen graph. Concat is all intermediate states.
    """
    names = list(primitives)
    if len(set(names)) != len(names):
        raise ValueError(f"primitives contain duplicates: {names}")
    candidate_ops = [k for k, name in enumerate(names) if name != "none"]
    if not candidate_ops:
        raise ValueError("primitives must contain at least one op other than 'none'")
    expected_shape = (num_edges(nodes), len(names))
    cells = []
    for label, weights in (("normal", weights_normal), ("reduce", weights_reduce)):
        w = _to_numpy(weights)
        if w.shape != expected_shape:
            raise ValueError(
                f"{label} weights: expected shape {expected_shape} (edges, ops) for nodes={nodes}, "
                f"got {w.shape}"
            )
        if not np.all(np.isfinite(w)):
            raise ValueError(f"{label} weights contain non-finite values")
        candidates = w[:, candidate_ops]
        # argmax returns the first maximum, i.e. the earliest op in `primitives` on ties.
        best_op = [names[candidate_ops[k]] for k in np.argmax(candidates, axis=1)]
        strength = candidates.max(axis=1)
        edges: list[tuple[str, int]] = []
        row = 0
        for i in range(nodes):
            inputs = range(i + NUM_CELL_INPUTS)
            ranked = sorted(inputs, key=lambda j, row=row: (-strength[row + j], j))
            edges.extend((best_op[row + j], j) for j in sorted(ranked[:EDGES_PER_NODE]))
            row += len(inputs)
        cells.append(tuple(edges))
    concat = tuple(range(NUM_CELL_INPUTS, NUM_CELL_INPUTS + nodes))
    return Genotype(normal=cells[0], normal_concat=concat, reduce=cells[1], reduce_concat=concat)


def max_genotype_length(nodes: int, primitives: Sequence[str] = PRIMITIVES) -> int:
    """Upper bound on ``len(g.to_string())`` (characters = ASCII bytes) for any genotype with ``nodes``
    nodes whose ops come from ``primitives``; attained when every edge uses the longest op name and the
    largest state indices and the concat lists every intermediate state."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    op_names = [p for p in primitives if p != "none"]
    if not op_names:
        raise ValueError("primitives must contain at least one op other than 'none'")
    longest_op = max(len(p) for p in op_names)
    # Node i's inputs are <= i + 1; bound both of its indices by the width of i + 1.
    edges_text = sum(EDGES_PER_NODE * (longest_op + 1 + len(str(i + 1))) for i in range(nodes))
    separators = nodes * (EDGES_PER_NODE - 1) + (nodes - 1)  # ',' within nodes, '|' between them
    states = range(NUM_CELL_INPUTS, NUM_CELL_INPUTS + nodes)
    concat_text = sum(len(str(k)) for k in states) + (nodes - 1)
    per_cell = len("normal=") + edges_text + separators + len(";normal_concat=") + concat_text
    # "reduce" and "normal" have the same length, so both cells share the bound; plus the ';' between them.
    return 2 * per_cell + 1


def _to_numpy(weights: Any) -> np.ndarray:
    if hasattr(weights, "detach"):  # torch tensor, possibly on an accelerator or in low precision
        weights = weights.detach().cpu().double().numpy()
    return np.asarray(weights, dtype=np.float64)


def _as_edges(value: Any, field: str) -> tuple[tuple[str, int], ...]:
    try:
        pairs = [tuple(pair) for pair in value]
    except TypeError as exc:
        raise ValueError(f"genotype {field}: expected a sequence of (op, state) pairs") from exc
    edges = []
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str):
            raise ValueError(f"genotype {field}: expected (op_name, state_index) pairs, got {pair!r}")
        op, index = pair
        if not _OP_NAME.fullmatch(op):
            # The string format relies on op names free of separators.
            raise ValueError(f"genotype {field}: op name {op!r} must match [A-Za-z0-9_]+")
        edges.append((op, _as_int(index, field)))
    return tuple(edges)


def _as_indices(value: Any, field: str) -> tuple[int, ...]:
    try:
        return tuple(_as_int(k, field) for k in value)
    except TypeError as exc:
        raise ValueError(f"genotype {field}: expected a sequence of state indices") from exc


def _as_int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"genotype {field}: state index must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError as exc:
        raise ValueError(f"genotype {field}: state index must be an int, got {value!r}") from exc


def _check_cell(edges: tuple[tuple[str, int], ...], field: str) -> None:
    for k in range(0, len(edges), EDGES_PER_NODE):
        node = k // EDGES_PER_NODE
        inputs = [j for _, j in edges[k : k + EDGES_PER_NODE]]
        for j in inputs:
            if not 0 <= j < node + NUM_CELL_INPUTS:
                raise ValueError(
                    f"genotype {field} node {node}: input state {j} out of range "
                    f"0..{node + NUM_CELL_INPUTS - 1}"
                )
        if len(set(inputs)) != len(inputs):
            raise ValueError(f"genotype {field} node {node}: the two inputs must differ, got {inputs}")


def _check_concat(concat: tuple[int, ...], nodes: int, field: str) -> None:
    last = NUM_CELL_INPUTS + nodes - 1
    if not concat:
        raise ValueError(f"genotype {field}: must list at least one state")
    for k in concat:
        if not NUM_CELL_INPUTS <= k <= last:
            raise ValueError(f"genotype {field}: state {k} out of range {NUM_CELL_INPUTS}..{last}")
    if len(set(concat)) != len(concat):
        raise ValueError(f"genotype {field}: duplicate states in {list(concat)}")


def _parse_index(text: str, where: str) -> int:
    text = text.strip()
    # fullmatch on ASCII digits rejects signs, spaces inside, and non-ASCII digits that int() would accept.
    if not _INDEX.fullmatch(text):
        raise ValueError(
            f"genotype string: {where}: state index must be a non-negative integer, got {text!r}"
        )
    return int(text)


# Defined last: construction validates with the helpers above.
#: The published DARTS (second order, "V2") CIFAR-10 cell pair, 4 nodes, as the reference architecture for the
#: augment (train-from-scratch) protocol. Edges are listed per node in the order the paper's genotype gives them.
DARTS_V2 = Genotype(
    normal=(
        ("sep_conv_3x3", 0), ("sep_conv_3x3", 1),
        ("sep_conv_3x3", 0), ("sep_conv_3x3", 1),
        ("sep_conv_3x3", 1), ("skip_connect", 0),
        ("skip_connect", 0), ("dil_conv_3x3", 2),
    ),
    normal_concat=(2, 3, 4, 5),
    reduce=(
        ("max_pool_3x3", 0), ("max_pool_3x3", 1),
        ("skip_connect", 2), ("max_pool_3x3", 1),
        ("max_pool_3x3", 0), ("skip_connect", 2),
        ("skip_connect", 2), ("max_pool_3x3", 1),
    ),
    reduce_concat=(2, 3, 4, 5),
)
