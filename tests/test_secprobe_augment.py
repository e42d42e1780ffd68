"""SecProbe in the augmentation, in process: the parties' corrupted pools, a real selecting run against
pure-noise parties, the selection ε over both stages, the log and the report figure. The Gather path of both stages
is tests/test_secprobe.py's.

The run is driven here without MPI: :class:`PartiesChannel` plays rank 0's side of the exchanges by asking real
augmentation parties (:func:`~mpi_fnas.federation.local_model.augment_party`) for their releases and loading the
broadcast W into them, so the server half (:func:`~mpi_fnas.federation.algorithm.server_iteration`), the probe on
the aux set and the exponential mechanism all run as in a job. The parties compute exact gradients (mode fnas): DP
noise is not what the test is about, and it keeps the run at seconds. One real mpirun job of both stages is
tests/test_secprobe_run.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pre_recipe import PRE_RECIPE

from mpi_fnas.config import load_config
from mpi_fnas.federation.algorithm import ServerBuffers, server_iteration
from mpi_fnas.federation.aux_set import open_aux_set
from mpi_fnas.federation.global_model import Server, augment_server
from mpi_fnas.federation.job_plan import open_split, parse_genotype, plan_assignments, plan_augment_stage
from mpi_fnas.federation.local_model import Party, augment_party
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.selection import Selector
from mpi_fnas.federation.shard import Shard
from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.release import Release
from mpi_fnas.report.figures import selection_rate
from mpi_fnas.runlog import SEARCH_METRICS, RunLog, SelectionSchema, StagePrivacy, read_run
from mpi_fnas.space import DARTS_V2, search_space
from mpi_fnas.stages.augment import own_pool
from mpi_fnas.stages.search import own_shard

# A small DARTS network with BatchNorm on 8×8 images: exact gradients take it off chance within a few dozen steps.
NETWORK = ["data.image_size=8", "data.train_size=800", "data.test_size=40", "space.norm=batchnorm",
           "augment.layers=2", "augment.channels=8", "augment.auxiliary_weight=0", "augment.drop_path=0",
           "augment.cutout=0", "augment.crop_padding=0", "augment.batch_size=64", "augment.lr=0.3",
           "augment.epochs=1", f"augment.genotype={DARTS_V2.to_string()}"]
PARTIES = 4
RELEASE = Release(noise_multiplier=1.0, clip=1.0, expected_batch_size=8.0)
TRAIN, BATCH = 400, 100  # full-pool batches: the clean releases are exact gradients


def _config(*extra: str, mode: str = "fnas", steps: int = 30):
    """The test network's config; under dpfnas (used only for its ``federation`` section: the selection needs it)
    with GroupNorm, as DP requires."""
    network = [o for o in NETWORK if mode != "dpfnas" or o != "space.norm=batchnorm"]
    return load_config(overrides=[*PRE_RECIPE, *network, f"augment.steps_per_epoch={steps}", f"mode={mode}",
                                  "privacy.aggregation=local", *extra])  # a selection needs each party's release


class PartiesChannel:
    """Rank 0's side of the augmentation's exchanges with the parties' halves run in process: a Gather (or Reduce)
    takes each party's next release, in rank order; a Bcast loads the broadcast W into every party."""

    def __init__(self, parties: list[Party]) -> None:
        self.members = parties
        self.parties = len(parties)

    def gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        for row, party in enumerate(self.members):
            recv[row] = party.w_release()

    def reduce_sum(self, send: np.ndarray, recv: np.ndarray) -> None:
        np.copyto(recv, send)
        for party in self.members:
            np.add(recv, party.w_release(), out=recv)

    def bcast(self, buf: np.ndarray) -> None:
        for party in self.members:
            party.load_w(buf[:-1])


def _parties(cfg) -> tuple[list[Party], np.ndarray, object]:
    """The K parties as the job builds them (the augment plan from the search's partition; each party's pool
    with its own corruption), their unreliable flags, and the genotype."""
    search = plan_assignments(cfg, PARTIES)
    genotype = parse_genotype(cfg.augment.genotype, "augment.genotype", cfg.space)
    plan = plan_augment_stage(cfg, search, genotype, None, None)
    data = open_split(cfg, "train")
    space = search_space(cfg.space.kind)
    parties = []
    for rank, got in enumerate(plan.assignments, start=1):
        x, y = own_pool(cfg, data, got, rank)
        model = space.build_augment_network(genotype, cfg, seed=cfg.seed, in_channels=3, num_classes=10)
        model.drop_path_prob = 0.0
        parties.append(augment_party(model, Shard(x, y), cfg.augment,
                                     PartyRandomness.create("reproducible", seed=0, rank=rank, stage="augment")))
    return parties, np.array([a.unreliable for a in search]), genotype


def _server(cfg, genotype, parties: int, steps: int) -> Server:
    model = search_space(cfg.space.kind).build_augment_network(genotype, cfg, seed=cfg.seed, in_channels=3,
                                                                num_classes=10)
    return augment_server(model, cfg.augment, parties, steps)


# -- the parties' pools ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["all", "train"])
def test_the_augment_pool_is_the_search_shards_corrupted_the_same_way(pool: str) -> None:
    cfg = _config("federation.unreliable_parties=2", "federation.corruption=0.5", f"augment.pool={pool}")
    search = plan_assignments(cfg, PARTIES)
    genotype = parse_genotype(cfg.augment.genotype, "augment.genotype", cfg.space)
    plan = plan_augment_stage(cfg, search, genotype, None, None)
    data = open_split(cfg, "train")
    for rank, (shards, got) in enumerate(zip(search, plan.assignments, strict=True), start=1):
        x, y = own_pool(cfg, data, got, rank)
        parts = [own_shard(cfg, data, shards, rank, "train")] + ([own_shard(cfg, data, shards, rank, "val")]
                                                                 if pool == "all" else [])
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
        clean, _ = data.render(got.pool_indices)
        replaced = int((x != clean).flatten(1).any(1).sum())  # found from the pixels
        expected = round(0.5 * len(shards.train_indices)) + (round(0.5 * len(shards.val_indices)) if pool == "all"
                                                              else 0)
        assert replaced == (expected if shards.unreliable else 0)


# -- a real selecting run --------------------------------------------------------------------------------------------
def test_secprobe_at_a_high_epsilon_selects_pure_noise_parties_less_often_in_the_augmentation() -> None:
    """4 parties, one holding only noise images with random labels; secprobe draws K′ = 2 at ε_EM = 10 per step
    (Δu = 1/200: the draw nearly follows the scores). The uniform rate is K′/K = 0.5 for everyone."""
    steps = 30
    common = ["federation.unreliable_parties=1", "federation.corruption=1", f"augment.batch_size={BATCH}",
              f"data.train_size={TRAIN}"]
    cfg = _config(*common, steps=steps)
    fed = _config(*common, "federation.aux_size=200", "federation.selection=secprobe", "federation.select=2",
                  "federation.selection_epsilon=10", "federation.score_window=10", mode="dpfnas").federation
    parties, unreliable, genotype = _parties(cfg)
    assert unreliable.sum() == 1
    noisy = unreliable.nonzero()[0][0]
    assert len(torch.unique(parties[noisy].train.x.flatten(1), dim=0)) == len(parties[noisy].train)  # no shape left
    selector = Selector(fed, PARTIES, Keystream.from_labels("test", 0), unreliable)
    server = _server(cfg, genotype, selector.select, steps)
    channel = PartiesChannel(parties)
    channel.bcast(np.append(server.w_buffer, 0))
    x_aux, y_aux = open_aux_set(_config("federation.aux_size=200"), open_split(cfg, "train"))
    buffers = ServerBuffers(server.w.numel(), None, gathered_parties=PARTIES)
    chosen = []
    for step in range(1, steps + 1):
        server.begin_step(step)
        chosen.append(server_iteration(server, channel, buffers, selector=selector, aux=(x_aux, y_aux)).chosen)
    chosen = np.array(chosen)
    assert (chosen.sum(axis=1) == 2).all() and selector.draws == steps
    rate = chosen.mean(axis=0)
    # Less often than the reliable parties (their mean rate), and well below the uniform K′/K = 0.5. Over 8 seeds
    # of the server's generator the noise party's rate was 0.2-0.3 at most; the reliable parties' spread widely
    # (one of them chosen at every step), so a single reliable party can fall below it (2 of the 8).
    assert rate[unreliable].max() <= 0.35, rate
    assert rate[unreliable].max() < rate[~unreliable].mean(), rate


# -- the selection ε over both stages --------------------------------------------------------------------------------
def test_selection_epsilon_composes_the_draws_of_both_stages() -> None:
    """Reproduced here from the definitions: T draws of K′ peels at ε_EM/K′ each, over the search's T1 and the
    augmentation's T2 draws: min(basic T·ε_EM, zCDP ρ = Σ (ε_EM/K′)²/8 → ρ + 2√(ρ ln 1/δ))."""
    def fed(epsilon: float = 0.3, select: int = 2):
        return _config("federation.selection=secprobe", f"federation.select={select}", "federation.aux_size=50",
                       f"federation.selection_epsilon={epsilon}", mode="dpfnas").federation

    scores = np.random.default_rng(0).uniform(0, 1, (300, PARTIES))
    search = Selector(fed(), PARTIES, Keystream.from_labels("test", 1))
    for s in scores[:120]:
        search.choose(lambda s=s: s)
    augment = Selector(fed(), PARTIES, Keystream.from_labels("test", 2))
    augment.continue_after(search.summary())
    for s in scores[120:]:
        augment.choose(lambda s=s: s)
    peels = [(0.3 / 2) for _ in range(300 * 2)]
    rho = sum(e**2 / 8 for e in peels)
    delta = min(1e-5, 1 / (10 * 50))
    expected = min(300 * 0.3, rho + 2 * math.sqrt(rho * math.log(1 / delta)))
    assert augment.epsilon_spent() == pytest.approx(expected, rel=1e-12)
    assert augment.epsilon_spent() > search.epsilon_spent() > 0
    fresh = Selector(fed(), PARTIES, Keystream.from_labels("test", 2))
    fresh.continue_after(None)  # no search (augment.genotype): the augmentation's draws alone
    assert fresh.draws == 0
    with pytest.raises(ValueError, match="must draw at the same"):
        Selector(fed(epsilon=1.0), PARTIES, Keystream.from_labels("test", 3)).continue_after(search.summary())


# -- the log and the report ------------------------------------------------------------------------------------------
def test_augment_selection_rows_are_logged_truncated_and_drawn(tmp_path: Path) -> None:
    path = tmp_path / "search.h5"
    schema = SelectionSchema(selection="secprobe", select=2, epsilon_per_step=1.0, score_window=1, aux_size=10,
                             sensitivity=0.1, delta=1e-5)
    log = RunLog.create(
        path, mode="dpfnas", parties=PARTIES, config_text="x: 1\n", metric_names=SEARCH_METRICS,
        alpha_shape=(14, 8), genotype_length=64, privacy_guarantee="holds", rank_attrs={"devices": ["cpu"] * 5},
        privacy=StagePrivacy(delta=[1e-5] * PARTIES, releases={"W": RELEASE, "A": RELEASE},
                             sample_rates={"W": [0.1] * PARTIES, "A": [0.1] * PARTIES}, accountant="pld"),
        unreliable=[True, False, False, False], corruption=1.0, selection=schema,
    )  # fmt: skip
    log.search.append_selection(1, [False, True, True, False], np.full(PARTIES, 0.2), 0.5)
    log.search.finish("finished", reason="completed", cost={"wall_seconds": 1.0, "ranks": 5})
    log.begin_augment(genotype="g", params=10, private=True, parties=PARTIES, privacy_guarantee="holds",
                      privacy=StagePrivacy(delta=[1e-5] * PARTIES, releases={"W": RELEASE},
                                           sample_rates={"W": [0.1] * PARTIES}), selection=schema)
    for step in (1, 2, 3):
        log.augment.append_selection(step, [False, True, step == 3, step != 3], np.full(PARTIES, 0.1 * step),
                                     0.5 + step)
    metric_rows, privacy_rows, selection_rows = log.augment.row_counts()
    assert selection_rows == 3
    log.augment.truncate(metric_rows, privacy_rows, 2)
    log.augment.finish("finished", reason="completed", cost={"wall_seconds": 1.0, "ranks": 5})
    log.close()
    run = read_run(path)
    selection = run["augment"]["selection"]
    assert list(selection["steps"]) == [1, 2] and list(selection["selection_epsilon"]) == [1.5, 2.5]
    assert selection["chosen"].tolist() == [[False, True, False, True]] * 2 and selection["select"] == 2
    assert run["selection"]["chosen"].shape == (1, PARTIES)  # the search's rows apart
    assert selection_rate(run, "run") is not None
    run["selection"] = None
    assert selection_rate(run, "run") is not None  # the augmentation alone
    run["augment"]["selection"] = None
    assert selection_rate(run, "run") is None
