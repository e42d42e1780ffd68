"""The hand-designed networks of ``augment.network``: their shapes and sizes at the project's image sizes,
the paper's parameter counts, their DP-compatibility, their per-example gradients against a per-example loop, and
the one builder that picks the augmented network (and the secure-aggregation dimension it implies). A ScatterNet
takes the scattering of the images (its fixed stem, computed once): the tests feed it that."""

from __future__ import annotations

import typing

import pytest
import torch
from conftest import perturb_others
from pre_recipe import PRE_RECIPE
from torch import nn

from mpi_fnas.config import AUGMENT_NETWORKS, HANDCRAFTED_NETWORKS, AugmentConfig, load_config
from mpi_fnas.federation.flat import numel
from mpi_fnas.federation.job_plan import SetupError, attach_resume, plan_augment_stage, plan_run, secure_dimension
from mpi_fnas.privacy import check_model_for_dp, per_example_cross_entropy, per_sample_gradients
from mpi_fnas.privacy.per_sample import hooks_supported
from mpi_fnas.secagg.encoding import padded_length
from mpi_fnas.space import (
    HANDCRAFTED,
    AugmentNetwork,
    augment_network,
    build_handcrafted,
    largest_augment_network,
    search_space,
)
from mpi_fnas.space.handcrafted import GroupNormNet, ScatterCnn, ScatterLinear, TanhCifarNet, TanhMnistNet
from mpi_fnas.space.scattering import fixed_stem_of

#: Image sides the project uses (tests and configs: 8, 14, 16; MNIST 28; CIFAR-10 32), and a few odd ones.
SIDES = (8, 9, 11, 13, 14, 16, 28, 32)


def batch(channels: int, side: int, n: int = 5, classes: int = 10, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, channels, side, side, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def inputs(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `net` is trained on for the images `x`: their scattering for a ScatterNet, else the images."""
    stem = fixed_stem_of(net)
    return stem(x) if stem is not None else x


def loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Reference: one ordinary backward per example -> (B, P), in ``named_parameters`` order."""
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        per_example_cross_entropy(model(x[i: i + 1]), y[i: i + 1]).sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows)


def test_the_config_names_are_the_builders():
    assert tuple(HANDCRAFTED) == HANDCRAFTED_NETWORKS
    assert typing.get_args(typing.get_type_hints(AugmentConfig)["network"]) == AUGMENT_NETWORKS


@pytest.mark.parametrize("name", HANDCRAFTED_NETWORKS)
@pytest.mark.parametrize("channels", [1, 3])
def test_every_network_takes_every_side_and_gives_logits(name, channels):
    for side in SIDES:
        net = build_handcrafted(name, seed=0, in_channels=channels, num_classes=7, image_size=side)
        x, _ = batch(channels, side)
        assert net(inputs(net, x)).shape == (5, 7), (name, channels, side)
        with pytest.raises(ValueError, match=rf"expected \(N, {channels}, {side}, {side}\)"):
            net(inputs(net, batch(channels, side + 1)[0]))  # built for one side: another is refused, not resized


def test_the_papers_parameter_counts_and_the_final_maps():
    # Papernot et al. 2021: the MNIST net has 26,010 parameters at 28x28, the CIFAR-10 net 550,570 at 32x32.
    assert TanhMnistNet(1, 10, 28).num_params() == 26_010
    assert TanhCifarNet(3, 10, 32).num_params() == 550_570
    # cnn-tanh is the paper's net for the kind of image: MNIST's for one channel, CIFAR-10's for colour.
    assert type(build_handcrafted("cnn-tanh", seed=0, in_channels=1, num_classes=10, image_size=28)) is TanhMnistNet
    assert type(build_handcrafted("cnn-tanh", seed=0, in_channels=3, num_classes=10, image_size=16)) is TanhCifarNet
    # cnn-gn: ~24 k at 28x28, and the same at every side (global pooling).
    assert GroupNormNet(1, 10, 28).num_params() == 24_058
    assert {GroupNormNet(3, 10, side).num_params() for side in SIDES} == {24_346}
    # The fc is sized to the final map: 32·4·4 at 28x28, 32·1·1 at 14 and 16, and at 8 thanks to the extra padding.
    for side, features in ((28, 512), (16, 32), (14, 32), (8, 32)):
        assert TanhMnistNet(1, 10, side).classifier[0].in_features == features, side
    assert TanhMnistNet(1, 10, 28).features[3].padding == (0, 0)  # the paper's second conv, unpadded
    assert TanhMnistNet(1, 10, 8).features[3].padding == (2, 2)  # 3x3 under a 4x4 kernel: padded to a 2x2 output
    for side, features in ((32, 2048), (16, 512), (8, 128)):
        assert TanhCifarNet(3, 10, side).classifier[0].in_features == features, side
    # Tramèr & Boneh 2021 at 28x28 grey: the scattering's 81x7x7 features, a linear layer (39,700) or their CNN
    # (33 k: 33,066), GroupNorm of 27 groups without parameters.
    for net, params in ((ScatterLinear(1, 10, 28), 39_700), (ScatterCnn(1, 10, 28), 33_066)):
        assert net.num_params() == params and (net.in_channels, net.image_size) == (81, 7)
        assert net.features[0].num_groups == 27 and not net.features[0].affine
        assert inputs(net, batch(1, 28)[0]).shape == (5, 81, 7, 7)
    assert ScatterLinear(3, 10, 32).in_channels == 243  # 81 a colour channel, at 8x8


def test_the_sizes_are_checked():
    with pytest.raises(ValueError, match="image_size must be >= 8"):
        build_handcrafted("cnn-gn", seed=0, in_channels=3, num_classes=10, image_size=7)
    with pytest.raises(ValueError, match="unknown hand-designed network 'cnn-relu'"):
        build_handcrafted("cnn-relu", seed=0, in_channels=3, num_classes=10, image_size=8)


@pytest.mark.parametrize("name", HANDCRAFTED_NETWORKS)
def test_the_networks_are_accepted_under_dp_and_seeded(name):
    net = build_handcrafted(name, seed=3, in_channels=3, num_classes=10, image_size=16)
    check_model_for_dp(net)  # no BatchNorm: GroupNorm normalises each example on its own
    again = build_handcrafted(name, seed=3, in_channels=3, num_classes=10, image_size=16)
    other = build_handcrafted(name, seed=4, in_channels=3, num_classes=10, image_size=16)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(net.parameters(), other.parameters(), strict=True))
    assert net.weights() == net.main_parameters() == list(net.parameters())
    assert net.num_params() == numel(net.weights())


def test_a_hand_designed_network_has_no_paths_to_drop():
    net = build_handcrafted("cnn-gn", seed=0, in_channels=3, num_classes=10, image_size=8)
    net.drop_path_prob = 0.1
    with pytest.raises(ValueError, match="no paths to drop"):
        net(batch(3, 8)[0])
    net.eval()
    net(batch(3, 8)[0])  # evaluation never drops anything


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize(("name", "channels", "side"), [("cnn-tanh", 1, 28), ("cnn-tanh", 1, 8), ("cnn-tanh", 3, 8),
                                                        ("cnn-gn", 1, 14), ("cnn-gn", 3, 8), ("scatter-linear", 1, 28),
                                                        ("scatter-cnn", 1, 28), ("scatter-cnn", 3, 16)])
def test_per_example_gradients_match_the_loop(name, channels, side, layout):
    """The party's method (hooks: conv, linear and GroupNorm owners) against one backward per example, in the
    party's channels-last layout too; and example 0's gradient does not move when the others change (GroupNorm
    normalises per example)."""
    torch.manual_seed(0)
    net = build_handcrafted(name, seed=0, in_channels=channels, num_classes=10, image_size=side)
    x, y = batch(channels, side)
    x = inputs(net, x)
    expected = loop_gradients(net, x, y)
    net.to(memory_format=layout)
    params = dict(net.named_parameters())
    assert hooks_supported(net, params)  # the augmentation insists on hooks
    got = per_sample_gradients(net, params, x.contiguous(memory_format=layout), y, method="hooks")
    assert got.shape == (5, net.num_params())
    assert float(((got - expected).norm(dim=1) / expected.norm(dim=1)).max()) <= 1e-5
    changed = per_sample_gradients(net, params, perturb_others(x).contiguous(memory_format=layout), y, method="hooks")
    assert torch.allclose(changed[0], got[0], rtol=1e-5, atol=1e-7)
    assert not torch.allclose(changed[1], got[1])


def test_augment_network_builds_what_augment_network_names():
    shape = {"seed": 0, "in_channels": 3, "num_classes": 10}
    cell_cfg = load_config(None, [*PRE_RECIPE, "data.image_size=8", "augment.layers=2", "augment.channels=4"])
    genotype = search_space("darts").largest_genotype(cell_cfg)
    assert isinstance(augment_network(cell_cfg, genotype, **shape), AugmentNetwork)
    with pytest.raises(ValueError, match="needs a genotype"):
        augment_network(cell_cfg, None, **shape)
    for name, kind in (("cnn-tanh", TanhCifarNet), ("cnn-gn", GroupNormNet)):
        cfg = load_config(None, [*PRE_RECIPE, "data.image_size=8", f"augment.network={name}"])
        net = augment_network(cfg, None, **shape)
        assert type(net) is kind and net.image_size == 8
        assert type(largest_augment_network(cfg, **shape)) is kind
        with pytest.raises(ValueError, match="takes no genotype"):
            augment_network(cfg, genotype, **shape)


def test_the_secure_dimension_is_the_largest_network_the_augmentation_may_train():
    """Under ``augment.network: cnn-tanh`` on colour images the CIFAR-10 net (305 k parameters at 8x8) is the largest
    release, so D follows it; under ``cell`` the largest cell's network (a few thousand here) does not reach it."""
    common = ["data.image_size=8", "space.channels=4", "space.layers=2", "space.nodes=2", "augment.layers=2",
              "augment.channels=4", "privacy.aggregation=secure"]
    tanh = load_config(None, [*PRE_RECIPE, *common, "augment.network=cnn-tanh"])
    assert secure_dimension(tanh, 3, 10) == padded_length(TanhCifarNet(3, 10, 8).num_params())
    assert secure_dimension(load_config(None, common), 3, 10) < padded_length(TanhCifarNet(3, 10, 8).num_params())


def test_a_resume_must_continue_the_checkpointed_network():
    """The augmentation's checkpoint names its network: a resume of another one is refused in one line, and a
    checkpoint written before augment.network existed counts as a cell's."""
    cfg = load_config(None, [*PRE_RECIPE, "data.train_size=400", "data.test_size=40", "data.image_size=8",
                             "augment.network=cnn-gn", "augment.steps_per_epoch=2", "mode=fnas"])
    search = plan_run(cfg, 2, search=False)
    plan = plan_augment_stage(cfg, search.assignments, None, None, None)
    assert (plan.network, plan.genotype_text) == ("cnn-gn", "")
    assert {(a.network, a.genotype) for a in plan.assignments} == {("cnn-gn", "")}
    attach_resume(plan, {"plan_steps": plan.steps, "genotype": "", "network": "cnn-gn", "step": 3})
    assert {a.checkpoint_step for a in plan.assignments} == {3}
    for checkpoint in ({"plan_steps": plan.steps, "genotype": "", "network": "cnn-tanh", "step": 3},
                       {"plan_steps": plan.steps, "genotype": "", "step": 3}):  # no key: a cell's
        with pytest.raises(SetupError, match=r"different plan \(.* steps, network cnn-tanh|network cell"):
            attach_resume(plan, checkpoint)


def test_a_party_computes_the_scattering_of_its_own_pool_once_and_only_that(monkeypatch):
    """The augmentation's party side: the fixed stem runs once, at build, on the party's own pool (its search
    shards, in order) and on nothing else; its shard then holds exactly those features."""
    from mpi_fnas.federation.job_plan import open_split, party_view
    from mpi_fnas.space import scattering
    from mpi_fnas.stages.augment import AugmentSide, own_pool

    cfg = load_config(None, [*PRE_RECIPE, "data.train_size=200", "data.test_size=20", "data.image_size=8",
                             "augment.network=scatter-linear", "augment.epochs=1", "mode=fnas"])
    seen: list[torch.Tensor] = []
    real = scattering.Scattering.__call__
    monkeypatch.setattr(scattering.Scattering, "__call__", lambda self, x: seen.append(x.clone()) or real(self, x))
    planned = plan_run(cfg, 2).assignments
    got = plan_augment_stage(cfg, planned, None, None, None).assignments[1]
    data = open_split(cfg, "train")
    side = AugmentSide(cfg)
    side.check(cfg, got, party_view(cfg, data, 2, 2), parties=2, rank=2)
    party = side.build(cfg, got, data, 2, torch.device("cpu"))
    x, _ = own_pool(cfg, data, got, 2)
    assert len(seen) == 1 and torch.equal(seen[0], x)  # once, its own examples, nothing else
    stem = scattering.Scattering(3, 8)
    assert torch.allclose(party.train.x.contiguous(), real(stem, x), atol=1e-6)
    assert party.train.x.shape == (len(got.pool_indices), 243, 2, 2)
