"""Tests for the DARTS search space: ops, cells, supernet, genotype derivation and its string form."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import perturb_others
from pre_recipe import PRE_RECIPE
from torch import nn
from torch.func import functional_call, grad, vmap

from mpi_fnas.space import (
    PRIMITIVES,
    Genotype,
    SearchNetwork,
    depthwise,
    derive_genotype,
    max_genotype_length,
    num_edges,
)
from mpi_fnas.space.cells import MixedOp, SearchCell
from mpi_fnas.space.depthwise import DepthwiseConv2d
from mpi_fnas.space.genotype import edge_endpoints
from mpi_fnas.space.ops import make_norm, make_op
from mpi_fnas.space.scaffold import CellPlace

NONE = PRIMITIVES.index("none")


def op_index(name: str) -> int:
    return PRIMITIVES.index(name)


# ---------------------------------------------------------------------------------------------- topology


def test_num_edges_and_edge_order() -> None:
    assert [num_edges(n) for n in (1, 2, 3, 4, 5)] == [2, 5, 9, 14, 20]
    # Node i takes inputs 0..i+1, nodes enumerated in order.
    assert edge_endpoints(3) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (2, 3)]
    with pytest.raises(ValueError):
        num_edges(0)


# ---------------------------------------------------------------------------------------------- ops


def test_make_norm_kinds() -> None:
    bn = make_norm("batchnorm", 6, affine=True)
    assert isinstance(bn, nn.BatchNorm2d)
    assert not bn.track_running_stats and list(bn.buffers()) == []
    for channels, groups in ((4, 4), (6, 2), (5, 1), (12, 4)):
        gn = make_norm("groupnorm", channels, affine=False)
        assert isinstance(gn, nn.GroupNorm)
        assert gn.num_groups == groups and list(gn.parameters()) == []
    with pytest.raises(ValueError, match="unknown norm 'layernorm'"):
        make_norm("layernorm", 4, affine=True)


@pytest.mark.parametrize("size", [8, 7])
@pytest.mark.parametrize("stride", [1, 2])
def test_every_op_has_the_expected_output_shape(stride: int, size: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, size, size)
    out_size = -(-size // stride)
    for name in PRIMITIVES:
        for norm in ("batchnorm", "groupnorm"):
            out = make_op(name, 6, stride, norm, affine=False)(x)
            assert out.shape == (2, 6, out_size, out_size), (name, norm)
    zeros = torch.zeros(2, 6, out_size, out_size)
    assert torch.equal(make_op("none", 6, stride, "batchnorm", False)(x), zeros)
    if stride == 1:
        assert torch.equal(make_op("skip_connect", 6, 1, "batchnorm", False)(x), x)
    with pytest.raises(ValueError, match="unknown op"):
        make_op("conv_7x7", 6, stride, "batchnorm", False)


def test_no_inplace_relu_and_no_buffers_in_network() -> None:
    net = SearchNetwork(4, 10, 3, nodes=2)
    relus = [m for m in net.modules() if isinstance(m, nn.ReLU)]
    assert relus and not any(m.inplace for m in relus)
    assert list(net.buffers()) == []


# ---------------------------------------------------------------------------------------------- depthwise


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("size", [7, 8, 16])
@pytest.mark.parametrize(("kernel", "dilation", "padding"), [(3, 2, 2), (5, 2, 4), (3, 3, 1), (3, 1, 1)])
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_conv_and_its_gradients_equal_a_grouped_conv(stride: int, kernel: int, dilation: int,
                                                               padding: int, size: int,
                                                               layout: torch.memory_format) -> None:
    # In float64 the spread-and-flip input gradient must equal oneDNN's to rounding; undilated kernels keep oneDNN's.
    torch.manual_seed(size + 10 * kernel + 100 * stride)
    conv = DepthwiseConv2d(3, kernel, stride=stride, padding=padding, dilation=dilation).double()
    grouped = nn.Conv2d(3, 3, kernel, stride=stride, padding=padding, dilation=dilation, groups=3,
                        bias=False).double()
    grouped.weight.data.copy_(conv.weight.data)
    assert conv.fast_input_gradient == (dilation > 1)
    x = torch.randn(2, 3, size, size, dtype=torch.float64).contiguous(memory_format=layout)
    out = conv(x.requires_grad_(True))
    assert torch.allclose(out, grouped(x), rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (x, conv.weight), g)
    theirs = torch.autograd.grad(grouped(x), (x, grouped.weight), g)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert ours[0].abs().sum() > 0


def test_depthwise_conv_computes_its_weight_gradient_only_when_the_pass_uses_it(monkeypatch) -> None:
    # The per-example hooks ask for layer-output gradients only: the slow weight-gradient kernel must not run then.
    calls = []
    original = depthwise._weight_gradient
    monkeypatch.setattr(depthwise, "_weight_gradient", lambda *a: calls.append(1) or original(*a))
    conv = DepthwiseConv2d(4, 3, stride=2, padding=2, dilation=2)
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    torch.autograd.grad(conv(x).square().sum(), x)
    assert calls == []
    torch.autograd.grad(conv(x).square().sum(), conv.weight)
    assert calls == [1]
    conv(x).square().sum().backward()
    assert calls == [1, 1] and conv.weight.grad is not None and x.grad is not None


# ---------------------------------------------------------------------------------------------- cells


@pytest.mark.parametrize("stride", [1, 2])
def test_mixed_op_is_the_weighted_sum_of_its_ops(stride: int) -> None:
    # Each op on its own, with its own ReLU: the MixedOp's one shared ReLU must change nothing.
    torch.manual_seed(1)
    mixed = MixedOp(4, stride, "groupnorm")
    x = torch.randn(2, 4, 8, 8)
    k = op_index("sep_conv_3x3")
    one_hot = F.one_hot(torch.tensor(k), len(PRIMITIVES)).float()
    assert torch.allclose(mixed(x, one_hot), mixed.ops[k](x))
    weights = torch.rand(len(PRIMITIVES))
    expected = sum(w * op(x) for w, op in zip(weights, mixed.ops, strict=True))
    assert torch.allclose(mixed(x, weights), expected, atol=1e-6)


def test_search_cell_edge_order() -> None:
    """Route everything through chosen edges to check which alpha row drives which (node, input) edge."""
    torch.manual_seed(2)
    cell = SearchCell(2, CellPlace(5, 6, 4, reduction=False, reduction_prev=False), norm="groupnorm")
    s0, s1 = torch.randn(2, 5, 8, 8), torch.randn(2, 6, 8, 8)
    weights = torch.zeros(num_edges(2), len(PRIMITIVES))
    weights[:, NONE] = 1.0
    rows = {edge: row for row, edge in enumerate(edge_endpoints(2))}
    for edge in ((0, 1), (1, 2)):  # node 0 <- state 1, node 1 <- state 2 (= node 0)
        weights[rows[edge]] = 0.0
        weights[rows[edge], op_index("skip_connect")] = 1.0
    out = cell(s0, s1, weights)
    pre1 = cell.preprocess1(s1)
    assert out.shape == (2, 2 * 4, 8, 8)
    assert torch.allclose(out, torch.cat([pre1, pre1], dim=1))


# ---------------------------------------------------------------------------------------------- network


@pytest.mark.parametrize(
    ("layers", "nodes", "channels", "size", "norm"),
    [
        (1, 1, 4, 16, "batchnorm"),
        (2, 2, 4, 16, "groupnorm"),
        (3, 4, 4, 32, "batchnorm"),
        (5, 2, 5, 16, "groupnorm"),
        (8, 1, 4, 32, "groupnorm"),
        (3, 3, 6, 15, "batchnorm"),
    ],
)
def test_network_output_shapes(layers: int, nodes: int, channels: int, size: int, norm: str) -> None:
    torch.manual_seed(0)
    net = SearchNetwork(channels, 7, layers, nodes=nodes, norm=norm)
    reductions = len(net.reduction_layers)
    assert reductions == (1 if layers == 1 else 2)
    captured: dict[str, torch.Size] = {}

    def record_last_cell(_module: nn.Module, _inputs: object, out: torch.Tensor) -> None:
        captured["last"] = out.shape

    net.cells[-1].register_forward_hook(record_last_cell)
    logits = net(torch.randn(3, 3, size, size))
    assert logits.shape == (3, 7)
    assert torch.isfinite(logits).all()
    final_size = size
    for _ in range(reductions):
        final_size = -(-final_size // 2)
    assert captured["last"] == (3, nodes * channels * 2**reductions, final_size, final_size)
    for alpha in net.alphas():
        assert alpha.shape == (num_edges(nodes), len(PRIMITIVES))


def test_reduction_cells_follow_darts_positions() -> None:
    expected = {1: (0,), 2: (0, 1), 3: (1, 2), 5: (1, 3), 8: (2, 5)}
    for layers, positions in expected.items():
        net = SearchNetwork(4, 10, layers, nodes=1)
        assert net.reduction_layers == positions
        assert tuple(i for i, c in enumerate(net.cells) if c.reduction) == positions
        net(torch.randn(2, 3, 8, 8)).sum().backward()
        # documented: with no normal cell (layers <= 2) alpha_normal takes no part and gets no gradient
        assert (net.alpha_normal.grad is None) == (layers <= 2)
        assert net.alpha_reduce.grad is not None and net.alpha_reduce.grad.abs().sum() > 0


def test_weights_and_alphas_partition_the_parameters() -> None:
    net = SearchNetwork(4, 10, 3, nodes=2)
    weights, alphas = net.weights(), net.alphas()
    assert alphas[0] is net.alpha_normal and alphas[1] is net.alpha_reduce
    assert [name for name, _ in net.named_alphas()] == ["alpha_normal", "alpha_reduce"]
    weight_ids, alpha_ids = {id(p) for p in weights}, {id(p) for p in alphas}
    assert not weight_ids & alpha_ids
    all_params = list(net.parameters())
    assert weight_ids | alpha_ids == {id(p) for p in all_params}
    assert len(weights) + len(alphas) == len(all_params)
    # Order is named_parameters order with the alphas removed.
    assert [n for n, _ in net.named_weights()] == [n for n, _ in net.named_parameters() if "alpha" not in n]
    assert all(p is q for p, (_, q) in zip(weights, net.named_weights(), strict=True))


def test_alpha_softmax_and_genotype_follow_the_alphas() -> None:
    torch.manual_seed(3)
    net = SearchNetwork(4, 10, 3, nodes=2)
    soft = net.alpha_softmax()
    assert set(soft) == {"normal", "reduce"}
    for key, alpha in (("normal", net.alpha_normal), ("reduce", net.alpha_reduce)):
        assert soft[key].shape == alpha.shape and not soft[key].requires_grad
        assert torch.allclose(soft[key].sum(dim=1), torch.ones(alpha.shape[0]))
        assert torch.allclose(soft[key], torch.softmax(alpha.detach(), dim=1))
    with torch.no_grad():
        net.alpha_normal.zero_()
        net.alpha_normal[:, op_index("sep_conv_5x5")] = 5.0
        net.alpha_normal[0, op_index("dil_conv_3x3")] = 6.0  # node 0, input 0
        net.alpha_reduce.zero_()
        net.alpha_reduce[:, op_index("max_pool_3x3")] = 5.0
    g = net.genotype()
    assert g.normal == (("dil_conv_3x3", 0), ("sep_conv_5x5", 1), ("sep_conv_5x5", 0), ("sep_conv_5x5", 1))
    assert g.reduce == (("max_pool_3x3", 0), ("max_pool_3x3", 1)) * 2
    assert g.normal_concat == g.reduce_concat == (2, 3)


def test_input_validation() -> None:
    net = SearchNetwork(4, 10, 1, nodes=1, in_channels=1)
    assert net(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"expected \(N, 1, H, W\)"):
        net(torch.randn(2, 3, 16, 16))
    with pytest.raises(ValueError, match="unknown primitives"):
        SearchNetwork(4, 10, 1, primitives=("none", "conv_9x9"))
    with pytest.raises(ValueError, match="layers"):
        SearchNetwork(4, 10, 0)


def test_construction_is_deterministic_under_manual_seed() -> None:
    def build(seed: int) -> SearchNetwork:
        torch.manual_seed(seed)
        return SearchNetwork(4, 10, 3, nodes=2, norm="groupnorm")

    a, b, c = build(5), build(5), build(6)
    names = [n for n, _ in a.named_parameters()]
    assert names == [n for n, _ in b.named_parameters()]
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(a.alpha_normal, c.alpha_normal)
    assert not torch.equal(a.weights()[0], c.weights()[0])
    assert a.alpha_normal.abs().max() < 1e-2  # 1e-3 * randn
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(a(x), b(x))


# ---------------------------------------------------------------------------------------------- per-sample


@pytest.mark.parametrize("train", [True, False])
def test_groupnorm_has_no_cross_sample_dependence_but_batchnorm_has(train: bool) -> None:
    """The property per-example DP relies on: example i's output does not depend on other examples."""
    torch.manual_seed(4)
    x = torch.randn(4, 3, 16, 16)
    changed = perturb_others(x)
    for norm in ("groupnorm", "batchnorm"):
        torch.manual_seed(4)
        net = SearchNetwork(4, 10, 3, nodes=2, norm=norm).train(train)
        with torch.no_grad():
            difference = (net(x)[0] - net(changed)[0]).abs().max().item()
        if norm == "groupnorm":
            assert difference < 1e-5
        else:
            # batch statistics are used in eval too, so BatchNorm mixes examples in both modes
            assert difference > 1e-3


def test_vmap_per_sample_grads_match_single_example_backward() -> None:
    torch.manual_seed(5)
    net = SearchNetwork(4, 3, 3, nodes=2, norm="groupnorm")
    params = {name: p.detach() for name, p in net.named_parameters()}
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 2])

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(net, p, (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(2):
        net.zero_grad()
        F.cross_entropy(net(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in net.named_parameters():
            assert p.grad is not None, name
            assert per_sample[name].shape == (2, *p.shape)
            assert torch.allclose(per_sample[name][i], p.grad, rtol=1e-4, atol=1e-5), name
    # the two examples really have different gradients (so the comparison above is not vacuous)
    assert not torch.allclose(per_sample["alpha_normal"][0], per_sample["alpha_normal"][1])


# ---------------------------------------------------------------------------------------------- genotype


def _weights(nodes: int, fill: float = 0.01) -> np.ndarray:
    return np.full((num_edges(nodes), len(PRIMITIVES)), fill)


def test_derive_never_picks_none_and_ranks_edges_by_best_non_none_op() -> None:
    w = _weights(2)
    w[:, NONE] = 0.9  # `none` dominates every edge
    # node 0 (rows 0, 1): both edges kept, each with its strongest non-none op
    w[0, op_index("avg_pool_3x3")] = 0.05
    w[1, op_index("dil_conv_5x5")] = 0.04
    # node 1 (rows 2..4 = inputs 0, 1, 2): input 1 has the largest `none` but the weakest real op
    w[2, op_index("sep_conv_3x3")] = 0.06
    w[3, NONE] = 0.99
    w[3, op_index("sep_conv_5x5")] = 0.02
    w[4, op_index("skip_connect")] = 0.07
    g = derive_genotype(w, w, 2)
    expected = (("avg_pool_3x3", 0), ("dil_conv_5x5", 1), ("sep_conv_3x3", 0), ("skip_connect", 2))
    assert g.normal == expected and g.reduce == expected
    assert all(op != "none" for op, _ in g.normal + g.reduce)
    assert g.normal_concat == g.reduce_concat == (2, 3)


def test_derive_lists_kept_edges_by_input_and_breaks_ties_deterministically() -> None:
    w = _weights(4)
    rows = {edge: row for row, edge in enumerate(edge_endpoints(4))}
    # node 3: the strongest edge comes from input 4, the second from input 1 -> listed as (1, 4)
    w[rows[(3, 4)], op_index("dil_conv_3x3")] = 0.5
    w[rows[(3, 1)], op_index("max_pool_3x3")] = 0.3
    # node 2: inputs 1, 2, 3 tie exactly -> lower inputs (1, 2) win; op tie -> earlier primitive wins
    for j in (1, 2, 3):
        w[rows[(2, j)], op_index("sep_conv_5x5")] = 0.2
        w[rows[(2, j)], op_index("sep_conv_3x3")] = 0.2
    g = derive_genotype(w, w, 4)
    assert g.normal[6:8] == (("max_pool_3x3", 1), ("dil_conv_3x3", 4))
    assert g.normal[4:6] == (("sep_conv_3x3", 1), ("sep_conv_3x3", 2))
    # nodes 0 and 1 are all ties at 0.01: inputs 0, 1 and the first non-none primitive
    assert g.normal[:4] == (("max_pool_3x3", 0), ("max_pool_3x3", 1)) * 2


def test_derive_accepts_torch_and_rejects_bad_input() -> None:
    rng = np.random.default_rng(0)
    w = rng.random((num_edges(3), len(PRIMITIVES)))
    r = rng.random((num_edges(3), len(PRIMITIVES)))
    assert derive_genotype(torch.from_numpy(w).float(), torch.from_numpy(r), 3) == derive_genotype(w, r, 3)
    with pytest.raises(ValueError, match="expected shape"):
        derive_genotype(w, r, 4)
    bad = w.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        derive_genotype(bad, r, 3)


def _random_genotype(rnd: random.Random, nodes: int, ops: list[str]) -> Genotype:
    def cell() -> list[tuple[str, int]]:
        edges = []
        for i in range(nodes):
            edges += [(rnd.choice(ops), j) for j in rnd.sample(range(i + 2), 2)]
        return edges

    def concat() -> list[int]:
        return sorted(rnd.sample(range(2, nodes + 2), rnd.randint(1, nodes)))

    return Genotype(normal=cell(), normal_concat=concat(), reduce=cell(), reduce_concat=concat())


def test_string_round_trip_property() -> None:
    rnd = random.Random(0)
    torch.manual_seed(0)
    ops = [p for p in PRIMITIVES if p != "none"]
    for trial in range(200):
        nodes = 1 + trial % 11
        if trial % 2:
            g = _random_genotype(rnd, nodes, ops)
        else:
            alphas = torch.randn(2, num_edges(nodes), len(PRIMITIVES)) * rnd.choice([1e-3, 1.0, 10.0])
            g = derive_genotype(alphas[0].softmax(-1), alphas[1].softmax(-1), nodes)
        text = g.to_string()
        parsed = Genotype.from_string(text)
        assert parsed == g and parsed.nodes == nodes
        assert parsed.to_string() == text
        assert len(text.encode("ascii")) <= max_genotype_length(nodes)


def test_from_string_tolerates_whitespace_around_tokens() -> None:
    g = Genotype(
        normal=[("sep_conv_3x3", 0), ("skip_connect", 1)],
        normal_concat=[2],
        reduce=[("max_pool_3x3", 1), ("avg_pool_3x3", 0)],
        reduce_concat=[2],
    )
    assert g.to_string() == (
        "normal=sep_conv_3x3@0,skip_connect@1;normal_concat=2;"
        "reduce=max_pool_3x3@1,avg_pool_3x3@0;reduce_concat=2"
    )
    spaced = (
        " normal = sep_conv_3x3 @ 0 , skip_connect@1 ; normal_concat= 2;"
        "reduce=max_pool_3x3@1,avg_pool_3x3@0;reduce_concat=2\n"
    )
    assert Genotype.from_string(spaced) == g


VALID = (
    "normal=sep_conv_3x3@0,skip_connect@1|sep_conv_5x5@1,dil_conv_3x3@2;normal_concat=2,3;"
    "reduce=max_pool_3x3@0,max_pool_3x3@1|skip_connect@2,max_pool_3x3@0;reduce_concat=2,3"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected 'field=value'"),
        (VALID.replace("sep_conv_5x5@1", "conv_9x9@1"), "normal node 1: unknown op 'conv_9x9'"),
        (VALID.replace("sep_conv_5x5@1", "none@1"), "unknown op 'none'"),
        (VALID.replace("sep_conv_5x5@1", "sep_conv_5x5@3"), r"normal node 1: input state 3 out of range"),
        (VALID.replace("sep_conv_5x5@1", "sep_conv_5x5@-1"), "non-negative integer, got '-1'"),
        (VALID.replace("sep_conv_5x5@1", "sep_conv_5x5@x"), "non-negative integer, got 'x'"),
        (VALID.replace("sep_conv_5x5@1", "sep_conv_5x5"), "expected 'op@state'"),
        (VALID.replace("sep_conv_5x5@1", "sep_conv_5x5@2"), r"the two inputs must differ"),
        (VALID.replace("skip_connect@1|", "skip_connect@1,avg_pool_3x3@0|"), "normal node 0 has 3 edge"),
        (VALID.replace("sep_conv_3x3@0,", ""), "normal node 0 has 1 edge"),
        (VALID.replace("|skip_connect@2,max_pool_3x3@0", ""), "normal has 2 nodes but reduce has 1"),
        (VALID.replace(";normal_concat=2,3", ""), "missing field.*normal_concat"),
        (VALID + ";reduce_concat=2", "given twice"),
        (VALID.replace("reduce_concat", "reduce_cat"), "unknown field 'reduce_cat'"),
        (VALID.replace("normal_concat=2,3", "normal_concat=2,4"), r"state 4 out of range 2\.\.3"),
        (VALID.replace("normal_concat=2,3", "normal_concat=3,3"), "duplicate states"),
        (VALID.replace("normal_concat=2,3", "normal_concat="), "non-negative integer, got ''"),
        (VALID.replace("normal=", "normal:"), "expected 'field=value'"),
    ],
)
def test_from_string_rejects_malformed_text(text: str, message: str) -> None:
    assert Genotype.from_string(VALID).to_string() == VALID  # the base string itself is valid
    with pytest.raises(ValueError, match=message):
        Genotype.from_string(text)


def test_from_string_rejects_non_strings_and_respects_custom_primitives() -> None:
    with pytest.raises(ValueError, match="must be str"):
        Genotype.from_string(b"normal=")  # type: ignore[arg-type]
    restricted = ("none", "skip_connect", "max_pool_3x3", "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3")
    with pytest.raises(ValueError, match="unknown op 'dil_conv_3x3'"):
        Genotype.from_string(VALID, primitives=restricted[:-1])
    assert Genotype.from_string(VALID, primitives=restricted).nodes == 2


def _worst_case_string(nodes: int, primitives: tuple[str, ...]) -> str:
    longest = max((p for p in primitives if p != "none"), key=len)
    cell = [(longest, j) for i in range(nodes) for j in (i + 1, i)]  # largest indices for every node
    concat = list(range(2, nodes + 2))
    return Genotype(normal=cell, normal_concat=concat, reduce=cell, reduce_concat=concat).to_string()


@pytest.mark.parametrize(
    "primitives", [PRIMITIVES, ("none", "skip_connect", "a_much_longer_operation_name_7x7")]
)
def test_max_genotype_length_bounds_the_worst_case(primitives: tuple[str, ...]) -> None:
    for nodes in range(1, 13):
        worst = len(_worst_case_string(nodes, primitives))
        bound = max_genotype_length(nodes, primitives)
        assert worst <= bound
        if nodes <= 9:  # single-digit indices: the bound is attained exactly, i.e. it is tight
            assert worst == bound


@pytest.mark.parametrize(("kind", "ops"), [
    ("darts", ""), ("dpnas", ""),
    # at 4 channels dil_conv_5x5 outweighs sep_conv_3x3 and at 8 the other way round: the normal cells (4) and the
    # reduction cells (8, 16) need different ops
    ("darts", "avg_pool_3x3, skip_connect, sep_conv_3x3, dil_conv_5x5"),
    ("dpnas", "none, max_pool_3x3, conv_3x3_tanh"), ("dpnas", "skip_connect, avg_pool_3x3"),
])
def test_the_largest_genotype_bounds_every_cells_network(kind: str, ops: str) -> None:
    """Secure aggregation accounts a run at the network of the space's largest genotype
    (``mpi_fnas.federation.job_plan.secure_dimension``): no cell's network of the space's candidate ops (``space.ops``)
    may have more weights. Checked against every cell of one op per cell type (DARTS: each pair of a normal and a
    reduction op) and 30 random cells; a 'largest' of sep_conv_3x3 (DARTS), of the first candidate, or of one pool
    edge (DPNAS) fails it."""
    from mpi_fnas.config import load_config
    from mpi_fnas.federation.flat import numel
    from mpi_fnas.space import search_space

    cfg = load_config(None, [*PRE_RECIPE, f"space.kind={kind}", "space.nodes=3", "augment.layers=3",
                             "augment.channels=4", "space.stage_channels=[4, 8]", f"space.ops=[{ops}]"])
    space = search_space(kind)
    candidates = [op for op in space.candidates(cfg.space) if op != "none"]

    def size(genotype) -> int:
        net = space.build_augment_network(genotype, cfg, seed=0, in_channels=3, num_classes=10)
        return numel(net.weights())

    largest = size(space.largest_genotype(cfg))
    others = [space.random_genotype(cfg.space, np.random.default_rng(seed)) for seed in range(30)]
    if kind == "darts":
        cell = space.largest_genotype(cfg)
        others += [Genotype(normal=[(normal, j) for _, j in cell.normal], normal_concat=cell.normal_concat,
                            reduce=[(reduce, j) for _, j in cell.reduce], reduce_concat=cell.reduce_concat)
                   for normal in candidates for reduce in candidates]
    else:
        from mpi_fnas.space import dpnas

        edges = dpnas.num_edges(cfg.space.nodes)
        others += [dpnas.DpnasGenotype((name,) * edges) for name in candidates]
    sizes = [size(g) for g in others]
    assert max(sizes) <= largest
    assert max(sizes) == largest  # the bound is attained: the largest one-op cell is among them


@pytest.mark.parametrize(("kind", "ops"), [
    ("darts", ["skip_connect", "dil_conv_3x3", "max_pool_3x3"]),
    ("dpnas", ["conv_3x3_tanh", "conv_3x3_selu"]),
    ("dpnas", ["conv_3x3_selu", "none", "skip_connect"]),
])
def test_space_ops_are_the_alphas_columns_and_the_only_ops_a_cell_may_have(kind: str, ops: list[str]) -> None:
    """``space.ops`` restricts the search to its ops: the alpha has one column per op (in the kind's order, not the
    config's), the derivation and the random cells pick only them, and a genotype with another op is refused
    where a party or the planner reads one (its network could outgrow the accounted dimension)."""
    from mpi_fnas.config import SetupError, load_config
    from mpi_fnas.federation.job_plan import parse_genotype
    from mpi_fnas.space import search_space

    cfg = load_config(None, [*PRE_RECIPE, f"space.kind={kind}", "space.nodes=3", "space.stage_channels=[4]",
                             f"space.ops=[{', '.join(ops)}]"])
    space = search_space(kind)
    candidates = space.candidates(cfg.space)
    assert candidates == tuple(op for op in space.primitives if op in ops) and list(candidates) != ops

    def ops_of(genotype) -> set[str]:
        return ({op for op, _ in genotype.normal + genotype.reduce} if kind == "darts" else set(genotype.ops))

    net = space.build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10)
    assert tuple(net.alphas()[0].shape) == space.alpha_shapes(cfg.space)[0]
    assert space.alpha_shapes(cfg.space)[0][1] == len(ops)
    derived = set()
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        with torch.no_grad():
            for alpha in net.alphas():
                alpha.copy_(torch.randn(alpha.shape, generator=generator))
        derived |= ops_of(net.genotype())
    randoms = set().union(*(ops_of(space.random_genotype(cfg.space, np.random.default_rng(s))) for s in range(20)))
    assert derived <= set(candidates) and randoms <= set(candidates)
    assert len(derived) >= 2 and len(randoms) >= 2  # the checks above look at more than one op

    own = space.random_genotype(cfg.space, np.random.default_rng(0)).to_string()
    assert ops_of(parse_genotype(own, "augment.genotype", cfg.space)) <= set(candidates)
    unrestricted = load_config(None, [*PRE_RECIPE, f"space.kind={kind}", "space.nodes=3"])
    other_op = next(op for op in space.primitives if op not in candidates and op != "none")
    other = space.largest_genotype(unrestricted)  # every edge the largest op of the whole space
    assert other_op in ops_of(other) or not ops_of(other) <= set(candidates)
    with pytest.raises(SetupError, match=r"^augment\.genotype: .*(not among space\.ops|unknown op)") as info:
        parse_genotype(other.to_string(), "augment.genotype", cfg.space)
    assert "\n" not in str(info.value)
    parse_genotype(other.to_string(), "augment.genotype", unrestricted.space)  # the same text, every op allowed


def test_every_op_name_the_config_accepts_has_a_constructor() -> None:
    """The config checks ``space.ops`` against the torch-free names of ``mpi_fnas.op_names``; the networks build
    ops from their own registries. Both must name the same ops."""
    from mpi_fnas.op_names import DPNAS_ACTIVATIONS, PRIMITIVES_BY_KIND
    from mpi_fnas.space import dpnas, search_space
    from mpi_fnas.space.dpnas.ops import ACTIVATIONS, OPS

    assert tuple(ACTIVATIONS) == DPNAS_ACTIVATIONS and tuple(OPS) == dpnas.PRIMITIVES
    for kind, names in PRIMITIVES_BY_KIND.items():
        assert search_space(kind).primitives == names
    for name in PRIMITIVES_BY_KIND["darts"]:
        assert isinstance(make_op(name, 4, 1, "groupnorm", affine=True), nn.Module)


@pytest.mark.parametrize(("kind", "ops", "message"), [
    ("darts", "conv_3x3_selu", r"^space\.ops: unknown op\(s\) conv_3x3_selu; expected ops of none, max_pool_3x3"),
    ("dpnas", "sep_conv_3x3, conv_3x3_selu", r"^space\.ops: unknown op\(s\) sep_conv_3x3; expected ops of none"),
    ("dpnas", "conv_3x3_selu, conv_3x3_selu", r"^space\.ops: an op is named twice"),
    ("darts", "none", r"^space\.ops: needs at least one op other than none"),
    ("dpnas", "3", r"^space\.ops: expected a string, got 3$"),
])
def test_bad_space_ops_are_one_line(kind: str, ops: str, message: str) -> None:
    from mpi_fnas.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [*PRE_RECIPE, f"space.kind={kind}", f"space.ops=[{ops}]"])
    assert "\n" not in str(info.value)
