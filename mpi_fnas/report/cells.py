"""A derived cell drawn as a graph with matplotlib alone (no graphviz binaries, no display).

DARTS (:func:`draw_cell`), left to right: the two cell inputs c_{k-2} (above) and c_{k-1} (below); the intermediate
nodes 0 .. n-1 on a line (an edge that skips a node arcs over it); the output c_{k}, which concatenates the states in
``concat``. DPNAS (:func:`draw_dense_cell`): the one input node (the 1x1 conv of the cell input) on the same line as
the intermediate nodes, every kept edge (``none`` edges are absent) arcing above or below it. Each op edge is an
arrow labelled with its op and coloured by it; the concatenation edges are grey and dashed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.patches import Circle, FancyArrowPatch

NODE_RADIUS = 0.27  # data units; the axes keep an equal aspect so circles stay round
DENSE_SPACING = 1.8  # distance between neighbouring nodes of a DPNAS cell: room for a label on the straight edges
_INPUT_NAMES = ("c_{k-2}", "c_{k-1}")
_FILL = {"input": "#cfe3f7", "node": "#fcefc0", "output": "#cdebc8"}


def state_name(state: int) -> str:
    """Display name of a cell state: the two inputs, then the intermediate nodes 0, 1, ..."""
    return _INPUT_NAMES[state] if state < len(_INPUT_NAMES) else str(state - len(_INPUT_NAMES))


def op_colors(primitives: Sequence[str]) -> dict[str, str]:
    """One fixed colour per op name (matplotlib's tab10 cycle in `primitives` order), shared by every figure."""
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf")
    return {name: palette[i % len(palette)] for i, name in enumerate(primitives)}


def draw_cell(ax: Axes, edges: Sequence[tuple[str, int]], concat: Sequence[int], title: str,
              colors: dict[str, str] | None = None) -> None:
    """Draw one cell on `ax`.

    edges: ``2 * nodes`` pairs (op, input state) as in :class:`mpi_fnas.space.genotype.Genotype`; entries 2i and
    2i + 1 feed node i (state i + 2). concat: the states concatenated into the output.
    """
    colors = colors or {}
    nodes = len(edges) // 2
    # Inputs above and below the line of intermediate nodes, the output past its end and below it, so that no
    # edge runs through a node: edges from c_{k-2} bow up, from c_{k-1} down, node-to-node edges arc over the
    # line (higher when they skip nodes), and the concatenation edges arc under it. Labels are drawn over nodes.
    positions = {0: (0.0, 1.6), 1: (0.0, -1.6)}
    positions.update({i + 2: (float(i + 1), 0.0) for i in range(nodes)})
    output = (float(nodes + 1), -1.2)

    for k, (op, source) in enumerate(edges):
        target = k // 2 + 2
        span = positions[target][0] - positions[source][0]
        rad = {0: -0.15, 1: 0.15}.get(source, -0.3 if span <= 1 else -0.45)
        colour = colors.get(op, "#444444")
        _arrow(ax, positions[source], positions[target], rad, colour, solid=True)
        # Each label lies along its own edge (rotated with it): edges fanning out of one input stay apart.
        (x, y), angle = _arc_point(positions[source], positions[target], rad, 0.55)
        ax.text(x, y, op, fontsize=8, ha="center", va="center", color=colour, zorder=7, rotation=angle,
                rotation_mode="anchor",
                bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    for state in concat:
        _arrow(ax, positions[state], output, 0.25, "#9a9a9a", solid=False)

    for state, (x, y) in positions.items():
        _node(ax, (x, y), state_name(state), _FILL["input" if state < 2 else "node"])
    _node(ax, output, "c_{k}", _FILL["output"])
    ax.set_xlim(-0.5, nodes + 1.5)
    ax.set_ylim(-2.0, 2.0)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)


def draw_dense_cell(ax: Axes, node_edges: Sequence[Sequence[tuple[str, int]]], title: str,
                    colors: dict[str, str] | None = None) -> None:
    """Draw one DPNAS cell on `ax`.

    node_edges: per intermediate node i, its kept edges (op, input state), state 0 being the cell's input node and
    state j >= 1 node j - 1 (as :meth:`mpi_fnas.space.dpnas.DpnasGenotype.node_edges`). Every node is concatenated
    into the output.
    """
    colors = colors or {}
    nodes = len(node_edges)
    positions = {state: (DENSE_SPACING * state, 0.0) for state in range(nodes + 1)}
    output = (DENSE_SPACING * (nodes + 1), -1.4)
    reach = 1.0  # the farthest arc from the line, for the axes' limits
    for i, edges in enumerate(node_edges):
        target = i + 1
        for op, source in edges:
            span = target - source
            # Neighbours are joined straight; longer edges arc, alternately above and below the line (by span),
            # farther the more nodes they skip, so that parallel edges stay apart.
            rad = 0.0 if span == 1 else (-1 if span % 2 == 0 else 1) * (0.2 + 0.04 * span)
            reach = max(reach, abs(rad) * DENSE_SPACING * span / 2 + 0.4)
            colour = colors.get(op, "#444444")
            _arrow(ax, positions[source], positions[target], rad, colour, solid=True)
            (x, y), angle = _arc_point(positions[source], positions[target], rad, 0.5)
            ax.text(x, y, short_op_name(op), fontsize=7, ha="center", va="center", color=colour, zorder=7,
                    rotation=angle, rotation_mode="anchor",
                    bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    for state in range(1, nodes + 1):
        _arrow(ax, positions[state], output, 0.2, "#9a9a9a", solid=False)
    for state, centre in positions.items():
        _node(ax, centre, "in" if state == 0 else str(state - 1), _FILL["input" if state == 0 else "node"])
    _node(ax, output, "out", _FILL["output"])
    ax.set_xlim(-0.5, DENSE_SPACING * (nodes + 1) + 0.5)
    ax.set_ylim(-max(reach, 1.8), reach)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)


def short_op_name(op: str) -> str:
    """The label of a DPNAS op on a drawn edge: ``conv_3x3_selu`` -> ``conv selu``, ``max_pool_3x3`` -> ``max pool``,
    ``skip_connect`` -> ``skip``."""
    if op.startswith("conv_3x3_"):
        return "conv " + op.removeprefix("conv_3x3_")
    return {"skip_connect": "skip"}.get(op, op.removesuffix("_3x3").replace("_", " "))


def _node(ax: Axes, centre: tuple[float, float], label: str, fill: str) -> None:
    ax.add_patch(Circle(centre, NODE_RADIUS, facecolor=fill, edgecolor="#333333", linewidth=1.0, zorder=5))
    # Plain text, not mathtext: braces are shown as typed (c_{k-1} is the DARTS name of the input).
    ax.text(*centre, label, fontsize=8.5, ha="center", va="center", zorder=6)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], rad: float, colour: str, *,
           solid: bool) -> None:
    # Start and end on the circles' rims (along the chord; the arcs are shallow enough for that to look right).
    dx, dy = end[0] - start[0], end[1] - start[1]
    length = math.hypot(dx, dy) or 1.0
    ux, uy = dx / length, dy / length
    tail = (start[0] + NODE_RADIUS * ux, start[1] + NODE_RADIUS * uy)
    head = (end[0] - NODE_RADIUS * ux, end[1] - NODE_RADIUS * uy)
    ax.add_patch(FancyArrowPatch(tail, head, arrowstyle="-|>", mutation_scale=10, shrinkA=0, shrinkB=0,
                                 connectionstyle=f"arc3,rad={rad}", color=colour, linewidth=1.2,
                                 linestyle="-" if solid else "--", zorder=3))


def _arc_point(start: tuple[float, float], end: tuple[float, float], rad: float,
               t: float) -> tuple[tuple[float, float], float]:
    """The point at parameter `t` of matplotlib's ``arc3`` curve and the curve's direction there in degrees, kept
    upright for text. arc3 is a quadratic Bézier whose control point is the chord's midpoint + rad · (dy, −dx);
    valid in data units because the axes' aspect is equal (arc3 works in display units)."""
    dx, dy = end[0] - start[0], end[1] - start[1]
    control = ((start[0] + end[0]) / 2 + rad * dy, (start[1] + end[1]) / 2 - rad * dx)
    a, b, c = (1 - t) ** 2, 2 * t * (1 - t), t**2
    point = (a * start[0] + b * control[0] + c * end[0], a * start[1] + b * control[1] + c * end[1])
    tangent = (2 * (1 - t) * (control[0] - start[0]) + 2 * t * (end[0] - control[0]),
               2 * (1 - t) * (control[1] - start[1]) + 2 * t * (end[1] - control[1]))
    angle = math.degrees(math.atan2(tangent[1], tangent[0]))
    if angle > 90:
        angle -= 180
    elif angle < -90:
        angle += 180
    return point, angle
