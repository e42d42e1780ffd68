"""The random-architecture baseline (issue 24, part 2): the random draw, the arms' configs, the comparison, and one
real baseline end to end (2 parties, 1 seed, 2 random cells) with its report.

What is checked: random cells are uniform over the space (χ² on ops and input pairs; DPNAS cells always trainable)
and reproducible from the public seed; a random arm under DP is calibrated to its searched arm's ε (equal within
1 %, measured on a real run); RI, the rank and the standard error against hand computations; the report's section;
a finished arm is read back, not rerun.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
from conftest import TINY, mpirun
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
    random_genotype_text,
    read_csv,
    write_csv,
)
from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.space import search_space
from mpi_fnas.space.dpnas import DpnasGenotype, num_edges
from mpi_fnas.space.genotype import Genotype

ALPHA = 1e-4


def test_darts_random_cells_are_uniform_over_the_derivable_genotypes():
    cfg = load_config(None, ["space.nodes=3"])
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
    cfg = load_config(None, ["space.kind=dpnas", "space.nodes=3"])
    space = search_space("dpnas")
    rng = np.random.default_rng(1)
    ops = Counter()
    for _ in range(2000):
        genotype = space.random_genotype(cfg.space, rng)
        assert isinstance(genotype, DpnasGenotype) and len(genotype.ops) == num_edges(3) and genotype.connected
        ops.update(genotype.ops[1:])  # the first edge is biased towards an op by the connectivity condition
    assert len(ops) == 10 and stats.chisquare(list(ops.values())).pvalue > ALPHA


def test_the_draw_is_public_reproducible_and_differs_per_seed_and_index():
    cfg = load_config(None, [])
    cells = {(s, i): random_genotype_text(cfg, s, i) for s in range(3) for i in range(4)}
    assert random_genotype_text(cfg, 1, 2) == cells[(1, 2)]
    assert len(set(cells.values())) == len(cells)
    Genotype.from_string(cells[(0, 0)])  # a valid genotype string of the space


def test_arms_and_their_configs():
    base = load_config(None, ["privacy.max_epsilon=9"])
    order = arms([3, 5], 2)
    assert [(a.seed, a.name) for a in order] == [(3, "searched"), (3, "random-0"), (3, "random-1"),
                                                  (5, "searched"), (5, "random-0"), (5, "random-1")]
    searched = arm_config(base, order[0], None)
    assert searched.seed == 3 and searched.augment.genotype is None and searched.privacy.max_epsilon == 9
    random = arm_config(base, order[2], 2.5)
    assert random.seed == 3 and random.augment.genotype == random_genotype_text(base, 3, 1)
    assert random.privacy.target_epsilon == 2.5 and random.privacy.max_epsilon is None
    fnas = arm_config(load_config(None, ["mode=fnas"]), order[1], None)  # no DP: nothing to calibrate
    assert fnas.privacy.target_epsilon is None
    with pytest.raises(ConfigError, match="no ε to calibrate"):
        arm_config(base, order[1], None)
    for overrides, match in ((["augment.epochs=0"], "augment.epochs"),
                             (["augment.genotype=" + random_genotype_text(base, 0, 0)], "augment.genotype"),
                             (["augment.private=false"], "augment.private")):
        with pytest.raises(ConfigError, match=match):
            check_base(load_config(None, overrides))


def _row(arm: str, seed: int, acc: float, eps: float = 2.0) -> ArmResult:
    return ArmResult(arm=arm, seed=seed, genotype="g", params=100, test_acc=acc, epsilon_worst=eps,
                     epsilon_searched=2.0, augment_noise_multiplier=0.8, status="finished", wall_seconds=1.0)


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
             "--set", "augment.layers=2", "--set", "augment.channels=4", "--set", "augment.batch_size=8"]
    first = mpirun(3, *small, "--random", "2", "--seeds", "0", "--out", str(out), module="mpi_fnas.baseline",
                   timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = read_csv(out / "baseline.csv")
    assert [r.arm for r in rows] == ["searched", "random-0", "random-1"] and all(r.status == "finished" for r in rows)
    searched, randoms = rows[0], rows[1:]
    assert math.isfinite(searched.epsilon_worst) and searched.epsilon_worst > 0
    for row in randoms:  # the same total ε: the whole budget of the searched arm went to the augmentation
        assert abs(row.epsilon_worst / searched.epsilon_worst - 1) <= EPSILON_TOLERANCE, row
        assert row.epsilon_searched == searched.epsilon_worst and row.genotype == random_genotype_text(
            load_config(None, []), 0, int(row.arm.split("-")[1]))
        assert row.augment_noise_multiplier < searched.augment_noise_multiplier  # more budget: less noise
    assert "RI = " in first.stdout
    again = mpirun(3, *small, "--random", "2", "--seeds", "0", "--out", str(out), module="mpi_fnas.baseline",
                   timeout=600)
    assert again.returncode == 0 and again.stdout.count("finished earlier: read back") == 3, again.stdout
    report = mpirun(1, str(out), "--out", str(tmp_path / "report"), module="mpi_fnas.report")
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report" / "report.md").read_text()
    assert "Random-architecture baseline" in page and "RI = " in page
    assert (tmp_path / "report" / "baseline_table.csv").read_text().count("\n") == 1 + 4  # searched, pooled, 2 cells
    assert "dpfnas" not in (tmp_path / "report" / "table1.csv").read_text()  # baseline runs are not Table 1


def test_an_arm_is_named_and_placed_by_seed(tmp_path):
    arm = Arm("random-7", 4)
    assert arm.index == 7 and not arm.searched and arm.run_dir(tmp_path) == tmp_path / "seed4" / "random-7"
