"""The DPNAS search space (space.kind: dpnas): ops, cell and network shapes, per-example independence under
GroupNorm, derivation with zero edges (the all-zero cell refused), the genotype string, the factory, the config and
the report's drawing. All in-process and cheap; the end-to-end run is tests/test_dpnas_run.py."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import perturb_others
from pre_recipe import PRE_RECIPE
from torch import nn

from mpi_fnas.config import ConfigError, SpaceConfig, load_config
from mpi_fnas.federation.job_plan import SetupError, parse_genotype
from mpi_fnas.federation.schedules import path_noise
from mpi_fnas.privacy.per_sample import hooks_supported, per_sample_gradients
from mpi_fnas.space import SPACE_KINDS, Genotype, build_augment_network, build_supernet, search_space
from mpi_fnas.space.dpnas import (
    PRIMITIVES,
    DerivedDpnasCell,
    DpnasGenotype,
    DpnasNetwork,
    DpnasSearchCell,
    DpnasSearchNetwork,
    derive_dpnas_genotype,
    edge_endpoints,
    make_dpnas_op,
    max_dpnas_genotype_length,
    num_edges,
)

NONE = PRIMITIVES.index("none")
CONV_OPS = [p for p in PRIMITIVES if p.startswith("conv_3x3_")]


def random_genotype(rng: random.Random, nodes: int = 5, p_none: float = 0.3) -> DpnasGenotype:
    return DpnasGenotype(tuple("none" if rng.random() < p_none else rng.choice(PRIMITIVES[1:])
                               for _ in range(num_edges(nodes))))


# A connected cell with every kind of op and two 'none' edges (node 1 keeps 1 of its 2 inputs, node 3 3 of 4).
MIXED = DpnasGenotype((
    "conv_3x3_selu",
    "max_pool_3x3", "none",
    "conv_3x3_relu", "conv_3x3_tanh", "skip_connect",
    "conv_3x3_sigmoid", "none", "avg_pool_3x3", "conv_3x3_hardtanh",
    "conv_3x3_linear", "conv_3x3_selu", "skip_connect", "max_pool_3x3", "conv_3x3_tanh",
))


# ---------------------------------------------------------------------------------------------- shapes and edges


def test_edge_count_and_order() -> None:
    assert [num_edges(n) for n in (1, 2, 3, 4, 5)] == [1, 3, 6, 10, 15]
    # node i takes the input node (state 0) and every earlier node (states 1..i), node by node
    assert edge_endpoints(3) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert len(PRIMITIVES) == 10 and len(set(PRIMITIVES)) == 10
    assert PRIMITIVES[NONE] == "none" and len(CONV_OPS) == 6
    with pytest.raises(ValueError):
        num_edges(0)


def test_every_op_keeps_the_shape_and_convs_are_depthwise_with_parameter_free_groupnorm() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 8, 7, 7)
    for name in PRIMITIVES:
        op = make_dpnas_op(name, 8)
        assert op(x).shape == x.shape, name
        assert not any(getattr(m, "inplace", False) for m in op.modules()), name
    for name in CONV_OPS:
        conv, norm, _ = make_dpnas_op(name, 8)
        assert isinstance(conv, nn.Conv2d) and conv.groups == 8 and conv.kernel_size == (3, 3) and conv.bias is None
        assert isinstance(norm, nn.GroupNorm) and norm.num_groups == 4 and not norm.affine
        assert [p.shape for p in make_dpnas_op(name, 8).parameters()] == [(8, 1, 3, 3)]  # the conv's weight only
    assert torch.equal(make_dpnas_op("none", 8)(x), torch.zeros_like(x))
    assert torch.equal(make_dpnas_op("skip_connect", 8)(x), x)
    assert isinstance(make_dpnas_op("conv_3x3_selu", 8)[2], nn.SELU)  # SELU, as the paper names it
    with pytest.raises(ValueError, match="unknown DPNAS op"):
        make_dpnas_op("sep_conv_3x3", 8)


def test_search_cell_concatenates_nodes_and_alpha_rows_drive_their_edges() -> None:
    """Route through chosen edges only: row (node 2 <- node 1) drives that edge, the output is the 3 nodes."""
    torch.manual_seed(1)
    cell = DpnasSearchCell(3, 5, 4)
    x = torch.randn(2, 5, 6, 6)
    weights = torch.zeros(num_edges(3), len(PRIMITIVES))
    weights[:, NONE] = 1.0
    rows = {edge: row for row, edge in enumerate(edge_endpoints(3))}
    skip = PRIMITIVES.index("skip_connect")
    for edge in ((0, 0), (2, 1)):  # node 0 <- input, node 2 <- node 0 (state 1)
        weights[rows[edge]] = F.one_hot(torch.tensor(skip), len(PRIMITIVES)).float()
    out = cell(x, weights)
    state0 = cell.preprocess(x)
    assert out.shape == (2, 3 * 4, 6, 6)
    assert torch.allclose(out, torch.cat([state0, torch.zeros_like(state0), state0], dim=1))


@pytest.mark.parametrize(("stages", "nodes", "size"), [((8, 16, 32), 5, 16), ((4, 4, 8), 2, 15), ((6,), 1, 8)])
def test_supernet_and_derived_network_shapes(stages: tuple[int, ...], nodes: int, size: int) -> None:
    torch.manual_seed(2)
    net = DpnasSearchNetwork(stages, num_classes=7, nodes=nodes)
    x = torch.randn(3, 3, size, size)
    assert net(x).shape == (3, 7)
    # one alpha (edges, ops), no reduction alpha; every cell of every stage reads the same weights
    assert [tuple(a.shape) for a in net.alphas()] == [(num_edges(nodes), 10)]
    soft = net.alpha_softmax()
    assert soft["normal"].shape == (num_edges(nodes), 10) and soft["reduce"].shape == (0, 10)
    assert torch.allclose(soft["normal"].sum(dim=1), torch.ones(num_edges(nodes)))
    # W and A partition the parameters, W in named_parameters order (the party checks its wire order against it)
    assert [n for n, _ in net.named_weights()] == [n for n, _ in net.named_parameters() if n != "alpha"]
    assert {id(p) for p in net.weights()} | {id(net.alpha)} == {id(p) for p in net.parameters()}
    # stage s: a cell at stage_channels[s] concatenating `nodes` nodes, then a stride-2 pool
    h = net.stem(x)
    for s, cell in enumerate(net.cells):
        h = net.pool(cell(h, soft["normal"]))
        side = -(-size // 2 ** (s + 1))
        assert h.shape == (3, nodes * stages[s], side, side)
    assert net.classifier.in_features == nodes * stages[-1]
    derived = DpnasNetwork(net.genotype() if net.genotype().connected else DpnasGenotype(("skip_connect",) *
                           num_edges(nodes)), stages, num_classes=7)
    assert derived(x).shape == (3, 7)
    assert list(net.buffers()) == [] and list(derived.buffers()) == []


@pytest.mark.parametrize("side", [28, 15])
def test_a_stride_2_stem_runs_every_stage_at_half_the_side(side: int) -> None:
    """``space.stem_stride: 2``: the stem's conv halves the input (rounding up), each stage halves it again; the
    weights are those of the stride-1 network (the same shapes), so the accounting's sizes do not change."""
    torch.manual_seed(7)
    x = torch.randn(2, 1, side, side)
    for one, two in ((DpnasSearchNetwork((4, 8), 10, nodes=2, in_channels=1),
                      DpnasSearchNetwork((4, 8), 10, nodes=2, in_channels=1, stem_stride=2)),
                     (DpnasNetwork(MIXED, (4, 8), 10, in_channels=1),
                      DpnasNetwork(MIXED, (4, 8), 10, in_channels=1, stem_stride=2))):
        assert [p.shape for p in one.parameters()] == [p.shape for p in two.parameters()]
        half = -(-side // 2)
        assert two.stem(x).shape == (2, 4, half, half) and one.stem(x).shape == (2, 4, side, side)
        assert two(x).shape == (2, 10)
    with pytest.raises(ValueError, match="stem_stride must be >= 1"):
        DpnasNetwork(MIXED, (4, 8), 10, stem_stride=0)


@pytest.mark.parametrize("head_pool", [1, 2, 3])
def test_the_classifier_reads_the_last_maps_pooled_to_head_pool_squared(head_pool: int) -> None:
    """``space.head_pool``: the last stage's (N, C, h, w) maps average-pooled to head_pool x head_pool, flattened
    channel by channel, are the classifier's input (1: the global average pool)."""
    torch.manual_seed(8)
    x = torch.randn(3, 1, 16, 16)
    for net in (DpnasSearchNetwork((4, 8), 10, nodes=2, in_channels=1, head_pool=head_pool),
                DpnasNetwork(MIXED, (4, 8), 10, in_channels=1, head_pool=head_pool)):
        channels = 8 * (2 if isinstance(net, DpnasSearchNetwork) else MIXED.nodes)  # the last cell's concatenation
        assert net.classifier.in_features == channels * head_pool ** 2
        h = net.stem(x)
        for cell in net.cells:
            h = net.pool(cell(h, net.alpha_softmax()["normal"]) if isinstance(net, DpnasSearchNetwork) else
                         cell(h, 0.0, None))
        assert h.shape == (3, channels, 4, 4)
        if head_pool == 1:
            expected = h.mean(dim=(2, 3))
        elif head_pool == 2:  # the mean of each 2x2 quadrant, channel by channel
            expected = h.reshape(3, channels, 2, 2, 2, 2).mean(dim=(3, 5)).reshape(3, -1)
        else:
            expected = F.adaptive_avg_pool2d(h, head_pool).reshape(3, -1)
        assert torch.allclose(net(x), net.classifier(expected), atol=1e-6)
    with pytest.raises(ValueError, match="head_pool must be >= 1"):
        DpnasNetwork(MIXED, (4, 8), 10, head_pool=0)


def test_derived_cell_builds_exactly_the_kept_edges() -> None:
    cell = DerivedDpnasCell(MIXED, 6, 4)
    assert len(cell.ops) == 13  # 15 edges, two of them 'none'
    assert cell.endpoints == tuple((i, j) for i, j in edge_endpoints(5)
                                   if MIXED.ops[edge_endpoints(5).index((i, j))] != "none")
    net = DpnasNetwork(MIXED, (4, 8), num_classes=10)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3) and m.groups > 1]
    conv_edges = sum(op.startswith("conv_3x3_") for op in MIXED.ops)
    assert len(convs) == 2 * conv_edges  # one depthwise conv per conv edge per stage
    # hand count: stem 3·4·9; per stage the 1x1 input conv and C·9 per conv edge; the classifier
    expected = 3 * 4 * 9 + (4 * 4 + conv_edges * 4 * 9) + (20 * 8 + conv_edges * 8 * 9) + (40 * 10 + 10)
    assert net.num_params() == expected


# ---------------------------------------------------------------------------------------------- per-example gradients


@pytest.mark.parametrize("train", [True, False])
def test_outputs_are_per_example_under_groupnorm(train: bool) -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 3, 8, 8)
    for net in (DpnasSearchNetwork((4, 8), 10, nodes=3), DpnasNetwork(MIXED, (4, 8), 10)):
        net.train(train)
        with torch.no_grad():
            assert (net(x)[0] - net(perturb_others(x))[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize(("which", "stem_stride", "head_pool", "path"), [
    *((which, 1, 1, False) for which in ("supernet W", "supernet A", "derived")),
    *((which, 2, 2, False) for which in ("supernet W", "supernet A", "derived")),
    *((which, 1, 1, True) for which in ("supernet W", "supernet A")),  # a derived network has no path to sample
])
def test_per_example_gradient_does_not_depend_on_the_other_examples(which: str, stem_stride: int, head_pool: int,
                                                                    path: bool) -> None:
    """Example 0's gradient is the same whatever the rest of the batch holds, and equals its own backward; W is
    taken by the hooks (depthwise and 1x1 convs, Linear; GroupNorm has no weights), A both as per-example copies
    and by vmap. With a stride-2 stem and a 2x2 head too (``space.stem_stride``, ``space.head_pool``), and on a
    sampled path (``search.method: gdas``)."""
    torch.manual_seed(4)
    net = (DpnasNetwork(MIXED, (4, 8), 10, stem_stride=stem_stride, head_pool=head_pool) if which == "derived"
           else DpnasSearchNetwork((4, 8), 10, nodes=3, stem_stride=stem_stride, head_pool=head_pool))
    if path:
        net.path_noise = path_noise(1, 3, tuple(net.alpha.shape))
    if which == "supernet A":
        params = dict(net.named_alphas())
    else:
        params = dict(net.named_weights()) if which == "supernet W" else dict(net.named_parameters())
    assert hooks_supported(net, params)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4])
    net.zero_grad()
    F.cross_entropy(net(x[:1]), y[:1]).backward()
    alone = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)  # a path's ops alone
                       for p in params.values()])
    for method in ("hooks", "vmap") if which == "supernet A" else ("hooks",):
        first = per_sample_gradients(net, params, x, y, method=method)
        again = per_sample_gradients(net, params, perturb_others(x), y, method=method)
        assert torch.allclose(first[0], again[0], atol=1e-6)
        assert not torch.allclose(first[1], again[1], atol=1e-4)  # the others' did change: not vacuous
        assert torch.allclose(first[0], alone, rtol=1e-4, atol=1e-6)


def _one_hot_forward(net: DpnasSearchNetwork, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The supernet's forward with every op run and mixed by `weights` (edges, ops): the reference of a path."""
    h = net.stem(x)
    for cell in net.cells:
        h = net.pool(cell(h, weights))
    return net.classifier(F.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.mark.parametrize("nodes", [3, 5])
def test_a_sampled_path_runs_one_op_per_edge_with_a_straight_through_alpha_gradient(nodes: int) -> None:
    """``search.method: gdas``: the op of edge e is argmax(alpha + g)[e]; the output is that op alone (weight 1),
    the other ops get no gradient, and A's gradient is the straight-through one of softmax((alpha + g) / τ) through
    the ops that ran; at 5 nodes (DPNAS's cell, 15 edges) as at 3."""
    torch.manual_seed(9)
    net = DpnasSearchNetwork((4, 8), 10, nodes=nodes)
    assert net.alpha.shape == (nodes * (nodes + 1) // 2, 10)
    with torch.no_grad():
        net.alpha.normal_()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4])
    noise = path_noise(0, 7, tuple(net.alpha.shape))
    net.path_noise, net.path_temperature = noise, 0.5
    index = (net.alpha + noise).argmax(dim=-1)
    assert len(set(index.tolist())) > 1  # a path through more than one kind of op: not vacuous
    F.cross_entropy(net(x), y).backward()
    alpha_grad = net.alpha.grad.clone()
    hard = F.one_hot(index, 10).float()
    for cell in net.cells:
        for e, edge in enumerate(cell.edges):
            for k, op in enumerate(edge.ops):
                grads = [p.grad for p in op.parameters()]
                if k == int(index[e]) and grads:
                    assert all(g is not None and g.abs().sum() > 0 for g in grads)
                else:
                    assert all(g is None for g in grads), (e, k)  # never run
    net.zero_grad()
    net.path_noise = None
    alpha = net.alpha
    soft = F.softmax((alpha + noise) / 0.5, dim=-1)
    reference = _one_hot_forward(net, x, hard * (hard - soft.detach() + soft))  # the other ops times a constant 0
    F.cross_entropy(reference, y).backward()
    assert torch.allclose(alpha_grad, net.alpha.grad, atol=1e-6)
    net.path_noise = noise
    with torch.no_grad():
        assert torch.allclose(net(x), _one_hot_forward(net, x, hard), atol=1e-6)


def test_the_path_draw_is_public_per_seed_and_step_and_gumbel() -> None:
    first = path_noise(3, 5, (6, 10))
    assert torch.equal(first, path_noise(3, 5, (6, 10)))  # every party draws the same path
    assert not torch.equal(first, path_noise(3, 6, (6, 10))) and not torch.equal(first, path_noise(4, 5, (6, 10)))
    many = path_noise(0, 1, (200, 500))
    assert abs(float(many.mean()) - 0.5772) < 0.01  # Gumbel(0, 1): mean γ, variance π²/6
    assert abs(float(many.var()) - math.pi ** 2 / 6) < 0.03
    shares = F.one_hot((torch.log(torch.tensor([0.5, 0.3, 0.2])) + path_noise(0, 2, (20000, 3))).argmax(-1), 3)
    assert torch.allclose(shares.float().mean(0), torch.tensor([0.5, 0.3, 0.2]), atol=0.015)  # a draw from softmax


def test_hooks_and_vmap_agree_on_the_whole_supernet_weights() -> None:
    torch.manual_seed(5)
    net = DpnasSearchNetwork((4, 8), 10, nodes=3)
    params = dict(net.named_weights())
    x, y = torch.randn(3, 3, 8, 8), torch.tensor([0, 5, 9])
    hooks = per_sample_gradients(net, params, x, y, method="hooks")
    assert torch.allclose(hooks, per_sample_gradients(net, params, x, y, method="vmap"), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------- derivation


def test_derivation_is_the_argmax_of_every_edge_with_none_meaning_no_edge() -> None:
    w = np.full((15, 10), 0.05)
    strongest = ["none"] * 15
    for e, (node, j) in enumerate(edge_endpoints(5)):
        if node == 4:  # node 4 keeps all five inputs: the DARTS top-2 rule does not apply
            strongest[e] = CONV_OPS[j]
        elif (node, j) == (0, 0):
            strongest[e] = "conv_3x3_selu"
        elif j == node:  # from the previous node
            strongest[e] = "skip_connect"
    for e, op in enumerate(strongest):
        w[e, PRIMITIVES.index(op)] = 0.3
    genotype = derive_dpnas_genotype(w, 5)
    assert genotype.ops == tuple(strongest)
    assert [len(genotype.node_edges(i)) for i in range(5)] == [1, 1, 1, 1, 5]
    assert genotype.connected and genotype.live_nodes() == [0, 1, 2, 3, 4]
    # ties go to the earlier op; torch input works the same
    tied = np.full((3, 10), 0.1)
    tied[0, PRIMITIVES.index("skip_connect")] = 0.2  # keeps the cell connected, so no repair is involved
    assert derive_dpnas_genotype(torch.tensor(tied), 2).ops == ("skip_connect", "none", "none")
    with pytest.raises(ValueError, match="expected shape"):
        derive_dpnas_genotype(np.zeros((14, 10)), 5)
    with pytest.raises(ValueError, match="non-finite"):
        derive_dpnas_genotype(np.full((15, 10), np.nan), 5)


def test_a_node_without_edges_is_a_zero_map_in_a_built_network() -> None:
    ops = list(MIXED.ops)
    ops[3:6] = ["none"] * 3  # node 2 loses every input; node 3 and 4 read it
    genotype = DpnasGenotype(tuple(ops))
    assert genotype.node_edges(2) == [] and genotype.live_nodes() == [0, 1, 3, 4]
    cell = DerivedDpnasCell(genotype, 6, 4).eval()
    out = cell(torch.randn(2, 6, 5, 5))
    assert torch.equal(out[:, 8:12], torch.zeros(2, 4, 5, 5))  # node 2's slice of the concatenation
    assert out[:, 12:].abs().sum() > 0


def test_a_cut_off_argmax_is_connected_by_its_strongest_edge_out_of_the_input() -> None:
    """Decision (docs/dpnas.md): alphas whose argmax cuts the cell off keep it, plus the one strongest non-'none'
    (edge, op) out of state 0; nothing else changes."""
    w = np.zeros((15, 10))
    w[:, NONE] = 1.0
    w[2, PRIMITIVES.index("conv_3x3_tanh")] = 0.9  # node 1 from node 0: not out of the input, never chosen
    w[3, PRIMITIVES.index("max_pool_3x3")] = 0.4  # node 2 from the input
    w[6, PRIMITIVES.index("conv_3x3_selu")] = 0.7  # node 3 from the input: the strongest out of state 0
    genotype = derive_dpnas_genotype(w, 5)
    expected = ["none"] * 15
    expected[6] = "conv_3x3_selu"
    assert genotype.ops == tuple(expected) and genotype.connected and genotype.live_nodes() == [3]
    # ties: the earliest edge, then the earliest op
    assert derive_dpnas_genotype(np.full((3, 10), 0.1), 2).ops == (PRIMITIVES[1], "none", "none")
    # cut off without being all zero: node 0's only input is 'none', every other edge reads a dead node
    w = np.zeros((15, 10))
    for e, (_, j) in enumerate(edge_endpoints(5)):
        w[e, NONE if j == 0 else PRIMITIVES.index("conv_3x3_relu")] = 1.0
    w[0, PRIMITIVES.index("skip_connect")] = 0.5
    repaired = derive_dpnas_genotype(w, 5)
    assert repaired.ops[0] == "skip_connect" and repaired.ops[1:] == derive_dpnas_genotype(w, 5).ops[1:]
    assert repaired.live_nodes() == [0, 1, 2, 3, 4]


def test_the_all_zero_cell_is_logged_but_refused_for_training() -> None:
    """Decision (docs/dpnas.md): a cut-off genotype (written by hand; a search no longer derives one) round-trips
    through the log's string form, but building or training a network from it is refused with one clear error (the
    network would output a constant)."""
    genotype = DpnasGenotype(("none",) * 15)
    assert not genotype.connected and genotype.live_nodes() == []
    assert DpnasGenotype.from_string(genotype.to_string()) == genotype  # the log can hold it
    for build in (lambda: DerivedDpnasCell(genotype, 3, 4), lambda: DpnasNetwork(genotype, (4,), 10)):
        with pytest.raises(ValueError, match="no intermediate node is reached from the cell input"):
            build()
    with pytest.raises(SetupError, match=r"^the searched genotype: DPNAS genotype: no intermediate node") as info:
        parse_genotype(genotype.to_string(), "the searched genotype", SpaceConfig(kind="dpnas", ops=[]))
    assert "\n" not in str(info.value)
    # cut off without being all zero: node 0's only input is 'none' and every other edge reads a dead node
    cut = DpnasGenotype(tuple("none" if j == 0 else "conv_3x3_selu" for _, j in edge_endpoints(5)))
    assert not cut.connected
    with pytest.raises(SetupError, match="no intermediate node"):
        parse_genotype(cut.to_string(), "augment.genotype", SpaceConfig(kind="dpnas", ops=[]))


# ---------------------------------------------------------------------------------------------- string form


def test_string_round_trip_property() -> None:
    rng = random.Random(0)
    for _ in range(300):
        nodes = rng.randint(1, 6)
        genotype = random_genotype(rng, nodes, p_none=rng.random())
        text = genotype.to_string()
        assert DpnasGenotype.from_string(text) == genotype
        assert text.isascii() and " " not in text
        assert len(text) <= max_dpnas_genotype_length(nodes)
    worst = DpnasGenotype(("conv_3x3_hardtanh",) * 15, stem="scattering", head="dpnas")  # attains the bound
    assert len(worst.to_string()) == max_dpnas_genotype_length(5)
    assert DpnasGenotype.from_string(worst.to_string()) == worst
    assert DpnasGenotype.from_string(" dpnas = skip_connect @ 0 | none@0 , max_pool_3x3@1 ").ops == (
        "skip_connect", "none", "max_pool_3x3")


@pytest.mark.parametrize(("text", "message"), [
    ("normal=sep_conv_3x3@0,skip_connect@1;normal_concat=2", "expected 'dpnas="),
    ("dpnas=", "node 0: expected 'op@state'"),
    ("dpnas=skip_connect@0|skip_connect@0", "node 1 lists 1 edge"),
    ("dpnas=skip_connect@0|skip_connect@1,none@0", "edge 0 must come from state 0"),
    ("dpnas=skip_connect@-1", "expected 'op@state'"),
    ("dpnas=sep_conv_3x3@0", "unknown op 'sep_conv_3x3'"),
    ("dpnas=__import__('os')@0", "unknown op"),
    ("dpnas=skip_connect", "expected 'op@state'"),
])
def test_malformed_strings_are_refused_naming_the_node(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DpnasGenotype.from_string(text)


def test_genotype_validates_on_construction() -> None:
    with pytest.raises(ValueError, match="not the edge count"):
        DpnasGenotype(("none",) * 14)
    with pytest.raises(ValueError, match="unknown op"):
        DpnasGenotype(("sep_conv_3x3",))
    with pytest.raises(ValueError, match="not one string"):
        DpnasGenotype("skip_connect")
    assert MIXED.op_counts()["none"] == 2 and sum(MIXED.op_counts().values()) == 15


# ---------------------------------------------------------------------------------------------- factory and config


def test_factory_builds_each_space_and_the_darts_path_is_unchanged() -> None:
    assert set(SPACE_KINDS) == {"darts", "dpnas"}
    with pytest.raises(ValueError, match="unknown space kind 'nasnet'"):
        search_space("nasnet")
    cfg = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.nodes=5", "space.stage_channels=[4, 8]"])
    dp = search_space("dpnas")
    net = dp.build_supernet(cfg.space, seed=3, in_channels=3, num_classes=10)
    assert isinstance(net, DpnasSearchNetwork) and net.stage_channels == (4, 8)
    assert dp.alpha_shapes(cfg.space) == ((15, 10), (0, 10))
    again = dp.build_supernet(cfg.space, seed=3, in_channels=3, num_classes=10)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters(), strict=True))
    trained = dp.build_augment_network(dp.parse_genotype(MIXED.to_string()), cfg, seed=0, in_channels=3,
                                       num_classes=10)
    assert isinstance(trained, DpnasNetwork) and trained.genotype == MIXED and trained.stage_channels == (4, 8)
    assert net.stem[0].stride == trained.stem[0].stride == (1, 1)
    assert net.head_pool == trained.head_pool == 1
    strided = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.stem_stride=2", "space.head_pool=2",
                                 "space.stage_channels=[4, 8]"])
    for built in (dp.build_supernet(strided.space, seed=3, in_channels=1, num_classes=10),  # both networks get both
                  dp.build_augment_network(MIXED, strided, seed=0, in_channels=1, num_classes=10)):
        assert built.stem[0].stride == (2, 2) and built.head_pool == 2
    # DARTS through the factory: bit-identical to the direct builders
    darts_cfg = load_config(None, [*PRE_RECIPE])
    through = search_space("darts").build_supernet(darts_cfg.space, seed=1, in_channels=3, num_classes=10)
    direct = build_supernet(darts_cfg.space, seed=1, in_channels=3, num_classes=10)
    assert all(torch.equal(a, b) for a, b in zip(through.parameters(), direct.parameters(), strict=True))
    genotype = direct.genotype()
    aug = search_space("darts").build_augment_network(genotype, darts_cfg, seed=1, in_channels=3, num_classes=10)
    ref = build_augment_network(genotype, channels=8, layers=3, seed=1, in_channels=3, num_classes=10)
    assert all(torch.equal(a, b) for a, b in zip(aug.parameters(), ref.parameters(), strict=True))
    assert isinstance(search_space("darts").parse_genotype(genotype.to_string()), Genotype)
    with pytest.raises(SetupError, match=r"^augment\.genotype: genotype string: unknown field 'dpnas'"):
        parse_genotype(MIXED.to_string(), "augment.genotype", SpaceConfig(kind="darts", ops=[]))


@pytest.mark.parametrize(("override", "message"), [
    (["space.kind=nasnet"], r"^space\.kind: 'nasnet' is not one of 'darts', 'dpnas'$"),
    (["space.stage_channels=[]"], r"^space\.stage_channels: \[\] must be a non-empty list of integers >= 1"),
    (["space.stage_channels=[8, 0]"], r"^space\.stage_channels: \[8, 0\] must be a non-empty list"),
    (["space.stage_channels=48"], r"^space\.stage_channels: expected list of int \(e\.g\. \[8, 16, 32\]\), got 48$"),
    (["space.stage_channels=[8, x]"], r"^space\.stage_channels: expected an integer, got 'x'$"),
    (["space.kind=dpnas", "space.norm=batchnorm", "mode=fnas"], r"^space\.norm: the dpnas space normalises"),
    (["space.kind=dpnas", "augment.auxiliary_weight=0.4"], r"^augment\.auxiliary_weight: the dpnas network has no"),
    (["space.stem_stride=3"], r"^space\.stem_stride: 3 must be 1 or 2$"),
    (["space.kind=darts", "space.ops=[]", "search.method=gdas"], r"^search\.method: gdas draws one op per edge"),
    (["search.method=gdas", "search.order=second_order", "mode=fnas"], r"^search\.order: second_order is refused with "
     r"search\.method gdas"),
    (["search.gdas_temperature=0"], r"^search\.gdas_temperature: 0(\.0)? must be > 0$"),
    (["space.head_pool=0"], r"^space\.head_pool: 0 must be in 1\.\.4$"),
    (["space.head_pool=3"], r"^space\.head_pool: 3 exceeds the last stage's 2x2 maps \(data\.image_size 16, stem "
     r"stride 1, 3 stages\): at most 2$"),
    (["space.kind=darts", "space.ops=[]", "space.head_pool=2"], r"^space\.head_pool: 2 is for space\.kind dpnas"),
    (["space.kind=darts", "space.ops=[]", "space.stem_stride=2"], r"^space\.stem_stride: 2 is for space\.kind dpnas"),
    (["space.kind=darts", "space.ops=[]", "space.stem=scattering"], r"^space\.stem: scattering is for space\.kind"),
    (["space.kind=darts", "space.ops=[]", "space.head=dpnas"], r"^space\.head: dpnas is for space\.kind dpnas"),
    (["space.stem=scattering", "space.stem_stride=2"], r"^space\.stem_stride: 2 is the conv stem's"),
    (["space.head=dpnas", "space.head_pool=2"], r"^space\.head_pool: 2 is the pool head's"),
])
def test_bad_space_config_is_one_line(override: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, override)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("path", ["configs/dpnas.yaml", "configs/cifar10_dpnas.yaml"])
def test_dpnas_configs_load_with_the_papers_cell(path: str) -> None:
    cfg = load_config(path)
    assert cfg.space.kind == "dpnas" and cfg.space.nodes == 5 and cfg.space.norm == "groupnorm"
    assert search_space(cfg.space.kind).alpha_shapes(cfg.space)[0] == (15, 10)
    if "cifar10" in path:
        assert cfg.space.stage_channels == [48, 96, 192] and cfg.data.dataset == "cifar10"
        assert cfg.privacy.target_epsilon == 3.0  # the paper's budget (ε, δ) = (3, 1e-5)


# ---------------------------------------------------------------------------------------------- report


def test_report_draws_a_dpnas_cell_and_its_single_alpha_heatmap() -> None:
    from mpi_fnas.report.figures import FIGURE_PIXELS, alphas_heatmap, alphas_over_epochs, cells_figure

    def size(png: bytes) -> tuple[int, int]:
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")

    assert size(cells_figure(MIXED.to_string(), "run", "dpnas")) == FIGURE_PIXELS
    all_zero = DpnasGenotype(("none",) * 15).to_string()
    assert cells_figure(all_zero, "run", "dpnas") is not None  # drawn (and labelled not trainable), not an error
    assert cells_figure(MIXED.to_string(), "run", "darts") is None  # not a DARTS genotype: no figure
    alphas = {"normal": np.full((2, 15, 10), 0.1, dtype=np.float32), "reduce": np.zeros((2, 0, 10), np.float32)}
    assert size(alphas_heatmap(alphas, "run", "dpnas")) == FIGURE_PIXELS
    assert size(alphas_over_epochs(alphas, "run", "dpnas")) == FIGURE_PIXELS


# ---------------------------------------------------------------------------------------------- every mode, in-process


@pytest.mark.parametrize("private", [False, True], ids=["vanilla-fnas", "dpfnas"])
def test_the_federation_runs_a_dpnas_iteration_and_logs_it(private: bool, tmp_path) -> None:
    """One iteration of Algorithm 1 with the DPNAS supernet built by the factory, as every mode runs it (vanilla and
    fnas share the exact path, dpfnas releases clipped and noised), the server's genotype and the log's epoch row;
    then one augment release of the derived network."""
    from mpi_fnas.config import load_config
    from mpi_fnas.federation.flat import STATS
    from mpi_fnas.federation.global_model import search_server
    from mpi_fnas.federation.local_model import augment_party, search_party
    from mpi_fnas.federation.randomness import PartyRandomness
    from mpi_fnas.federation.shard import Shard
    from mpi_fnas.privacy import DPParams
    from mpi_fnas.privacy.release import AugmentReleases
    from mpi_fnas.runlog import SEARCH_METRICS, RunLog, StagePrivacy, read_run

    cfg = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.nodes=5", "space.stage_channels=[4, 4]",
                             "mode=fnas", "search.batch_size=4", "augment.batch_size=4"])
    space = search_space("dpnas")
    make = lambda: space.build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    shard = lambda: Shard(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen))  # noqa: E731
    dp = DPParams(1.0, 1.0, 1.0, 0.1, expected_batch_size=4.0) if private else None
    source = "secret" if private else "reproducible"
    party = search_party(make(), shard(), shard(), 4, PartyRandomness.create(source, seed=0, rank=1), dp=dp)
    server = search_server(make(), cfg.search, parties=1)
    assert party.num_a == 150 and server.a.numel() == 150
    g = party.w_release()
    assert g.shape == (party.num_w + STATS,) and np.isfinite(g).all() and np.abs(g[:-STATS]).sum() > 0
    assert (g[-STATS:] == 0).all() == private  # a DP release carries no statistics
    server.step_w(g[:-STATS])
    party.load_w(server.w_buffer)
    h = party.a_release()
    assert np.isfinite(h).all() and np.abs(h[:-STATS]).sum() > 0
    server.step_a(h[:-STATS])
    soft = server.alpha_softmax()
    genotype = server.genotype()
    assert soft["normal"].shape == (15, 10) and soft["reduce"].shape == (0, 10)
    normal, reduce = space.alpha_shapes(cfg.space)
    privacy = StagePrivacy(delta=[1e-5], releases=dp.search_releases(), sample_rates={"W": [0.5], "A": [0.5]},
                           accountant="pld") if private else None
    log = RunLog.create(tmp_path / "search.h5", mode="dpfnas" if private else "fnas", parties=1, config_text="",
                        metric_names=SEARCH_METRICS, alpha_shape=normal, reduce_alpha_shape=reduce, space=space.kind,
                        genotype_length=space.max_genotype_length(cfg.space), privacy_guarantee="holds",
                        privacy=privacy, alpha_ops=space.candidates(cfg.space))
    log.search.append_epoch(soft["normal"], soft["reduce"], genotype.to_string())
    log.search.finish("finished", reason="completed", final_genotype=genotype.to_string())
    run = read_run(tmp_path / "search.h5")
    assert run["space"] == "dpnas" and DpnasGenotype.from_string(run["genotypes"][0]) == genotype
    assert run["alpha_ops"] == list(PRIMITIVES)  # the columns' names, as the report labels them

    trained = space.build_augment_network(MIXED, cfg, seed=0, in_channels=3, num_classes=10)
    releases = AugmentReleases(noise_multiplier=1.0, clip=1.0, expected_batch_size=4.0, sample_rate_train=[0.5],
                               sample_rate_val=[0.5], steps=1) if private else None
    augment = augment_party(trained, shard(), cfg.augment,
                            PartyRandomness.create(source, seed=0, rank=1, stage="augment"),
                            releases.release if releases is not None else None, source if private else None)
    out = augment.w_release()
    assert out.shape == (trained.num_params() + STATS,) and np.isfinite(out).all()


@pytest.mark.parametrize("method", ["darts", "gdas"])
def test_a_party_runs_each_search_iteration_on_its_public_path(method: str) -> None:
    """The party's search side sets the iteration's path before its releases (``search.method: gdas``): the draw
    of (seed, step) at ``search.gdas_temperature``, the one every other party draws; under darts none."""
    from types import SimpleNamespace

    from mpi_fnas.stages.search import SearchSide

    cfg = load_config(None, ["seed=5", f"search.method={method}", "search.gdas_temperature=0.3"])
    side = SearchSide(cfg)
    party = SimpleNamespace(model=DpnasSearchNetwork((4,), 10, nodes=2))
    for step in (1, 2):
        side.step(party, step)
        if method == "darts":
            assert party.model.path_noise is None
        else:
            assert torch.equal(party.model.path_noise, path_noise(5, step, (3, 10)))
            assert party.model.path_temperature == 0.3


def test_rank_0_tests_a_gdas_supernet_on_its_argmax_path() -> None:
    """Under ``search.method: gdas`` rank 0's model (its epoch-end test, SecProbe's probes) runs the argmax path,
    the network the parties' single paths train; under darts the mixture of every op."""
    from mpi_fnas.federation.global_model import search_server

    for method in ("darts", "gdas"):
        cfg = load_config(None, [f"search.method={method}"])
        net = DpnasSearchNetwork((4,), 10, nodes=2)
        with torch.no_grad():
            net.alpha.normal_()
        server = search_server(net, cfg.search, parties=1)
        x = torch.randn(2, 3, 8, 8)
        hard = F.one_hot(net.alpha.argmax(dim=-1), net.alpha.shape[-1]).float()
        with torch.no_grad():
            expected = _one_hot_forward(net, x, hard) if method == "gdas" else _one_hot_forward(
                net, x, F.softmax(net.alpha, dim=-1))
            assert torch.allclose(server.sync_model()(x), expected, atol=1e-5), method


# -------------------------------------------------------------------------------------- stems and heads


@pytest.mark.parametrize("stem_kind", ["conv", "scattering"])
@pytest.mark.parametrize("head_kind", ["pool", "dpnas"])
def test_each_stem_and_head_gives_logits_and_per_example_gradients_that_match_the_loop(stem_kind: str,
                                                                                      head_kind: str) -> None:
    """``space.stem`` scattering: the cells read the fixed scattering (81 channels at a quarter of the side, through
    GroupNorm without parameters), computed outside the network; ``space.head`` dpnas: DPNASNet's head (1x1 conv to
    128 + GroupNorm, 3x3, fc 128, tanh, fc). The supernet's W and A and the derived network's weights by the hooks
    equal one backward per example."""
    torch.manual_seed(6)
    kwargs = {"stem_kind": stem_kind, "head_kind": head_kind}
    supernet = DpnasSearchNetwork((4, 8), 10, nodes=3, in_channels=1, **kwargs)
    derived = DpnasNetwork(MIXED, (4, 8), 10, in_channels=1, **kwargs)
    images, y = torch.randn(3, 1, 16, 16), torch.tensor([1, 2, 3])
    for net in (supernet, derived):
        stem = net.fixed_stem
        assert (stem is None) == (stem_kind == "conv")
        x = stem(images) if stem is not None else images
        assert x.shape == ((3, 81, 4, 4) if stem is not None else (3, 1, 16, 16))
        assert net(x).shape == (3, 10)
        if stem is not None:
            with pytest.raises(ValueError, match=r"expected the scattering of the images, \(N, 81, H, W\)"):
                net(images)
        assert (net.head_reduce is None) == (head_kind == "pool")
        groups = [dict(net.named_weights()), dict(net.named_alphas())] if net is supernet else \
            [dict(net.named_parameters())]
        for params in groups:
            assert hooks_supported(net, params)
            got = per_sample_gradients(net, params, x, y, method="hooks")
            for i in range(3):
                net.zero_grad()
                F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]).backward()
                alone = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                   for p in params.values()])
                assert torch.allclose(got[i], alone, rtol=1e-4, atol=1e-6), (stem_kind, head_kind, i)


def test_the_dpnas_head_is_dpnasnets_and_the_defaults_are_unchanged() -> None:
    """At DPNAS's MNIST widths (32, 32, 64; 5 nodes) the head holds 1x1 320 -> 128 and fc 1,152 -> 128 -> 10, about
    89 % of the derived network's weights as in DPNASNet; the default stem and head build the very network they
    built before the keys existed (the same parameters, in the same order, from the same seed)."""
    genotype = random_genotype(random.Random(0))
    net = DpnasNetwork(genotype, (32, 32, 64), 10, in_channels=1, head_kind="dpnas")
    head = sum(p.numel() for module in (net.head_reduce, net.classifier) for p in module.parameters())
    assert head == 5 * 64 * 128 + 1152 * 128 + 128 + 128 * 10 + 10
    assert head / net.num_params() > 0.85
    torch.manual_seed(7)
    default = DpnasNetwork(genotype, (8, 16), 10)
    torch.manual_seed(7)
    spelled = DpnasNetwork(genotype, (8, 16), 10, stem_kind="conv", head_kind="pool")
    assert [n for n, _ in default.named_parameters()][-2:] == ["classifier.weight", "classifier.bias"]
    assert all(torch.equal(a, b) for a, b in zip(default.parameters(), spelled.parameters(), strict=True))


def test_a_search_party_scatters_its_own_shards_once(monkeypatch) -> None:
    """Under ``space.stem: scattering`` a search party holds its shards' scattering, computed once at build."""
    from mpi_fnas.federation.job_plan import open_split, plan_run
    from mpi_fnas.space import scattering
    from mpi_fnas.stages.search import SearchSide, own_shard

    cfg = load_config(None, ["data.train_size=120", "data.test_size=20", "data.image_size=8", "space.stem=scattering",
                             "space.stage_channels=[4]", "mode=fnas", "augment.epochs=0"])
    calls: list[int] = []
    real = scattering.Scattering.__call__
    monkeypatch.setattr(scattering.Scattering, "__call__", lambda self, x: calls.append(len(x)) or real(self, x))
    got = plan_run(cfg, 2).assignments[0]
    data = open_split(cfg, "train")
    party = SearchSide(cfg).build(cfg, got, data, 1, torch.device("cpu"))
    assert calls == [len(got.train_indices), len(got.val_indices)]
    x_tr, _ = own_shard(cfg, data, got, 1, "train")
    assert torch.allclose(party.train.x.contiguous(), real(scattering.Scattering(3), x_tr), atol=1e-6)


def test_a_process_transforms_each_example_once_and_a_later_call_takes_what_it_kept(monkeypatch) -> None:
    """``with_fixed_stem`` keeps the features of what it transformed: a later stage's call (``reuse``) on examples
    all kept, in any order, transforms none and gets the features a fresh transform gives. Whatever repeats among a
    party's images, a call transforms all of its examples or none: a search shard that repeats the other, or a
    reusing call with one new image, transforms them all. Another stem (other input channels) never hits."""
    from types import SimpleNamespace

    from mpi_fnas.space import scattering
    from mpi_fnas.stages.party_data import with_fixed_stem

    calls: list[int] = []
    real = scattering.Scattering.__call__
    monkeypatch.setattr(scattering.Scattering, "__call__", lambda self, x: calls.append(len(x)) or real(self, x))
    grey = SimpleNamespace(fixed_stem=scattering.Scattering(1, 8))
    a, b, new = torch.randn(5, 1, 8, 8), torch.randn(3, 1, 8, 8), torch.randn(2, 1, 8, 8)
    y = torch.arange(10)
    with_fixed_stem(grey, a, y[:5])
    with_fixed_stem(grey, torch.cat([b, a[:2]]), y[:5])  # a shard repeating two of the other's images
    with_fixed_stem(grey, a[1:4], y[:3])  # one made only of the other's images
    assert calls == [5, 5, 3]
    pool, labels = with_fixed_stem(grey, torch.cat([b, a]), y[:8], reuse=True)
    assert calls == [5, 5, 3] and torch.equal(labels, y[:8])  # the pool: every example kept, none transformed again
    assert torch.allclose(pool, real(grey.fixed_stem, torch.cat([b, a])), atol=1e-6)
    mixed, _ = with_fixed_stem(grey, torch.cat([b[2:], new, a[:1]]), y[:4], reuse=True)
    assert calls[3:] == [4] and torch.allclose(mixed, real(grey.fixed_stem, torch.cat([b[2:], new, a[:1]])),
                                               atol=1e-6)
    big = torch.randn(2, 1, 16, 16)
    with_fixed_stem(SimpleNamespace(fixed_stem=scattering.Scattering(1, 16)), big, y[:2])
    colour = SimpleNamespace(fixed_stem=scattering.Scattering(4, 8))
    with_fixed_stem(colour, big.reshape(2, 4, 8, 8), y[:2], reuse=True)  # the same values as other images
    assert calls[4:] == [2, 2]


def test_an_augmentation_party_takes_its_pools_features_from_the_search_of_its_process(monkeypatch) -> None:
    """The augmentation's pool is the search's two shards: a party that searched transforms none of it again."""
    from mpi_fnas.federation.job_plan import open_split, plan_augment_stage, plan_run
    from mpi_fnas.space import scattering
    from mpi_fnas.stages.augment import AugmentSide
    from mpi_fnas.stages.search import SearchSide

    cfg = load_config(None, ["data.train_size=120", "data.test_size=20", "data.image_size=8", "space.stem=scattering",
                             "space.stage_channels=[4]", "mode=fnas"])
    calls: list[int] = []
    real = scattering.Scattering.__call__
    monkeypatch.setattr(scattering.Scattering, "__call__", lambda self, x: calls.append(len(x)) or real(self, x))
    plan = plan_run(cfg, 2)
    data = open_split(cfg, "train")
    searched = SearchSide(cfg).build(cfg, plan.assignments[0], data, 1, torch.device("cpu"))
    assert len(calls) == 2
    genotype = search_space("dpnas").parse_genotype("dpnas=conv_3x3_relu@0|conv_3x3_relu@0,conv_3x3_relu@1",
                                                    cfg.space)
    got = plan_augment_stage(cfg, plan.assignments, genotype, None, None).assignments[0]
    party = AugmentSide(cfg).build(cfg, got, data, 1, torch.device("cpu"))
    assert len(calls) == 2  # no transform in the augmentation's setup
    assert torch.allclose(party.train.x, torch.cat([searched.train.x, searched.val.x]), atol=1e-6)


def test_a_party_holds_its_features_once_and_a_series_of_jobs_keeps_two_jobs_at_most(monkeypatch, tmp_path) -> None:
    """What a process keeps of a fixed stem's features are views of the shards its party holds (channels-last on
    the CPU), not a second copy, in the search and in the augmentation. A job (``run_job``, ``run_search``) starts
    with what the job before used, so a series on one split reuses it, and without anything older, so a series on
    other shards (a sweep's or a baseline's seeds) holds two jobs' features at most."""
    from types import SimpleNamespace

    from mpi_fnas.federation.job_plan import open_split, plan_augment_stage, plan_run
    from mpi_fnas.space import scattering
    from mpi_fnas.stages import job, party_data
    from mpi_fnas.stages.augment import AugmentSide
    from mpi_fnas.stages.search import SearchSide

    def storages(*tensors: torch.Tensor) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in tensors}

    def kept_rows() -> list[torch.Tensor]:
        return [row for row, _ in party_data._KEPT.values()]

    cfg = load_config(None, ["data.train_size=120", "data.test_size=20", "data.image_size=8", "space.stem=scattering",
                             "space.stage_channels=[4]", "mode=fnas"])
    plan = plan_run(cfg, 2)
    data = open_split(cfg, "train")
    searched = SearchSide(cfg).build(cfg, plan.assignments[0], data, 1, torch.device("cpu"))
    assert storages(*kept_rows()) == storages(searched.train.x, searched.val.x)
    genotype = search_space("dpnas").parse_genotype("dpnas=conv_3x3_relu@0|conv_3x3_relu@0,conv_3x3_relu@1",
                                                    cfg.space)
    got = plan_augment_stage(cfg, plan.assignments, genotype, None, None).assignments[0]
    party = AugmentSide(cfg).build(cfg, got, data, 1, torch.device("cpu"))
    assert len(party_data._KEPT) == len(party.train.x)
    assert storages(*kept_rows()) == storages(party.train.x)

    pool = set(party_data._KEPT)
    seen: list[set] = []
    monkeypatch.setattr(job, "participate", lambda *args, **kwargs: seen.append(set(party_data._KEPT)) or False)
    a_party = SimpleNamespace(is_server=False)
    job.run_job(cfg, a_party, tmp_path, stage="search")  # the next job: its search and its augmentation
    party_data.with_fixed_stem(SimpleNamespace(fixed_stem=scattering.Scattering(1, 8)), torch.randn(2, 1, 8, 8),
                               torch.arange(2))  # what that job transformed: other images
    other = set(party_data._KEPT) - pool
    job.run_search(cfg, a_party, tmp_path)  # the job after: the pool, unused by the job before, is dropped
    assert seen == [pool, pool, other] and len(other) == 2


def test_gdas_anneals_its_temperature_linearly_over_the_epochs_when_asked() -> None:
    """``search.gdas_temperature_final``: τ from gdas_temperature at the first epoch to it at the last (GDAS: 10 to
    0.1), the value the party's step sets; unset, τ stays fixed."""
    from types import SimpleNamespace

    from mpi_fnas.federation.schedules import gdas_temperature
    from mpi_fnas.stages.search import SearchSide

    cfg = load_config(None, ["search.method=gdas", "search.epochs=5", "search.steps_per_epoch=2",
                             "search.gdas_temperature=10", "search.gdas_temperature_final=0.1"])
    assert [gdas_temperature(cfg.search, e) for e in range(6)] == pytest.approx([10, 7.525, 5.05, 2.575, 0.1, 0.1])
    side, party = SearchSide(cfg), SimpleNamespace(model=DpnasSearchNetwork((4,), 10, nodes=2))
    side.steps_per_epoch = 2
    for step, tau in ((1, 10), (2, 10), (3, 7.525), (10, 0.1)):
        side.step(party, step)
        assert party.model.path_temperature == pytest.approx(tau)
    fixed = load_config(None, ["search.method=gdas", "search.gdas_temperature=0.3"])
    assert {gdas_temperature(fixed.search, e) for e in range(4)} == {0.3}
    with pytest.raises(ConfigError, match=r"search\.gdas_temperature_final: 0(\.0)? must be > 0 or null"):
        load_config(None, ["search.gdas_temperature_final=0"])


# --------------------------------------------------------------------------- stem and head chosen by the search


def test_a_searched_stem_and_head_mix_their_candidates_by_categorical_weights_released_with_the_alpha() -> None:
    """``space.stem: search`` and ``space.head: search``: the supernet holds both candidates of each, mixed by
    softmax(β) (β (2,), part of A beside the alpha: released, clipped and noised with it, one release); the logits
    are Σ_s Σ_h w_s w_h · logits(s, h). Per-example gradients of A (per-example copies of α and both β) match the
    loop; the derivation names the strongest candidate of each; the derived network is built with them."""
    torch.manual_seed(9)
    net = DpnasSearchNetwork((4, 8), 10, nodes=2, in_channels=1, stem_kind="search", head_kind="search")
    assert [name for name, _ in net.named_alphas()] == ["alpha", "stem_beta", "head_beta"]
    assert not {id(p) for p in net.alphas()} & {id(p) for p in net.weights()}
    assert len(net.weights()) + 3 == len(list(net.parameters())) and net.fixed_stem is None
    x, y = torch.randn(3, 1, 16, 16), torch.tensor([1, 2, 3])  # images: the scattering is computed in the forward
    with torch.no_grad():
        net.stem_beta.copy_(torch.tensor([0.3, -0.2]))
        net.head_beta.copy_(torch.tensor([-0.1, 0.4]))
        weights = F.softmax(net.alpha, dim=-1)
        mixed = 0
        for s, (kind, branch) in enumerate(zip(("conv", "scattering"), net.stems, strict=True)):
            h = branch(x if kind == "conv" else net.scattering(x))
            for cell in net.cells:
                h = net.pool(cell(h, weights))
            for k, head in enumerate(net.heads):
                mixed = mixed + F.softmax(net.stem_beta, 0)[s] * F.softmax(net.head_beta, 0)[k] * head(h)
        assert torch.allclose(net(x), mixed, atol=1e-6)
    params = dict(net.named_alphas())
    assert hooks_supported(net, params)
    got = per_sample_gradients(net, params, x, y, method="hooks")
    for i in range(3):
        net.zero_grad()
        F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]).backward()
        assert torch.allclose(got[i], torch.cat([p.grad.reshape(-1) for p in params.values()]), rtol=1e-4, atol=1e-6)
    genotype = net.genotype()
    assert (genotype.stem, genotype.head) == ("conv", "dpnas")  # the argmax of each β
    assert genotype.to_string().endswith(";stem=conv;head=dpnas")
    cfg = load_config(None, ["data.image_size=16", "space.stage_channels=[4,8]", "space.nodes=2",
                             "space.stem=search", "space.head=search"])
    derived = search_space("dpnas").build_augment_network(genotype, cfg, seed=0, in_channels=1, num_classes=10)
    assert derived.fixed_stem is None and derived.head_reduce is not None
    largest = search_space("dpnas").largest_genotype(cfg)
    assert (largest.stem, largest.head) == ("scattering", "dpnas")
    with pytest.raises(ValueError, match=r"space\.stem: search, but the genotype names no stem"):
        search_space("dpnas").build_augment_network(DpnasGenotype(genotype.ops), cfg, seed=0, in_channels=1,
                                                    num_classes=10)


def test_a_gdas_step_runs_the_drawn_stem_and_head_alone() -> None:
    """Under GDAS each searched choice is drawn like an edge (a public Gumbel draw of its own stream): the step runs
    that candidate alone (the other's weights get no gradient), and rank 0's argmax path runs the strongest."""
    from mpi_fnas.federation.schedules import path_noise

    torch.manual_seed(10)
    net = DpnasSearchNetwork((4,), 10, nodes=2, in_channels=1, stem_kind="search", head_kind="search")
    net.path_noise = path_noise(3, 1, tuple(net.alpha.shape))
    net.choice_noise = {"stem": torch.tensor([[0.0, 5.0]]), "head": torch.tensor([[5.0, 0.0]])}
    F.cross_entropy(net(torch.randn(2, 1, 16, 16)), torch.tensor([0, 1])).backward()
    assert all(p.grad is None for p in net.stems[0].parameters())  # the conv stem was not drawn
    assert any(p.grad is not None for p in net.stems[1].parameters())
    assert all(p.grad is None for p in net.heads[1].parameters()) and net.heads[0].classifier.weight.grad is not None
    assert net.stem_beta.grad is not None and net.head_beta.grad is not None  # straight-through
    assert not torch.equal(path_noise(3, 1, (1, 2), label="stem"), path_noise(3, 1, (1, 2), label="head"))
    net.argmax_path()
    assert torch.equal(net.choice_noise["stem"], torch.zeros(1, 2))


def test_a_genotype_names_only_the_choices_its_space_allows() -> None:
    text = "dpnas=conv_3x3_relu@0|conv_3x3_tanh@0,conv_3x3_relu@1;stem=scattering;head=dpnas"
    space = search_space("dpnas")
    searched = load_config(None, ["space.nodes=2", "space.stem=search", "space.head=search"]).space
    assert (space.parse_genotype(text, searched).stem, space.parse_genotype(text, searched).head) == ("scattering",
                                                                                                    "dpnas")
    fixed = load_config(None, ["space.nodes=2", "space.stem=conv", "space.head=dpnas"]).space
    with pytest.raises(ValueError, match=r"the genotype's stem 'scattering' is not space\.stem 'conv'"):
        space.parse_genotype(text, fixed)
    with pytest.raises(ValueError, match=r"expected ';stem=conv\|scattering'"):
        DpnasGenotype.from_string(text + ";stem=conv")
    assert space.max_genotype_length(searched) >= len(text)
