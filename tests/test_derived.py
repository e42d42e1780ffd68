"""Tests for the augment network (derived cells, auxiliary head, per-example drop-path), its loss, the DARTS_V2
genotype, and batched image augmentation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from mpi_fnas.data.augmentation import augment_images
from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.per_sample import per_sample_gradients
from mpi_fnas.privacy.validators import check_model_for_dp
from mpi_fnas.space import (
    DARTS_V2,
    AugmentNetwork,
    AuxiliaryHead,
    DerivedCell,
    Genotype,
    augment_loss,
    build_augment_network,
    derived,
)
from mpi_fnas.space.ops import DilConv, FactorizedReduce, SepConv
from mpi_fnas.space.scaffold import CellPlace

# Two nodes, every op kind, a strided skip (FactorizedReduce) and an unstrided one (identity) in the reduce cell.
SMALL = Genotype(
    normal=(("sep_conv_3x3", 0), ("dil_conv_5x5", 1), ("skip_connect", 0), ("avg_pool_3x3", 2)),
    normal_concat=(2, 3),
    reduce=(("skip_connect", 0), ("sep_conv_5x5", 1), ("dil_conv_3x3", 2), ("max_pool_3x3", 1)),
    reduce_concat=(2, 3),
)
# Same ops, but the reduce cell outputs node 1 only: the next cells' input widths must follow len(concat).
SMALL_PARTIAL_CONCAT = Genotype(
    normal=SMALL.normal, normal_concat=(2, 3), reduce=SMALL.reduce, reduce_concat=(3,)
)
# The timing genotype: DARTS_V2-like with two nodes.
V2_NODES2 = Genotype(
    normal=(("sep_conv_3x3", 0), ("sep_conv_3x3", 1), ("sep_conv_3x3", 0), ("skip_connect", 2)),
    normal_concat=(2, 3),
    reduce=(("max_pool_3x3", 0), ("max_pool_3x3", 1), ("skip_connect", 2), ("max_pool_3x3", 1)),
    reduce_concat=(2, 3),
)


def small_net(*, auxiliary: bool = True, layers: int = 3, channels: int = 4, seed: int = 0) -> AugmentNetwork:
    return build_augment_network(
        SMALL, channels=channels, layers=layers, seed=seed, in_channels=3, num_classes=5, auxiliary=auxiliary
    )


# ---------------------------------------------------------------------------------------------- parameter count


def _gn(c: int) -> int:
    return 2 * c  # affine GroupNorm: one scale and one shift per channel


def _dil_conv(c: int, k: int) -> int:
    return c * k * k + c * c + _gn(c)  # depthwise k x k (groups = c), pointwise 1x1, norm


def _expected_op_params(name: str, c: int, stride: int) -> int:
    if name.startswith("sep_conv_"):
        return 2 * _dil_conv(c, int(name[-1]))
    if name.startswith("dil_conv_"):
        return _dil_conv(c, int(name[-1]))
    if name == "skip_connect":
        return 0 if stride == 1 else c * (c // 2) + c * (c - c // 2) + _gn(c)  # two half-width 1x1 convs + norm
    assert name in ("max_pool_3x3", "avg_pool_3x3")
    return 0  # no trailing norm in an evaluation cell


def _expected_params(genotype: Genotype, channels: int, layers: int, classes: int, stem_mult: int = 3) -> tuple:
    """(main network, auxiliary head) parameter counts from the op definitions, written independently of the
    network's own channel bookkeeping."""
    stem = stem_mult * channels
    total = 3 * stem * 9 + _gn(stem)
    c_pp = c_p = stem
    c = channels
    aux_in = None
    for layer in range(layers):
        reduction = layer in (layers // 3, 2 * layers // 3)
        c = 2 * c if reduction else c
        edges = genotype.reduce if reduction else genotype.normal
        concat = genotype.reduce_concat if reduction else genotype.normal_concat
        total += c_pp * c + _gn(c)  # preprocess0: 1x1 conv or FactorizedReduce, both c_pp * c weights
        total += c_p * c + _gn(c)  # preprocess1
        for name, j in edges:
            total += _expected_op_params(name, c, 2 if reduction and j < 2 else 1)
        c_pp, c_p = c_p, len(concat) * c
        if layer == 2 * layers // 3:
            aux_in = c_p
    total += c_p * classes + classes
    aux = aux_in * 128 + _gn(128) + 128 * 768 * 2 * 2 + _gn(768) + 768 * classes + classes
    return total, aux


@pytest.mark.parametrize("genotype", [SMALL, SMALL_PARTIAL_CONCAT, V2_NODES2])
@pytest.mark.parametrize(("layers", "channels"), [(1, 4), (3, 4), (5, 6), (8, 4)])
def test_num_params_matches_a_hand_count(genotype: Genotype, layers: int, channels: int) -> None:
    net = AugmentNetwork(genotype, channels, 7, layers, auxiliary=True)
    main, aux = _expected_params(genotype, channels, layers, 7)
    assert net.num_params() == main
    assert sum(p.numel() for p in net.main_parameters()) == main
    assert sum(p.numel() for p in net.auxiliary_head.parameters()) == aux
    # weights() is everything (the head is trained and federated too), in named_parameters order.
    assert sum(p.numel() for p in net.weights()) == main + aux
    assert all(p is q for p, (_, q) in zip(net.weights(), net.named_parameters(), strict=True))
    assert len(net.weights()) == len(list(net.parameters()))
    plain = AugmentNetwork(genotype, channels, 7, layers, auxiliary=False)
    assert plain.num_params() == main and sum(p.numel() for p in plain.weights()) == main


def test_darts_v2_at_cifar10_size_has_the_published_parameter_count() -> None:
    # DARTS' CIFAR-10 evaluation network (36 channels, 20 cells) logs "param size = 3.349342MB" (aux excluded);
    # GroupNorm has as many affine parameters as BatchNorm.
    net = AugmentNetwork(DARTS_V2, 36, 10, 20, auxiliary=True)
    assert net.num_params() == 3_349_342


# ---------------------------------------------------------------------------------------------- structure


def _expected_op_type(name: str, stride: int) -> type:
    if name == "skip_connect":
        return nn.Identity if stride == 1 else FactorizedReduce
    return {
        "sep_conv_3x3": SepConv, "sep_conv_5x5": SepConv, "dil_conv_3x3": DilConv, "dil_conv_5x5": DilConv,
        "max_pool_3x3": nn.MaxPool2d, "avg_pool_3x3": nn.AvgPool2d,
    }[name]


@pytest.mark.parametrize("genotype", [SMALL, DARTS_V2])
def test_cells_build_exactly_the_genotype_ops(genotype: Genotype) -> None:
    net = AugmentNetwork(genotype, 4, 10, 5)
    assert net.reduction_layers == (1, 3)
    for layer, cell in enumerate(net.cells):
        assert cell.reduction == (layer in (1, 3))
        edges = genotype.reduce if cell.reduction else genotype.normal
        assert len(cell.ops) == len(edges) and cell.indices == tuple(j for _, j in edges)
        expected = [_expected_op_type(name, 2 if cell.reduction and j < 2 else 1) for name, j in edges]
        assert [type(op) for op in cell.ops] == expected
        assert Counter(type(op) for op in cell.ops) == Counter(expected)
        for (name, j), op in zip(edges, cell.ops, strict=True):
            stride = 2 if cell.reduction and j < 2 else 1
            if "conv" in name:
                depthwise = op[0][1] if isinstance(op, SepConv) else op[1]
                k = int(name[-1])
                assert depthwise.kernel_size == (k, k) and depthwise.stride == (stride, stride)
                assert depthwise.dilation == ((2, 2) if name.startswith("dil") else (1, 1))
                assert all(m.affine for m in op.modules() if isinstance(m, nn.GroupNorm))
            elif "pool" in name:
                assert op.stride == stride
        # preprocess0 reduces when the previous cell did
        assert isinstance(cell.preprocess0, FactorizedReduce) == (layer - 1 in (1, 3))
    check_model_for_dp(net)  # groupnorm by default: no sample-mixing layer


def test_reduction_and_aux_positions() -> None:
    expected = {1: (0,), 2: (0, 1), 3: (1, 2), 5: (1, 3), 6: (2, 4), 8: (2, 5)}
    for layers, positions in expected.items():
        net = AugmentNetwork(SMALL, 4, 10, layers, auxiliary=True)
        assert net.reduction_layers == positions
        assert tuple(i for i, c in enumerate(net.cells) if c.reduction) == positions
        assert net.aux_layer == 2 * layers // 3 == positions[-1]


@pytest.mark.parametrize("size", [16, 32])
@pytest.mark.parametrize(("genotype", "layers"), [(SMALL, 3), (SMALL_PARTIAL_CONCAT, 5), (DARTS_V2, 6)])
def test_output_shapes(genotype: Genotype, layers: int, size: int) -> None:
    torch.manual_seed(0)
    net = AugmentNetwork(genotype, 4, 10, layers, auxiliary=True)
    seen: dict[str, torch.Size] = {}

    def record_input(_module: nn.Module, args: tuple, _out: torch.Tensor) -> None:
        seen["aux_in"] = args[0].shape

    net.auxiliary_head.register_forward_hook(record_input)
    x = torch.randn(2, 3, size, size)
    logits, aux = net.train()(x)
    assert logits.shape == aux.shape == (2, 10)
    assert torch.isfinite(logits).all() and torch.isfinite(aux).all()
    # the head reads the output of the second reduction cell: 1/4 of the input resolution
    assert seen["aux_in"][2:] == (size // 4, size // 4)
    eval_out = net.eval()(x)
    assert isinstance(eval_out, torch.Tensor) and eval_out.shape == (2, 10)
    assert isinstance(AugmentNetwork(genotype, 4, 10, layers).train()(x), torch.Tensor)  # no aux: logits only


def test_auxiliary_head_any_resolution_and_loss() -> None:
    head = AuxiliaryHead(8, 3, "groupnorm")
    for size in (2, 4, 8, 7):
        assert head(torch.randn(2, 8, size, size)).shape == (2, 3)
    logits, aux = torch.randn(4, 3), torch.randn(4, 3)
    y = torch.tensor([0, 1, 2, 1])
    ce = nn.functional.cross_entropy
    assert torch.allclose(augment_loss(logits, y, 0.4), ce(logits, y, reduction="none"))
    assert torch.allclose(
        augment_loss((logits, aux), y, 0.4), ce(logits, y, reduction="none") + 0.4 * ce(aux, y, reduction="none")
    )


def test_construction_is_deterministic_and_validated() -> None:
    a, b, c = small_net(seed=3), small_net(seed=3), small_net(seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.weights(), b.weights(), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a.weights(), c.weights(), strict=True))
    # the auxiliary head is built last: the main network's initial weights do not depend on it
    plain = small_net(seed=3, auxiliary=False)
    assert all(torch.equal(p, q) for p, q in zip(plain.weights(), a.main_parameters(), strict=True))
    for kwargs, message in (
        ({"channels": 1}, "channels must be >= 2"),
        ({"layers": 0}, "layers must be >= 1"),
        ({"num_classes": 0}, "num_classes must be >= 1"),
        ({"in_channels": 0}, "in_channels must be >= 1"),
        ({"stem_multiplier": 0}, "stem_multiplier must be >= 1"),
    ):
        args = {"channels": 4, "num_classes": 10, "layers": 3, **kwargs}
        with pytest.raises(ValueError, match=message):
            AugmentNetwork(SMALL, **args)
    with pytest.raises(ValueError, match="unknown norm"):
        AugmentNetwork(SMALL, 4, 10, 3, norm="layernorm")
    with pytest.raises(TypeError, match="Genotype"):
        AugmentNetwork(SMALL.to_string(), 4, 10, 3)
    with pytest.raises(ValueError, match="cannot be built"):
        DerivedCell(Genotype((("none", 0), ("sep_conv_3x3", 1)), (2,), SMALL.reduce[:2], (2,)),
                    CellPlace(4, 4, 4, False, False), "groupnorm")
    with pytest.raises(ValueError, match=r"expected \(N, 3, H, W\)"):
        small_net()(torch.randn(2, 1, 8, 8))


# ---------------------------------------------------------------------------------------------- drop-path


def _drop_net(p: float = 0.5, seed: int = 0) -> AugmentNetwork:
    net = small_net().train()
    net.drop_path_prob = p
    net.mask_stream = Keystream.from_labels("test", seed)
    return net


def test_drop_path_masks_are_per_example_and_from_the_stream_only() -> None:
    net = _drop_net()
    x = torch.randn(1, 3, 8, 8).expand(16, 3, 8, 8).contiguous()  # 16 copies of one image
    state = torch.random.get_rng_state()
    logits, aux = net(x)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG was not consumed
    # identical inputs, different per-example masks -> different outputs within the batch
    assert len({tuple(row.tolist()) for row in logits}) > 1
    # the same stream key reproduces the outputs exactly, another key does not
    net.mask_stream = Keystream.from_labels("test", 0)
    again, aux_again = net(x)
    assert torch.equal(again, logits) and torch.equal(aux_again, aux)
    net.mask_stream = Keystream.from_labels("test", 1)
    assert not torch.equal(net(x)[0], logits)


def test_drop_path_mask_distribution() -> None:
    mask = derived.drop_path_mask(20000, 0.3, Keystream.from_labels("test", 0), device=torch.device("cpu"),
                                  dtype=torch.float32)
    assert mask.shape == (20000, 1, 1, 1)
    values = mask.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / 0.7)
    assert abs((mask == 0).float().mean().item() - 0.3) < 0.02  # Bernoulli(1 - p) keeps, ~6 sigma margin
    x = torch.randn(4, 3, 5, 5)
    assert derived.drop_path(x, 0.0, None) is x
    with pytest.raises(ValueError, match="Keystream"):
        derived.drop_path(x, 0.2, None)


def test_no_drop_path_in_eval_mode_and_identity_is_never_dropped() -> None:
    net = _drop_net(p=0.5)
    x = torch.randn(4, 3, 8, 8)
    position = net.mask_stream.position
    reference = _drop_net(p=0.0).eval()(x)
    assert torch.equal(net.eval()(x), reference)
    assert net.mask_stream.position == position  # eval draws nothing
    net.train()
    net.drop_path_prob = 0.0
    assert torch.equal(net(x)[0], reference)  # (no norm uses batch statistics: train == eval without drop-path)
    # one mask per non-identity op per cell: SMALL has one identity (normal skip) among 4 ops of a normal cell
    calls = []
    original = derived.drop_path_mask

    def counting(batch: int, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(batch)
        return original(batch, *args, **kwargs)

    net.drop_path_prob = 0.5
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(derived, "drop_path_mask", counting)
        net(x)
    normal_cells = sum(not c.reduction for c in net.cells)
    reduce_cells = len(net.cells) - normal_cells
    assert calls == [4] * (3 * normal_cells + 4 * reduce_cells)


def test_drop_path_requires_a_stream_and_a_valid_probability() -> None:
    net = small_net().train()
    net.drop_path_prob = 0.2
    with pytest.raises(ValueError, match="needs `mask_stream`"):
        net(torch.randn(2, 3, 8, 8))
    net.eval()(torch.randn(2, 3, 8, 8))  # eval: no masks, no stream needed
    net.drop_path_prob = 1.0
    with pytest.raises(ValueError, match=r"drop_path_prob must be in \[0, 1\)"):
        net(torch.randn(2, 3, 8, 8))


# ---------------------------------------------------------------------------------------------- per-example grads


def _single_example_grads(net: AugmentNetwork, x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
    params = net.weights()
    loss = augment_loss(net(x), y, weight).sum()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])  # every parameter is used


def test_hooks_per_example_grads_match_a_loop_with_aux_head() -> None:
    torch.manual_seed(0)
    net = small_net(layers=3).double().train()
    x, y = torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (5,))
    params = dict(net.named_parameters())
    rows = per_sample_gradients(net, params, x, y, loss_fn=lambda o, t: augment_loss(o, t, 0.4), method="hooks")
    assert rows.shape == (5, sum(p.numel() for p in net.weights()))
    for i in range(5):
        expected = _single_example_grads(net, x[i : i + 1], y[i : i + 1], 0.4)
        torch.testing.assert_close(rows[i], expected, atol=1e-5, rtol=1e-5)
    # the aux head does get gradient (its weight would otherwise silently not train)
    aux_start = sum(p.numel() for p in net.main_parameters())
    assert rows[:, aux_start:].abs().sum() > 0


def test_hooks_per_example_grads_with_drop_path_match_each_example_alone_with_its_masks() -> None:
    """Record the masks the batched forward draws, then replay example i's masks for example i alone."""
    torch.manual_seed(1)
    net = small_net(layers=3).double().train()
    net.drop_path_prob = 0.5
    net.mask_stream = Keystream.from_labels("test", 5)
    batch = 6
    x, y = torch.randn(batch, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (batch,))
    recorded: list[torch.Tensor] = []
    original = derived.drop_path_mask

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        recorded.append(original(*args, **kwargs))
        return recorded[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(derived, "drop_path_mask", recording)
        rows = per_sample_gradients(
            net, dict(net.named_parameters()), x, y, loss_fn=lambda o, t: augment_loss(o, t, 0.4), method="hooks"
        )
    # (batch, masks drawn): row i holds example i's masks in draw order
    masks = torch.cat([m.reshape(batch, 1) for m in recorded], dim=1)
    assert (masks == 0).any() and (masks != 0).any()
    assert len({tuple(row.tolist()) for row in masks}) > 1  # examples got different masks
    for i in range(batch):
        replay = iter(masks[i].tolist())

        def replaying(
            n: int, *_args: object, dtype: torch.dtype, device: torch.device, replay=replay, **_kw: object
        ) -> torch.Tensor:
            return torch.full((n, 1, 1, 1), next(replay), dtype=dtype, device=device)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(derived, "drop_path_mask", replaying)
            expected = _single_example_grads(net, x[i : i + 1], y[i : i + 1], 0.4)
        assert next(replay, None) is None  # every mask replayed, in the same order
        torch.testing.assert_close(rows[i], expected, atol=1e-5, rtol=1e-5)


def test_hooks_method_float32_timing_genotype() -> None:
    torch.manual_seed(2)
    net = build_augment_network(V2_NODES2, channels=4, layers=3, seed=0, in_channels=3, num_classes=10,
                                auxiliary=True).train()
    x, y = torch.randn(3, 3, 16, 16), torch.randint(0, 10, (3,))
    rows = per_sample_gradients(net, dict(net.named_parameters()), x, y,
                                loss_fn=lambda o, t: augment_loss(o, t, 0.4), method="hooks")
    for i in range(3):
        expected = _single_example_grads(net, x[i : i + 1], y[i : i + 1], 0.4)
        torch.testing.assert_close(rows[i], expected, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- genotype


def test_darts_v2_round_trips_and_has_four_nodes() -> None:
    assert DARTS_V2.nodes == 4
    assert Genotype.from_string(DARTS_V2.to_string()) == DARTS_V2
    assert DARTS_V2.normal_concat == DARTS_V2.reduce_concat == (2, 3, 4, 5)
    assert Counter(op for op, _ in DARTS_V2.normal) == {"sep_conv_3x3": 5, "skip_connect": 2, "dil_conv_3x3": 1}
    assert Counter(op for op, _ in DARTS_V2.reduce) == {"max_pool_3x3": 5, "skip_connect": 3}


# ---------------------------------------------------------------------------------------------- augmentation


def _gen(seed: int = 0) -> Keystream:
    return Keystream.from_labels("test", seed)


def test_augment_images_shapes_input_unchanged_and_determinism() -> None:
    x = torch.randn(32, 3, 12, 10)
    before = x.clone()
    options = {"cutout": 4, "crop_padding": 2, "flip": True}
    out = augment_images(x, stream=_gen(3), **options)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(x, before)
    assert torch.equal(augment_images(x, stream=_gen(3), **options), out)
    assert not torch.equal(augment_images(x, stream=_gen(4), **options), out)
    assert augment_images(x, stream=_gen(0)) is x  # every option off: a no-op
    assert augment_images(x, stream=_gen(0), cutout=0, crop_padding=0, flip=False) is x
    with pytest.raises(ValueError, match="non-negative int"):
        augment_images(x, stream=_gen(), cutout=-1)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        augment_images(x[0], stream=_gen(), flip=True)
    assert augment_images(x[:0], stream=_gen(), **options).shape == (0, 3, 12, 10)


def test_crop_is_a_per_example_shift_of_the_zero_padded_image() -> None:
    pad = 3
    x = torch.rand(64, 2, 9, 7) + 1.0  # strictly positive, so padding zeros are recognisable
    out = augment_images(x, stream=_gen(1), crop_padding=pad)
    padded = nn.functional.pad(x, (pad, pad, pad, pad))
    offsets = []
    for i in range(64):
        matches = [
            (dy, dx) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)
            if torch.equal(out[i], padded[i, :, dy : dy + 9, dx : dx + 7])
        ]
        assert len(matches) == 1
        offsets.append(matches[0])
    assert len(set(offsets)) > 10  # each example its own offset
    assert {dy for dy, _ in offsets} == set(range(2 * pad + 1))


def test_flip_mirrors_about_half_of_the_examples() -> None:
    x = torch.randn(200, 3, 5, 6)
    out = augment_images(x, stream=_gen(2), flip=True)
    flipped = torch.tensor([torch.equal(o, xi.flip(-1)) for o, xi in zip(out, x, strict=True)])
    kept = torch.tensor([torch.equal(o, xi) for o, xi in zip(out, x, strict=True)])
    assert bool((flipped ^ kept).all())
    assert 60 < int(flipped.sum()) < 140


def test_crop_and_flip_compose_to_a_mirrored_crop() -> None:
    x = torch.rand(64, 1, 6, 6) + 1.0
    pad = 2
    out = augment_images(x, stream=_gen(7), crop_padding=pad, flip=True)
    padded = nn.functional.pad(x, (pad, pad, pad, pad))
    for i in range(64):
        crops = [padded[i, :, dy : dy + 6, dx : dx + 6] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], c) or torch.equal(out[i], c.flip(-1)) for c in crops)


@pytest.mark.parametrize("size", [6, 5])
def test_cutout_is_a_clipped_square_per_example(size: int) -> None:
    height, width = 24, 20
    x = torch.rand(128, 3, height, width) + 1.0
    out = augment_images(x, stream=_gen(5), cutout=size)
    zero = out == 0
    assert torch.equal(zero.all(dim=1), zero.any(dim=1))  # every channel zeroed together
    assert torch.equal(out[~zero], x[~zero])  # everything else untouched
    interior, boxes = 0, set()
    for region in zero[:, 0]:
        rows = region.any(dim=1).nonzero().flatten()
        cols = region.any(dim=0).nonzero().flatten()
        assert len(rows) and len(cols)  # the centre is always inside the image
        y0, y1, x0, x1 = rows.min().item(), rows.max().item(), cols.min().item(), cols.max().item()
        assert int(region.sum()) == (y1 - y0 + 1) * (x1 - x0 + 1)  # a full rectangle
        assert y1 - y0 + 1 <= size and x1 - x0 + 1 <= size
        if y0 > 0 and y1 < height - 1 and x0 > 0 and x1 < width - 1:  # not clipped by any border
            interior += 1
            assert int(region.sum()) == size * size
        boxes.add((y0, x0))
    assert interior > 30 and len(boxes) > 30  # centres differ between examples
