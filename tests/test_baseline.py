"""The random-architecture baseline: the random draw, the arms' configs, the comparison, and one
real baseline end to end (2 parties, 1 seed, 2 random cells) with its report.

What is checked: random cells are uniform over the space (χ² on ops and input pairs; DPNAS cells always trainable)
and reproducible from the public seed; a random arm under DP is calibrated to its searched arm's ε (equal within
1 %, measured on a real run); RI, the rank and the standard error against hand computations; the report's section;
a finished arm is read back, not rerun.
"""

from __future__ import annotations

import csv
import itertools
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from conftest import TINY, warm_job, warm_jobs
from pre_recipe import PRE_RECIPE
from scipy import stats

from mpi_fnas.baseline import (
    EPSILON_TOLERANCE,
    SEARCHED,
    Arm,
    ArmResult,
    arm_config,
    arms,
    check_base,
    compare,
    format_comparison,
    parse_handcrafted,
    random_genotype_text,
    read_csv,
    write_csv,
)
from mpi_fnas.baseline.arms import earlier_arms
from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.federation.party_disk import party_dir
from mpi_fnas.report.command import main as report_main
from mpi_fnas.space import search_space
from mpi_fnas.space.dpnas import DpnasGenotype, num_edges
from mpi_fnas.space.genotype import Genotype

ALPHA = 1e-4


def test_darts_random_cells_are_uniform_over_the_derivable_genotypes():
    cfg = load_config(None, [*PRE_RECIPE, "space.nodes=3"])
    space = search_space("darts")
    ops, pairs = Counter(), {node: Counter() for node in range(3)}
    rng = np.random.default_rng(0)
    for _ in range(3000):
        genotype = space.random_genotype(cfg.space, rng)
        assert genotype.normal_concat == (2, 3, 4) and genotype.reduce_concat == (2, 3, 4)
        for cell in (genotype.normal, genotype.reduce):
            for node in range(3):
                (op_a, a), (op_b, b) = cell[2 * node: 2 * node + 2]
                assert 0 <= a < b < node + 2  # two distinct inputs among the node's states, ascending
                pairs[node][(a, b)] += 1
                ops.update([op_a, op_b])
    assert "none" not in ops and len(ops) == 7
    assert stats.chisquare(list(ops.values())).pvalue > ALPHA
    for node, counts in pairs.items():
        expected = len(list(itertools.combinations(range(node + 2), 2)))
        assert len(counts) == expected
        if expected > 1:  # node 0 has one pair of inputs only
            assert stats.chisquare(list(counts.values())).pvalue > ALPHA


def test_dpnas_random_cells_are_uniform_and_always_trainable():
    cfg = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.nodes=3"])
    space = search_space("dpnas")
    rng = np.random.default_rng(1)
    ops = Counter()
    for _ in range(2000):
        genotype = space.random_genotype(cfg.space, rng)
        assert isinstance(genotype, DpnasGenotype) and len(genotype.ops) == num_edges(3) and genotype.connected
        ops.update(genotype.ops[1:])  # the first edge is biased towards an op by the connectivity condition
    assert len(ops) == 10 and stats.chisquare(list(ops.values())).pvalue > ALPHA


def test_a_random_cell_of_a_space_that_searches_its_stem_or_head_draws_them_too():
    """A searched choice (``space.head: search``) is drawn uniformly like an edge, so the random arm's network can be
    built; a fixed one is left to the space; and the cells are the ones a space without the choice draws."""
    fixed = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.nodes=2", "space.stem=scattering"])
    searched = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.nodes=2", "space.stem=scattering",
                                  "space.head=search"])
    space = search_space("dpnas")
    heads = Counter()
    for seed in range(400):
        plain = space.random_genotype(fixed.space, np.random.default_rng(seed))
        drawn = space.random_genotype(searched.space, np.random.default_rng(seed))
        assert drawn.ops == plain.ops and (plain.stem, plain.head) == (None, None) and drawn.stem is None
        heads[drawn.head] += 1
    assert set(heads) == {"pool", "dpnas"} and stats.chisquare(list(heads.values())).pvalue > ALPHA
    genotype = space.parse_genotype(random_genotype_text(searched, 0, 0), searched.space)
    cfg = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.nodes=2", "space.stem=scattering",
                             "space.head=search", "data.image_size=28", "space.stage_channels=[4,8]"])
    space.build_augment_network(genotype, cfg, seed=0, in_channels=1, num_classes=10)


def test_the_baselines_random_cells_leave_out_the_sigmoid_activation():
    """The control is the space without sigmoid (which rarely trains under DP: drawing it would measure the search
    avoiding it); every other candidate is still drawn."""
    cfg = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.nodes=3"])
    ops = Counter(op for index in range(300) for op in DpnasGenotype.from_string(
        random_genotype_text(cfg, 0, index)).ops)
    assert "conv_3x3_sigmoid" in search_space("dpnas").candidates(cfg.space)
    assert "conv_3x3_sigmoid" not in ops and len(ops) == 9


def test_the_draw_is_public_reproducible_and_differs_per_seed_and_index():
    cfg = load_config(None, [*PRE_RECIPE])
    cells = {(s, i): random_genotype_text(cfg, s, i) for s in range(3) for i in range(4)}
    assert random_genotype_text(cfg, 1, 2) == cells[(1, 2)]
    assert len(set(cells.values())) == len(cells)
    Genotype.from_string(cells[(0, 0)])  # a valid genotype string of the space


def test_arms_and_their_configs():
    base = load_config(None, [*PRE_RECIPE, "privacy.target_epsilon=2.5", "privacy.max_epsilon=9"])
    order = arms([3, 5], 2)
    assert [(a.seed, a.name) for a in order] == [(3, "searched"), (3, "random-0"), (3, "random-1"),
                                                  (5, "searched"), (5, "random-0"), (5, "random-1")]
    searched = arm_config(base, order[0])
    assert searched.seed == 3 and searched.augment.genotype is None and searched.privacy.max_epsilon == 9
    random = arm_config(base, order[2])
    assert random.seed == 3 and random.augment.genotype == random_genotype_text(base, 3, 1)
    # The user's own privacy settings, whatever the searched arm measured: every party derives them alike.
    assert random.privacy == searched.privacy == base.privacy

    for overrides, match in ((["augment.epochs=0"], "augment.epochs"),
                             (["augment.genotype=" + random_genotype_text(base, 0, 0)], "augment.genotype"),
                             (["augment.private=false"], "augment.private"),
                             (["privacy.target_epsilon=null"], "privacy.target_epsilon: the baseline compares")):
        with pytest.raises(ConfigError, match=match):
            check_base(load_config(None, overrides))
    check_base(load_config(None, [*PRE_RECIPE, "mode=fnas"]))  # no DP: no ε to compare at


def test_a_party_composes_every_other_arm_it_ran_whatever_the_order(tmp_path):
    """Its own directories of every other arm under the baseline directory (run before or after this one, by this
    invocation or an earlier one), each marked with whether it split the data alike (the same seed); never another
    rank's, never the arm's own."""
    for seed, name in ((0, "searched"), (0, "random-0"), (1, "searched"), (1, "cnn-gn")):
        for rank in (1, 2):
            party_dir(Arm(name, seed).run_dir(tmp_path), rank).mkdir(parents=True)
    found = earlier_arms(tmp_path, Arm("random-0", 0), 1)
    assert found == [(party_dir(Arm("searched", 0).run_dir(tmp_path), 1), True),
                     (party_dir(Arm("cnn-gn", 1).run_dir(tmp_path), 1), False),
                     (party_dir(Arm("searched", 1).run_dir(tmp_path), 1), False)]


def test_hand_designed_arms_and_their_configs():
    base = load_config(None, [*PRE_RECIPE, "privacy.max_epsilon=9", "augment.drop_path=0.2",
                              "augment.auxiliary_weight=0.4"])
    order = arms([3], 1, ["cnn-tanh", "cnn-gn"])
    assert [a.name for a in order] == ["searched", "random-0", "cnn-tanh", "cnn-gn"]
    assert [(a.handcrafted, a.network, a.index) for a in order] == [
        (False, "cell", -1), (False, "cell", 0), (True, "cnn-tanh", -1), (True, "cnn-gn", -1)]
    for arm in order[2:]:  # the same total ε as the searched arm: its whole budget goes to the augmentation
        cfg = arm_config(base, arm)
        assert (cfg.seed, cfg.augment.network, cfg.augment.genotype) == (3, arm.name, None)
        assert cfg.privacy == base.privacy
        assert cfg.augment.drop_path == 0 and cfg.augment.auxiliary_weight == 0  # no cell paths, no auxiliary head
    searched = arm_config(base, order[0])
    assert searched.augment.network == "cell" and searched.augment.drop_path == 0.2  # the configured job as it is
    assert parse_handcrafted("cnn-tanh, cnn-gn") == ["cnn-tanh", "cnn-gn"] and parse_handcrafted(None) == []
    for text, match in (("cnn-tanh,resnet", "unknown network 'resnet'"), ("cnn-gn,cnn-gn", "named twice"),
                        ("cell", "unknown network 'cell'")):
        with pytest.raises(ConfigError, match=match):
            parse_handcrafted(text)
    with pytest.raises(ConfigError, match="--handcrafted cnn-gn"):  # the searched arm needs a cell
        check_base(load_config(None, [*PRE_RECIPE, "augment.network=cnn-gn"]))


def _row(arm: str, seed: int, acc: float, eps: float = 2.0) -> ArmResult:
    return ArmResult(arm=arm, seed=seed, genotype="g", params=100, test_acc=acc, epsilon_worst=eps,
                     epsilon_searched=2.0, augment_noise_multiplier=0.8, status="finished", wall_seconds=1.0,
                     network=arm if arm.startswith("cnn-") else "cell")


def test_the_comparison_with_hand_designed_networks_against_hand_computations(tmp_path):
    rows = [_row(SEARCHED, 0, 0.80), _row("random-0", 0, 0.70), _row("cnn-tanh", 0, 0.60), _row("cnn-gn", 0, 0.75),
            _row(SEARCHED, 1, 0.50), _row("cnn-tanh", 1, 0.55, eps=2.01), _row("cnn-gn", 1, 0.40)]
    comparison = compare(rows)
    first, second = comparison.seeds  # seed 1 has no random arm: compared with the hand-designed ones only
    assert first.best_handcrafted == ("cnn-gn", 0.75) and second.best_handcrafted == ("cnn-tanh", 0.55)
    assert math.isclose(first.relative_improvement_handcrafted, 100 * (0.80 - 0.75) / 0.75)
    assert math.isclose(second.relative_improvement_handcrafted, 100 * (0.50 - 0.55) / 0.55)
    assert math.isnan(second.random_mean) and math.isnan(second.relative_improvement)
    ri, ri_std = comparison.relative_improvement_against("handcrafted")
    hand = [100 * 0.05 / 0.75, -100 * 0.05 / 0.55]
    assert math.isclose(ri, np.mean(hand)) and math.isclose(ri_std, np.std(hand, ddof=1))
    d, se = comparison.difference_against("handcrafted")
    assert math.isclose(d, 0.0, abs_tol=1e-12) and math.isclose(se, np.std([0.05, -0.05], ddof=1) / math.sqrt(2))
    assert comparison.beats("handcrafted") is False  # 0 is not above its standard error
    assert [s.seed for s in comparison.against("random")] == [0] and comparison.beats_random is None  # one seed
    assert math.isclose(comparison.relative_improvement[0], 100 * 0.10 / 0.70)
    assert math.isclose(second.epsilon_handcrafted_max_deviation, 0.005) and comparison.epsilon_agrees
    assert not compare([*rows, _row("cnn-gn", 0, 0.7, eps=2.1)]).epsilon_agrees  # a hand-designed arm 5 % off
    text = format_comparison(comparison)
    assert "best hand-designed" in text and "vs the best hand-designed network over 2 seed(s)" in text
    write_csv(tmp_path, rows)
    assert read_csv(tmp_path / "baseline.csv") == rows
    with open(tmp_path / "baseline.csv", newline="") as f:  # a CSV from before the network and colluders columns
        old = [{k: v for k, v in record.items() if k not in ("network", "colluders")} for record in csv.DictReader(f)]
    with open(tmp_path / "old.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old[0]))
        writer.writeheader()
        writer.writerows(old)
    assert {(r.network, r.colluders) for r in read_csv(tmp_path / "old.csv")} == {("cell", 0)}


def test_the_comparison_against_hand_computations(tmp_path):
    rows = [_row(SEARCHED, 0, 0.80), _row("random-0", 0, 0.70), _row("random-1", 0, 0.90), _row("random-2", 0, 0.50),
            _row(SEARCHED, 1, 0.75), _row("random-0", 1, 0.50), _row("random-1", 1, 0.70, eps=2.01),
            _row("random-2", 1, 0.60)]
    comparison = compare(rows)
    first, second = comparison.seeds
    assert first.rank == 2 and second.rank == 1  # one random cell beats the searched one in seed 0, none in 1
    assert math.isclose(first.relative_improvement, 100 * (0.80 - 0.70) / 0.70)
    assert math.isclose(second.relative_improvement, 100 * (0.75 - 0.60) / 0.60)
    ri, ri_std = comparison.relative_improvement
    assert math.isclose(ri, np.mean([100 / 7, 25])) and math.isclose(ri_std, np.std([100 / 7, 25], ddof=1))
    d, se = comparison.difference
    assert math.isclose(d, 0.125) and math.isclose(se, np.std([0.10, 0.15], ddof=1) / math.sqrt(2))
    assert comparison.beats_random  # 0.125 > 0.025
    assert math.isclose(second.epsilon_random_max_deviation, 0.005) and comparison.epsilon_agrees
    assert not compare([*rows, _row("random-3", 1, 0.6, eps=2.1)]).epsilon_agrees  # 5 % off
    assert compare(rows[:4]).beats_random is None  # one seed: no standard error
    unfinished = ArmResult(**{**rows[1].__dict__, "status": "failed"})
    assert compare([rows[0], unfinished]).seeds == ()
    write_csv(tmp_path, rows)
    assert read_csv(tmp_path / "baseline.csv") == rows


@pytest.mark.slow
def test_a_real_baseline_calibrates_equal_epsilon_reports_and_reuses_finished_arms(tmp_path):
    out = tmp_path / "baseline"
    small = [*TINY, "--set", "search.epochs=1", "--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=3",
             "--set", "augment.layers=2", "--set", "augment.channels=4", "--set", "augment.batch_size=8",
             "--set", "privacy.target_epsilon=8"]
    arguments = [*small, "--random", "2", "--handcrafted", "cnn-tanh,cnn-gn", "--seeds", "0"]
    first, unknown = warm_jobs((3, [*arguments, "--out", str(out)], None, "mpi_fnas.baseline"),
                               (3, [*small, "--random", "1", "--handcrafted", "cnn-relu", "--seeds", "0", "--out",
                                    str(tmp_path / "unknown")], None, "mpi_fnas.baseline"))
    assert unknown.returncode == 2 and "--handcrafted: unknown network 'cnn-relu'" in unknown.stderr, unknown.stderr
    assert first.returncode == 0, first.stderr[-3000:]
    rows = read_csv(out / "baseline.csv")
    assert [r.arm for r in rows] == ["searched", "random-0", "random-1", "cnn-tanh", "cnn-gn"]
    assert all(r.status == "finished" for r in rows)
    searched, randoms, handcrafted = rows[0], rows[1:3], rows[3:]
    assert math.isfinite(searched.epsilon_worst) and searched.epsilon_worst > 0
    for row in (*randoms, *handcrafted):  # the same total ε: the searched arm's whole budget went to the augmentation
        assert abs(row.epsilon_worst / searched.epsilon_worst - 1) <= EPSILON_TOLERANCE, row
        assert row.epsilon_searched == searched.epsilon_worst
        assert row.augment_noise_multiplier < searched.augment_noise_multiplier  # more budget: less noise
    for row in randoms:
        assert row.network == "cell" and row.genotype == random_genotype_text(load_config(None, small[1::2]), 0,
                                                                              int(row.arm.split("-")[1]))
    for row in handcrafted:
        assert (row.network, row.genotype) == (row.arm, "")
    assert [r.params for r in handcrafted] == [304_810, 24_346]  # TINY's 8x8 colour images
    assert "RI = " in first.stdout and "vs the best hand-designed network" in first.stdout
    again = warm_job(3, *arguments, "--out", str(out), module="mpi_fnas.baseline", timeout=600)
    assert again.returncode == 0 and again.stdout.count("finished earlier: read back") == 5, again.stdout
    assert report_main([str(out), "--out", str(tmp_path / "report")]) == 0  # in this process: torch is loaded
    page = (tmp_path / "report" / "report.md").read_text()
    assert "Random-architecture baseline" in page and "RI = " in page and "best hand-designed (acc)" in page
    # searched, pooled, 2 cells, 2 hand-designed networks
    assert (tmp_path / "report" / "baseline_table.csv").read_text().count("\n") == 1 + 6
    assert "dpfnas" not in (tmp_path / "report" / "table1.csv").read_text()  # baseline runs are not Table 1


#: A baseline whose rank 0 alone (MPICH's PMI_RANK, read before mpi4py loads) changes its arms as LYING_ARMS says; the
#: parties run the real code. ``clip``: every arm with a larger augment.clip than the command line says; ``target``:
#: every arm but the searched one calibrated to 100 times the user's privacy.target_epsilon.
LYING_ARMS_SERVER = """
import os, sys
from mpi_fnas.baseline import command
if os.environ.get("PMI_RANK") == "0":
    honest = command.arm_config
    def lying(base, arm, *args, **kwargs):
        cfg = honest(base, arm, *args, **kwargs)
        if os.environ["LYING_ARMS"] == "clip":
            cfg.augment.clip = 100.0
        elif not arm.searched:
            cfg.privacy.target_epsilon = 100 * base.privacy.target_epsilon
        return cfg
    command.arm_config = lying
sys.exit(command.main(sys.argv[1:]))
"""
#: Two tiny arms (the searched one, then a hand-designed network) at ε = 3 each.
TWO_ARMS = [*TINY, "--set", "augment.epochs=1", "--set", "augment.steps_per_epoch=2", "--set", "augment.batch_size=8",
            "--set", "search.epochs=1", "--set", "privacy.target_epsilon=3", "--random", "0", "--handcrafted", "cnn-gn",
            "--seeds", "0"]


@pytest.fixture(scope="module")
def lying_baselines(tmp_path_factory) -> dict[str, tuple]:
    """Side by side: a baseline whose rank 0 lies (``clip``, ``target``; see LYING_ARMS_SERVER), and an honest one
    whose parties cap their total at privacy.party_max_epsilon=3.2, below the two arms' composed ε: each result and
    its directory."""
    from conftest import MPIRUN, ROOT, _env

    root = tmp_path_factory.mktemp("arms")
    runs = {"clip": ["-c", LYING_ARMS_SERVER, *TWO_ARMS], "target": ["-c", LYING_ARMS_SERVER, *TWO_ARMS],
            "own_cap": ["-m", "mpi_fnas.baseline", *TWO_ARMS, "--set", "privacy.party_max_epsilon=3.2"]}
    procs = {name: subprocess.Popen([MPIRUN, "-n", "3", sys.executable, *args, "--out", str(root / name)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env=_env({"LYING_ARMS": name}))
             for name, args in runs.items()}
    done = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    return {name: (procs[name].returncode, *done[name], root / name) for name in runs}


def refused_by_both(stderr: str, error: str, line: str) -> bool:
    return all(f"[mpi_fnas rank {rank}] error: {error}: rank {rank} {line}" in stderr for rank in (1, 2))


@pytest.mark.slow
def test_a_party_derives_each_arm_itself_and_refuses_rank_0s_other_one(lying_baselines):
    code, _, stderr, out = lying_baselines["clip"]
    assert code != 0
    assert refused_by_both(stderr, "AssignmentRefusedError", "refuses the config rank 0 sent: augment.clip: 100.0 "
                           "where its own --config/--set says 1.0"), stderr
    assert not (out / "seed0" / "searched" / "search.h5").exists()  # refused before the first arm ran


@pytest.mark.slow
def test_a_party_calibrates_every_arm_to_its_own_target_whatever_rank_0_measured(lying_baselines):
    """A rank 0 that calibrates an arm to 100 times the user's target (before: the party took the arm's target from
    rank 0's config, ε 40.4 where the user said 3) is refused by every party before the arm's first release."""
    code, _, stderr, out = lying_baselines["target"]
    assert code != 0
    assert refused_by_both(stderr, "AssignmentRefusedError", "refuses the config rank 0 sent: "
                           "privacy.target_epsilon: 300.0 where its own --config/--set says 3.0"), stderr
    assert (out / "seed0" / "searched" / "search.h5").exists()  # the honest searched arm ran first
    assert not (out / "seed0" / "cnn-gn" / "parties").exists()


@pytest.mark.slow
def test_a_partys_own_cap_composes_every_arm_on_its_data(lying_baselines):
    """Each arm alone keeps ε = 3; composed, the two reach 3.4, past privacy.party_max_epsilon = 3.2: the parties
    refuse the second arm before its first release, naming the earlier arm (the first to tell rank 0 ends the job,
    so the other's line may not get printed)."""
    code, stdout, stderr, out = lying_baselines["own_cap"]
    assert code != 0
    assert "seed 0 searched: test acc" in stdout, stdout + stderr[-3000:]
    assert "error: BudgetRefusedError: rank 1 refuses the 2 augment iterations" in stderr or \
        "error: BudgetRefusedError: rank 2 refuses the 2 augment iterations" in stderr, stderr
    assert "its own cap privacy.party_max_epsilon 3.2 allows" in stderr, stderr
    assert "and 1 earlier run(s) on the same data" in stderr, stderr
    for rank in (1, 2):
        assert not (party_dir(out / "seed0" / "cnn-gn", rank) / "augment_sent_steps").exists()


def test_an_arm_is_named_and_placed_by_seed(tmp_path):
    arm = Arm("random-7", 4)
    assert arm.index == 7 and not arm.searched and arm.run_dir(tmp_path) == tmp_path / "seed4" / "random-7"
