"""DP-FNAS on the DPNAS space end to end: a real MPI job (2 parties) searches the 15-edge cell under DP and
trains the cell it found from scratch under DP; its log holds one alpha matrix, parseable DPNAS genotypes and an ε
that dp_accounting, called directly on the log's public facts, reproduces for both stages."""

from __future__ import annotations

import functools

import dp_accounting
import numpy as np
import pytest
from conftest import TINY, warm_job
from test_secure_aggregation import reproduced_epsilons

from mpi_fnas.federation.party_disk import PartyStore, party_dir
from mpi_fnas.privacy.shard_ledger import DEFAULT_VALUE_DISCRETIZATION
from mpi_fnas.report.collect import read_record
from mpi_fnas.report.figures import run_figures
from mpi_fnas.runlog import read_run
from mpi_fnas.space.dpnas import PRIMITIVES, DpnasGenotype, DpnasNetwork

pytestmark = pytest.mark.slow  # a real MPI job

STAGES = [4, 4, 8]
DPNAS_RUN = [
    *TINY, "--set", "space.kind=dpnas", "--set", "space.ops=[]", "--set", "space.nodes=5",
    "--set", f"space.stage_channels={STAGES}",
    "--set", "mode=dpfnas", "--set", "data.train_size=800", "--set", "augment.epochs=1",
    "--set", "augment.steps_per_epoch=4", "--set", "augment.batch_size=16",
]


def pld_epsilon(segments: list[tuple[float, float, int]], delta: float) -> float:
    """dp_accounting's PLD accountant over (σ, q, releases) segments composed in order."""
    return _pld_epsilon(tuple(segments), delta)


@functools.lru_cache(maxsize=16)
def _pld_epsilon(segments: tuple[tuple[float, float, int], ...], delta: float) -> float:
    # Cached: parties with equal shards ask for the same composition (seconds each).
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION)
    for sigma, rate, count in segments:
        if count:
            accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


def test_dpfnas_searches_and_trains_a_dpnas_cell_with_its_epsilon_reproduced(tmp_path):
    out = warm_job(3, *DPNAS_RUN, "--out", str(tmp_path / "run"), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = read_run(tmp_path / "run" / "search.h5")
    assert log["status"] == "finished" and log["space"] == "dpnas" and log["privacy_guarantee"] == "holds"

    # one 15 × 10 alpha per epoch end, an edgeless reduce, and the derived cell's string each epoch
    epochs = len(log["genotypes"])
    assert epochs == 2 and log["alphas"]["normal"].shape == (2, 15, 10) and log["alphas"]["reduce"].shape == (2, 0, 10)
    assert np.allclose(log["alphas"]["normal"].sum(axis=2), 1.0) and log["alpha_ops"] == list(PRIMITIVES)
    final = DpnasGenotype.from_string(log["final_genotype"])
    assert final == DpnasGenotype.from_string(log["genotypes"][-1])
    # the search's argmax is the logged genotype (none included)
    argmax = log["alphas"]["normal"][-1].argmax(axis=1)
    assert final.ops == tuple(PRIMITIVES[k] for k in argmax)

    # the augmentation trained exactly that cell, privately, at the searched widths
    augment = log["augment"]
    assert augment["status"] == "finished" and augment["private"] and augment["genotype"] == final.to_string()
    assert augment["params"] == DpnasNetwork(final, STAGES, num_classes=10).num_params()
    assert np.isnan(augment["metrics"]["train_loss"]).all()  # nothing data-dependent released

    # ε per party, independently: the search's W releases on the train shard and A releases on the validation
    # shard, then the augmentation's releases on both (pool: all), composed per shard; a party's ε is the larger
    search, aug = log["privacy"], augment["privacy"]
    sigma_w = float(np.asarray(search["noise_multiplier_w"]).reshape(-1)[0])
    sigma_a = float(np.asarray(search["noise_multiplier_a"]).reshape(-1)[0])
    sigma_aug = float(np.asarray(aug["noise_multiplier"]).reshape(-1)[0])
    aug_steps = int(aug["steps"][-1])
    assert aug_steps == 4
    for k in range(log["parties"]):
        steps = int(search["charged_steps"][-1][k])
        assert steps == 8  # 2 epochs × 4 steps, no replay
        delta = float(search["delta"][k])
        q_tr, q_val, q_aug = (float(search["sample_rate_train"][k]), float(search["sample_rate_val"][k]),
                              float(aug["sample_rate"][k]))
        search_eps = max(pld_epsilon([(sigma_w, q_tr, steps)], delta), pld_epsilon([(sigma_a, q_val, steps)], delta))
        assert search["epsilon"][-1][k] == pytest.approx(search_eps, rel=1e-6)
        both = max(pld_epsilon([(sigma_w, q_tr, steps), (sigma_aug, q_aug, aug_steps)], delta),
                   pld_epsilon([(sigma_a, q_val, steps), (sigma_aug, q_aug, aug_steps)], delta))
        assert aug["epsilon"][-1][k] == pytest.approx(both, rel=1e-6)
        assert aug["epsilon"][-1][k] > search["epsilon"][-1][k]

    # the report draws this run's cell and its single alpha heatmap
    record = read_record(tmp_path / "run" / "search.h5", tmp_path)
    figures = run_figures(record)
    assert {name.rsplit("-", 1)[-1] for name in figures} >= {"alphas.png", "cells.png", "epochs.png", "epsilon.png"}


def test_a_search_that_chooses_the_stem_and_the_head_trains_what_it_chose(tmp_path):
    """``space.stem: search``, ``space.head: search`` under GDAS and secure aggregation: the job searches the cell
    and both choices (their β released with the alpha, in one release), logs a genotype that names them, and the
    augmentation trains that network: the one the genotype builds, scattering stem and all."""
    from mpi_fnas.config import load_config
    from mpi_fnas.space import augment_network

    args = [*TINY, "--set", "data.image_size=16", "--set", "space.kind=dpnas", "--set", "space.ops=[]",
            "--set", "space.stage_channels=[4,8]", "--set", "space.stem=search", "--set", "space.head=search",
            "--set", "search.method=gdas", "--set", "mode=dpfnas", "--set", "privacy.aggregation=secure",
            "--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=2", "--set", "augment.batch_size=16"]
    done = warm_job(3, *args, "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    log = read_run(tmp_path / "run" / "search.h5")
    genotype = DpnasGenotype.from_string(log["final_genotype"])
    assert genotype.stem in ("conv", "scattering") and genotype.head in ("pool", "dpnas")
    assert log["augment"]["status"] == "finished" and log["augment"]["genotype"] == log["final_genotype"]
    cfg = load_config(None, args[1::2])
    assert log["augment"]["params"] == augment_network(cfg, genotype, seed=0, in_channels=3,
                                                       num_classes=10).num_params()
    # β travels in the A release, charged once a step like the alpha alone, by rank 0 and by each party's own
    # record: every party's search ε is the secure composition of one W and one A release a step, reproduced from
    # the log's public facts.
    search = log["privacy"]
    assert search["charged_steps"][-1].tolist() == [cfg.search.epochs * cfg.search.steps_per_epoch] * 2
    for k in range(2):
        for name, expected in reproduced_epsilons(search, k, 2).items():
            assert search[name][-1, k] == pytest.approx(expected, rel=1e-9), (k, name)
        [own] = [s for s in PartyStore(party_dir(tmp_path / "run", k + 1)).release_record() if s["stage"] == "search"]
        assert own["val"] == [search["noise_multiplier_a"], search["sample_rate_val"][k], 1]
