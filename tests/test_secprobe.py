"""SecProbe, in process: the exponential-mechanism sampler, its privacy and its composition, the
unreliable parties' corruption, the aux set, the Gather path, the selection state across a checkpoint, bad config.

The real mpirun run (pure-noise unreliable parties, secprobe at a high ε_EM) is tests/test_secprobe_run.py.
"""

from __future__ import annotations

import itertools
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon as rdp_to_dp_epsilon
from pre_recipe import tiny
from scipy import stats

from mpi_fnas.checkpoint import atomic_save, load_checkpoint
from mpi_fnas.config import ConfigError, check_world, load_config
from mpi_fnas.data import open_dataset
from mpi_fnas.data.corruption import unreliable_parties
from mpi_fnas.data.datasets import pixel_statistics
from mpi_fnas.federation.algorithm import ServerBuffers, server_iteration
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.flat import STATS
from mpi_fnas.federation.global_model import Server, augment_server, search_server
from mpi_fnas.federation.job_plan import SetupError, open_split, plan_assignments
from mpi_fnas.federation.selection import Selector
from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.exponential import exponential_mechanism_select, selection_epsilon
from mpi_fnas.space import DARTS_V2, build_supernet, search_space
from mpi_fnas.stages.search import own_shard

TINY = tiny("augment.epochs=0",
            "privacy.aggregation=local")  # a selection needs each party's own release (secure shows only the sum)


# -- the exponential mechanism --------------------------------------------------------------------------------------
def exact_sequence_probabilities(scores: np.ndarray, k: int, epsilon: float, sensitivity: float) -> dict:
    """Pr of every ordered draw of k distinct indices, peeling with Pr ∝ exp(ε u / (2 k Δ)) (written out here,
    independently of the sampler)."""
    weights = np.exp(epsilon * scores / (2 * k * sensitivity))
    probabilities = {}
    for sequence in itertools.permutations(range(scores.size), k):
        p, left = 1.0, weights.sum()
        for index in sequence:
            p *= weights[index] / left
            left -= weights[index]
        probabilities[sequence] = p
    return probabilities


def test_sampler_frequencies_match_the_exact_without_replacement_distribution() -> None:
    scores = np.array([0.10, 0.30, 0.35, 0.60, 0.62])
    k, epsilon, sensitivity, draws = 2, 3.0, 0.25, 20_000
    exact = exact_sequence_probabilities(scores, k, epsilon, sensitivity)
    rng = Keystream.from_labels("test", 7)
    counts = dict.fromkeys(exact, 0)
    for _ in range(draws):
        counts[tuple(int(i) for i in exponential_mechanism_select(scores, k, epsilon, sensitivity, rng))] += 1
    observed = np.array([counts[s] for s in exact])
    expected = np.array([exact[s] for s in exact]) * draws
    assert math.isclose(expected.sum(), draws)
    _, p_value = stats.chisquare(observed, expected)
    assert p_value > 1e-3, (observed, expected.round(1))


def test_one_draw_is_epsilon_dp_for_scores_moved_by_the_sensitivity() -> None:
    """Every ordered outcome's probability changes by at most e^ε when each score moves by at most Δu (the
    guarantee the accountant charges per step), and the bound is nearly reached (the mechanism is not noisier)."""
    rng = np.random.default_rng(3)
    k, epsilon, sensitivity = 2, 1.5, 0.1
    worst = 0.0
    for _ in range(200):
        scores = rng.uniform(0, 1, 4)
        moved = scores + rng.choice([-sensitivity, sensitivity], 4) * rng.uniform(0.5, 1.0, 4)
        p, q = (exact_sequence_probabilities(s, k, epsilon, sensitivity) for s in (scores, moved))
        worst = max(worst, max(abs(math.log(p[s] / q[s])) for s in p))
    assert worst <= epsilon + 1e-9
    assert worst > 0.5 * epsilon


def test_selection_epsilon_is_basic_composition_or_the_zcdp_bound_reproduced_by_dp_accounting() -> None:
    # Few steps at a large ε each: basic composition T·ε binds below the zCDP bound.
    assert selection_epsilon(3, 2.0, 1, 1e-5) == pytest.approx(6.0)
    assert selection_epsilon(0, 5.0, 2, 1e-5) == 0.0
    # Many steps: zCDP. ρ = Σ over T·K′ peels of (ε/K′)²/8; dp_accounting's optimal RDP → DP conversion of the
    # same ρ (RDP ε(α) = ρα) must not exceed ours (Bun & Steinke's closed form is looser), and ours stays close.
    steps, epsilon, select, delta = 400, 0.5, 4, 1e-5
    rho = sum((epsilon / select) ** 2 / 8 for _ in range(steps * select))
    orders = np.linspace(1.01, 2000, 20000)
    tight, _ = rdp_to_dp_epsilon(orders, rho * orders, delta)
    ours = selection_epsilon(steps, epsilon, select, delta)
    assert ours < steps * epsilon
    assert tight <= ours <= 1.25 * tight
    assert ours == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1 / delta)))


# -- unreliable parties ---------------------------------------------------------------------------------------------
def test_unreliable_parties_are_drawn_from_the_seed() -> None:
    first = unreliable_parties(8, 4, seed=0)
    assert first.sum() == 4 and np.array_equal(first, unreliable_parties(8, 4, seed=0))
    assert any(not np.array_equal(first, unreliable_parties(8, 4, seed=s)) for s in range(1, 5))


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.75, 1.0])  # 0.75 · 50 = 37.5: rounded, not floored
def test_unreliable_shards_hold_exactly_the_stated_fraction_of_noise(fraction: float) -> None:
    cfg = load_config(overrides=[*TINY, "mode=fnas", "federation.unreliable_parties=2",
                                 f"federation.corruption={fraction}"])
    assignments = plan_assignments(cfg, 4)
    data = open_split(cfg, "train")
    mean, std = pixel_statistics(cfg.data.dataset)
    assert sum(a.unreliable for a in assignments) == 2
    assert [a.corruption for a in assignments] == [fraction if a.unreliable else 0.0 for a in assignments]
    for rank, got in enumerate(assignments, start=1):
        for shard, indices in (("train", got.train_indices), ("val", got.val_indices)):
            clean_x, _ = data.render(indices)
            x, y = own_shard(cfg, data, got, rank, shard)
            replaced = (x != clean_x).flatten(1).any(1).numpy()  # found from the pixels, not from the mask
            # round(P·N), written out here rather than taken from the code under test
            expected = round(fraction * len(indices)) if got.unreliable else 0
            assert replaced.sum() == expected
            assert abs(replaced.sum() - got.corruption * len(indices)) <= 0.5
            unit = x[replaced] * torch.from_numpy(std).view(1, 3, 1, 1) + torch.from_numpy(mean).view(1, 3, 1, 1)
            assert bool(((unit >= -1e-5) & (unit <= 1 + 1e-5)).all())  # uniform noise in [0, 1] before normalising
            if expected >= 50:  # random labels: roughly uniform over the 10 classes
                assert len(np.unique(y[replaced].numpy())) >= 8


# -- the aux set ----------------------------------------------------------------------------------------------------
def test_synthetic_aux_set_is_a_split_of_its_own_and_leaves_the_partition_unchanged() -> None:
    base = load_config(overrides=[*TINY, "mode=dpfnas"])
    with_aux = load_config(overrides=[*TINY, "mode=dpfnas", "federation.aux_size=32"])
    for a, b in zip(plan_assignments(base, 3), plan_assignments(with_aux, 3), strict=True):
        assert np.array_equal(a.train_indices, b.train_indices) and np.array_equal(a.val_indices, b.val_indices)
    x_aux, y_aux = open_aux_set(with_aux, open_split(with_aux, "train"))
    assert x_aux.shape == (32, 3, 8, 8) and y_aux.shape == (32,)
    train_x, _ = open_split(with_aux, "train").render(np.arange(400))
    flat_train = train_x.flatten(1)
    assert not any(bool((flat_train == row).all(1).any()) for row in x_aux.flatten(1))  # no train image reused


def test_cifar10_aux_set_is_a_held_out_slice_given_to_no_party(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (20, 3072), dtype=np.uint8)
        (folder / name).write_bytes(pickle.dumps({"data": data, "labels": [int(v) for v in rng.integers(0, 10, 20)]}))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    overrides = ["data.dataset=cifar10", f"data.root={tmp_path}", "data.image_size=32", "data.train_size=null",
                 "data.test_size=null", "mode=dpfnas", "augment.epochs=0", "federation.aux_size=15"]
    cfg = load_config(overrides=overrides)
    given = np.concatenate([np.concatenate([a.train_indices, a.val_indices]) for a in plan_assignments(cfg, 3)])
    assert sorted(given.tolist()) == list(range(85))  # the last 15 of 100 went to no party
    x_aux, y_aux = open_aux_set(cfg, open_split(cfg, "train"))
    x_held, y_held = open_dataset("cifar10", "train", root=tmp_path, image_size=32, size=None, seed=0).render(
        np.arange(85, 100))
    assert torch.equal(x_aux, x_held) and torch.equal(y_aux, y_held)
    with pytest.raises(SetupError, match=r"federation\.aux_size"):
        plan_assignments(load_config(overrides=[*overrides[:-1], "federation.aux_size=99"]), 3)


# -- the Gather path, in either stage ---------------------------------------------------------------------------------
STAGES = ["search", "augment"]


class ScriptedChannel:
    """Rank 0's side of the exchanges, the parties' releases given in advance: one (K, n + STATS) array per
    exchange, in order (per step: W, then the search's A)."""

    def __init__(self, rounds: list[np.ndarray]) -> None:
        self.rounds = list(rounds)
        self.parties = rounds[0].shape[0]

    def reduce_sum(self, send: np.ndarray, recv: np.ndarray) -> None:
        np.copyto(recv, send)
        for part in self.rounds.pop(0):
            np.add(recv, part, out=recv)

    def gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        np.copyto(recv, self.rounds.pop(0))

    def bcast(self, buf: np.ndarray) -> None:
        pass


def _stage_config(stage: str, *extra: str):
    common = [*TINY, "mode=dpfnas", "augment.layers=2", "augment.channels=4", "augment.momentum=0.9",
              "augment.weight_decay=0.0003", "augment.lr_min=0.01"]
    return load_config(overrides=[*common, *extra])


def _server(stage: str, parties: int, *extra: str, steps: int = 10) -> Server:
    """Either stage's server on the tiny config: the supernet (W and A) or a DARTS_V2 network (W only)."""
    cfg = _stage_config(stage, *extra)
    if stage == "search":
        return search_server(build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10), cfg.search, parties,
                             steps_per_epoch=steps)
    network = search_space("darts").build_augment_network(DARTS_V2, cfg, seed=0, in_channels=3, num_classes=10)
    return augment_server(network, cfg.augment, parties, steps)


def _releases(server: Server, parties: int, steps: int = 1, seed: int = 1) -> list[np.ndarray]:
    """Random releases of `steps` iterations: per step one (K, n + STATS) array per exchange."""
    rng = np.random.default_rng(seed)
    sizes = [server.w.numel()] + ([server.a.numel()] if server.a is not None else [])
    return [rng.normal(0, 0.05, (parties, n + STATS)).astype(np.float32) for _ in range(steps) for n in sizes]


def _iteration(server: Server, releases: list[np.ndarray], step: int, selector: Selector | None = None,
               aux: tuple = (None, None)):
    """Rank 0's iteration `step` on scripted releases (a Gather when `selector` is given, else a Reduce)."""
    gathered = releases[0].shape[0] if selector is not None else None
    server.begin_step(step)
    buffers = ServerBuffers(server.w.numel(), server.a.numel() if server.a is not None else None,
                            gathered_parties=gathered)
    return server_iteration(server, ScriptedChannel(releases), buffers, selector=selector, aux=aux)


def _same_state(first: Server, second: Server) -> bool:
    return torch.equal(first.w.data, second.w.data) and (first.a is None or torch.equal(first.a.data, second.a.data))


def _fed(selection: str = "all", select: int | None = None):
    extra = [] if selection == "all" else [f"federation.selection={selection}", f"federation.select={select}",
                                           "federation.aux_size=16"]
    return load_config(overrides=[*TINY, "mode=dpfnas", *extra]).federation


@pytest.mark.parametrize("stage", STAGES)
def test_gather_path_with_all_selected_is_the_reduce_path_bit_for_bit(stage: str) -> None:
    parties, steps = 3, 3
    reduced, gathered = _server(stage, parties), _server(stage, parties)
    rounds = len(_releases(reduced, parties))
    releases = _releases(reduced, parties, steps)
    selector = Selector(_fed(), parties, Keystream.from_labels("test", 0))
    for step in range(1, steps + 1):  # three steps: the optimizers' state matters too
        mine = releases[(step - 1) * rounds:step * rounds]
        stats = _iteration(reduced, mine, step)
        out = _iteration(gathered, mine, step, selector)
        assert out.chosen.all()
        np.testing.assert_allclose(out.train, stats.train, rtol=1e-6)
    assert _same_state(reduced, gathered)
    assert not _same_state(reduced, _server(stage, parties))  # the steps moved W


@pytest.mark.parametrize("stage", STAGES)
def test_only_the_selected_releases_update_the_weights(stage: str) -> None:
    parties, select = 4, 2
    selecting, reference = _server(stage, select), _server(stage, select)
    releases = _releases(selecting, parties)
    selector = Selector(_fed("random", select), parties, Keystream.from_labels("test", 5))
    out = _iteration(selecting, releases, 1, selector)
    assert out.chosen.sum() == select and np.isnan(out.score).all()
    # The same step as a Reduce over the chosen parties only, averaged over K′.
    _iteration(reference, [r[out.chosen] for r in releases], 1)
    assert _same_state(selecting, reference)
    np.testing.assert_allclose(out.train, releases[0][:, -STATS:].sum(0), rtol=1e-6)  # statistics of every party


@pytest.mark.parametrize("stage", STAGES)
def test_secprobe_scores_are_each_release_probed_on_the_aux_set(stage: str) -> None:
    parties = 3
    server = _server(stage, 2)
    releases = _releases(server, parties)
    releases[0][1, :-STATS] *= 40  # a release that wrecks the weights
    cfg = load_config(overrides=[*TINY, "mode=dpfnas", "federation.selection=secprobe", "federation.select=2",
                                 "federation.aux_size=64"])
    x_aux, y_aux = open_aux_set(cfg, open_split(cfg, "train"))
    server.begin_step(1)
    before = server.w.data.clone()
    expected = [server.probe_accuracy(w[:-STATS], x_aux, y_aux) for w in releases[0]]
    assert torch.equal(server.w.data, before)  # probing leaves W alone
    assert expected[1] != expected[0] or expected[1] != expected[2]  # the scores tell the releases apart
    selector = Selector(cfg.federation, parties, Keystream.from_labels("test", 0))
    out = _iteration(server, releases, 1, selector, (x_aux, y_aux))
    np.testing.assert_array_equal(out.score, expected)
    assert selector.epsilon_spent() == pytest.approx(cfg.federation.selection_epsilon)


@pytest.mark.parametrize("stage", STAGES)
def test_probe_accuracy_is_that_of_w_minus_the_scheduled_lr_times_g_with_the_current_a(stage: str) -> None:
    """Checked against a model of its own: W − lr·g at the step's scheduled rate and (the search) the server's
    current A, moved by a step first."""
    server = _server(stage, 1, "search.w_lr=5", "search.w_grad_clip=0", "search.a_lr=5", "augment.grad_clip=0")
    reference = _server(stage, 1)  # its own copy of the network: W − lr·g set by hand
    if server.a is not None:
        server.step_a(np.random.default_rng(2).normal(0, 1, server.a.numel()).astype(np.float32))
        reference.a.data.copy_(server.a.data)
    x, y = open_dataset("synthetic-shapes", "aux", root=".", image_size=8, size=200, seed=0).render(np.arange(200))
    before = server.w.data.clone()
    probes, rates = [], set()
    for step, seed in ((1, 0), (7, 1), (7, 2)):
        server.begin_step(step)
        rates.add(server.lr)
        g = np.random.default_rng(seed).normal(0, 0.2 if stage == "search" else 3,
                                               server.w.numel()).astype(np.float32)
        reference.w.data.copy_(torch.from_numpy(before.numpy() - server.lr * g))
        stats = reference.evaluate(x, y)
        probes.append(server.probe_accuracy(g, x, y))
        assert probes[-1] == pytest.approx(float(stats[1] / stats[2]), abs=1e-12)
    assert torch.equal(server.w.data, before)
    assert len(set(probes)) > 1  # the releases move the accuracy: the check above can tell probes apart
    assert len(rates) == (1 if stage == "search" else 2)  # the search's rate is per epoch, the augment's per step


def test_the_score_is_the_mean_over_the_window() -> None:
    fed = load_config(overrides=[*TINY, "mode=dpfnas", "federation.selection=secprobe", "federation.select=1",
                                 "federation.aux_size=10", "federation.score_window=2"]).federation
    selector = Selector(fed, 3, Keystream.from_labels("test", 0))
    _, first = selector.choose(lambda: np.array([0.1, 0.2, 0.3]))
    _, second = selector.choose(lambda: np.array([0.3, 0.2, 0.1]))
    _, third = selector.choose(lambda: np.array([0.5, 0.5, 0.5]))
    np.testing.assert_allclose(first, [0.1, 0.2, 0.3])
    np.testing.assert_allclose(second, [0.2, 0.2, 0.2])
    np.testing.assert_allclose(third, [0.4, 0.35, 0.3])  # the oldest step has left the window


def test_selection_state_survives_a_checkpoint_exactly(tmp_path: Path) -> None:
    fed = load_config(overrides=[*TINY, "mode=dpfnas", "federation.selection=secprobe", "federation.select=2",
                                 "federation.aux_size=10", "federation.score_window=3"]).federation
    scores = np.random.default_rng(0).uniform(0, 1, (12, 5))
    straight = Selector(fed, 5, Keystream.from_labels("test", 123))
    expected = [straight.choose(lambda s=s: s) for s in scores]
    first = Selector(fed, 5, Keystream.from_labels("test", 123))
    for s in scores[:5]:
        first.choose(lambda s=s: s)
    atomic_save(tmp_path / "checkpoint.pt", {"selection": first.state_dict()})
    resumed = Selector(fed, 5, Keystream.from_labels("test", 999))  # a fresh stream: the checkpoint's state wins
    resumed.load_state_dict(load_checkpoint(tmp_path)["selection"])
    for (chosen, score), s in zip(expected[5:], scores[5:], strict=True):
        got_chosen, got_score = resumed.choose(lambda s=s: s)
        assert np.array_equal(got_chosen, chosen) and np.array_equal(got_score, score)
    assert resumed.epsilon_spent() == straight.epsilon_spent()


# -- bad configuration: one line, exit code 2 (ConfigError) ---------------------------------------------------------
@pytest.mark.parametrize(("overrides", "match"), [
    (["federation.selection=random"], "federation.select"),
    (["federation.select=2"], "federation.select: only used"),
    (["federation.selection=secprobe", "federation.select=2"], "federation.aux_size"),
    (["mode=fnas", "federation.selection=random", "federation.select=2"], "mode dpfnas"),
    (["federation.selection=random", "federation.select=2", "augment.epochs=2", "augment.private=false"],
     "needs augment.private"),
    (["federation.selection=oracle", "augment.epochs=2", "augment.optimizer=adadp", "augment.momentum=0"], "ADADP"),
    (["federation.selection=random", "federation.select=2", "search.w_optimizer=adadp",
      "search.w_momentum=0"], "ADADP"),
    (["federation.corruption=1.5"], "federation.corruption"),
    (["federation.selection_epsilon=0"], "federation.selection_epsilon"),
    (["federation.aux_size=100000"], "federation.aux_size"),
])
def test_bad_selection_config_is_one_clear_line(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load_config(overrides=[*TINY, "mode=dpfnas", *overrides])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("overrides", "match"), [
    (["federation.selection=random", "federation.select=4"], "federation.select: 4 exceeds the 3 parties"),
    (["federation.unreliable_parties=4"], "federation.unreliable_parties: 4 exceeds"),
    (["federation.unreliable_parties=3", "federation.selection=oracle"], "all 3 are unreliable"),
])
def test_selection_larger_than_the_world_is_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_world(load_config(overrides=[*TINY, "mode=dpfnas", *overrides]), 4)
