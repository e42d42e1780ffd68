"""The memory plan rank 0 prints before a run (mpi_fnas.federation.memory): what one step of a network holds, how
the ranks add up per node, and the refusal of a node that cannot hold its ranks. The estimate's accuracy against
measured peaks is a benchmark matter (docs/benchmarks.md, "Memory per rank"), not asserted here."""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pre_recipe import PRE_RECIPE
from torch import nn

from mpi_fnas.config import SetupError, config_from_text
from mpi_fnas.federation.memory import (
    AUTO_PASS_MAX,
    AUTO_PASS_MIN,
    PASS_MEMORY_MB,
    NodeFacts,
    node_facts,
    pass_examples,
    plan_memory,
    return_free_memory,
    step_mb,
)


def test_a_step_holds_the_saved_inputs_and_one_gradient_per_example():
    # Linear(12 -> 5) saves its input (12 floats per example); 12·5 + 5 parameters give a 65-float gradient each.
    model = nn.Linear(12, 5)
    assert step_mb(model, (1, 1, 12), 1) == pytest.approx((12 + 65) * 4 / 1e6)
    assert step_mb(model, (1, 1, 12), 10) == pytest.approx(10 * (12 + 65) * 4 / 1e6)


def test_views_of_one_tensor_count_once():
    class TwoViews(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = torch.ones(12, requires_grad=True)
            return (x.view(-1, 12) * w).sum() + (x.view(-1, 12)[:, :6] * w[:6]).sum()

    # Only x needs saving (for w's gradient; x itself needs none): two views of its storage, 12 floats per
    # example, counted once.
    assert step_mb(TwoViews(), (1, 1, 12), 1) == pytest.approx(12 * 4 / 1e6)


def test_an_auto_pass_holds_about_pass_memory_mb_of_step_within_its_bounds():
    # 4,000 -> 5: 4,000 saved + 20,005 gradient floats per example, so 64 MB hold 666 examples: capped
    small = nn.Linear(4_000, 5)
    assert int(PASS_MEMORY_MB / step_mb(small, (1, 1, 4_000), 1)) > AUTO_PASS_MAX
    assert pass_examples("auto", small, (1, 1, 4_000)) == AUTO_PASS_MAX
    # in between (0.96 MB an example): 64 MB over the example's step, 66
    mid = nn.Linear(40_000, 5)
    expected = int(PASS_MEMORY_MB / step_mb(mid, (1, 1, 40_000), 1))
    assert AUTO_PASS_MIN < expected < AUTO_PASS_MAX and pass_examples("auto", mid, (1, 1, 40_000)) == expected
    # a network whose example takes more than PASS_MEMORY_MB / 32 still gets passes of 32 (the old fixed default)
    wide = nn.Linear(100_000, 10)
    assert step_mb(wide, (1, 1, 100_000), AUTO_PASS_MIN) > PASS_MEMORY_MB
    assert pass_examples("auto", wide, (1, 1, 100_000)) == AUTO_PASS_MIN
    # a number, or null (one pass per batch), is taken as it is
    assert pass_examples(7, small, (1, 1, 12)) == 7 and pass_examples(None, small, (1, 1, 12)) is None


def test_sizing_an_auto_pass_leaves_the_network_as_it_was():
    # measured on a copy: a forward in training mode would move a BatchNorm's running statistics
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    pass_examples("auto", net, (1, 8, 8))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_the_plan_counts_an_auto_pass_as_the_party_sizes_it():
    from mpi_fnas.space import search_space

    auto, one_pass = _plan("augment.epochs=0"), _plan("augment.epochs=0", "runtime.max_physical_batch=null")
    (term,) = auto.steps
    space = _cfg().space
    supernet = search_space(space.kind).build_supernet(space, seed=0, in_channels=3, num_classes=10)
    assert term.auto_examples == pass_examples("auto", supernet, (3, 8, 8)) >= AUTO_PASS_MIN
    assert auto.party.step_mb == pytest.approx(one_pass.at_passes(term.auto_examples).party.step_mb)


def _cfg(*overrides: str):
    return config_from_text(None, [*PRE_RECIPE, "data.train_size=400", "data.test_size=40", "data.image_size=8",
                                   *overrides])


def _plan(*overrides: str, hosts=("a",) * 3, capacity=math.inf, stage="search"):
    cfg = _cfg(*overrides)
    return plan_memory(cfg, [NodeFacts(host, capacity, "test") for host in hosts], stage=stage)


def test_a_genotype_outside_space_ops_is_one_line_of_bad_input_not_a_traceback():
    """The memory plan builds augment.genotype's network before anything else reads it: a genotype the config cannot
    train (here a pool, which the default's six convolutions leave out) is refused there as bad input."""
    cfg = config_from_text(None, ["data.train_size=400", "data.test_size=40", "data.image_size=8",
                                  "augment.genotype=dpnas=max_pool_3x3@0|conv_3x3_selu@0,conv_3x3_selu@1"])
    with pytest.raises(SetupError, match=r"^augment\.genotype: op 'max_pool_3x3' is not among space\.ops") as info:
        plan_memory(cfg, [NodeFacts("a", math.inf, "test")] * 3, stage="augment")
    assert "\n" not in str(info.value)


def test_a_larger_batch_or_network_raises_the_party_estimate_and_poisson_batches_get_a_margin():
    base = _plan()
    search = _plan("augment.epochs=0").party.step_mb
    uncapped = "runtime.max_physical_batch=null"
    assert _plan("augment.epochs=0", "search.batch_size=64", uncapped).party.step_mb > 2 * search
    assert _plan("augment.channels=16").party.step_mb > base.party.step_mb
    # Without DP a batch is exactly B; a Poisson batch of mean B is planned at B + 3√B.
    exact = _plan("mode=fnas", "augment.epochs=0")
    poisson = _plan("augment.epochs=0")
    assert poisson.party.step_mb == pytest.approx(exact.party.step_mb * (16 + 3 * 4) / 16)
    # A party runs a larger batch in passes of at most runtime.max_physical_batch examples: one pass is planned.
    poisson_uncapped = _plan("augment.epochs=0", uncapped).party.step_mb
    assert _plan("augment.epochs=0", "runtime.max_physical_batch=32").party.step_mb == pytest.approx(
        poisson_uncapped)  # 28 examples fit in one pass of 32
    assert _plan("augment.epochs=0", "runtime.max_physical_batch=8").party.step_mb == pytest.approx(
        poisson_uncapped * 8 / (16 + 3 * 4))
    assert _plan("augment.epochs=0", "search.batch_size=64", "runtime.max_physical_batch=32").party.step_mb == (
        pytest.approx(poisson_uncapped * 32 / 28))
    # An augmentation only (a given genotype) plans no supernet step.
    assert _plan(stage="augment").party.step_mb < base.party.step_mb
    assert base.server.total_mb > base.server.runtime_mb > 0


def test_ranks_add_up_per_node_and_a_node_that_cannot_hold_them_is_refused():
    plan = _plan(hosts=("n0", "n1", "n1"), capacity=1e6)
    assert plan.nodes == {"n0": [0], "n1": [1, 2]}
    assert plan.node_mb("n0") == pytest.approx(plan.server.total_mb)
    assert plan.node_mb("n1") == pytest.approx(2 * plan.party.total_mb)
    assert plan.refusal() is None
    assert any("node n1: 2 parties" in line for line in plan.lines())
    tight = _plan(hosts=("n0", "n1", "n1"), capacity=1.5 * plan.party.total_mb)
    refusal = tight.refusal()
    assert refusal is not None and "node n1" in refusal and "\n" not in refusal


def test_a_refused_node_is_told_the_largest_passes_that_fit():
    one_pass = _plan("runtime.max_physical_batch=null", hosts=("n0", "n1", "n1"))
    smallest = one_pass.at_passes(1).node_mb("n1")
    # Room for 2 parties with passes of a few examples, but not with one pass per batch.
    room = (smallest + one_pass.node_mb("n1")) / 2
    tight = _plan("runtime.max_physical_batch=null", hosts=("n0", "n1", "n1"), capacity=room)
    fitting = tight.fitting_passes()
    assert fitting is not None and fitting >= 1 and tight.at_passes(None).refusal() is not None
    assert tight.at_passes(fitting).refusal() is None and tight.at_passes(fitting + 1).refusal() is not None
    refusal = tight.refusal()
    assert refusal is not None and f"runtime.max_physical_batch={fitting} would fit" in refusal and "\n" not in refusal
    # The plan's own step is that of its configured passes.
    assert _plan("runtime.max_physical_batch=5").party.step_mb == pytest.approx(one_pass.at_passes(5).party.step_mb)
    hopeless = _plan(hosts=("n0", "n1", "n1"), capacity=smallest * 0.9)
    assert hopeless.fitting_passes() is None and "not even runtime.max_physical_batch=1" in hopeless.refusal()


def test_a_configured_node_memory_wins_and_the_measured_one_is_positive():
    assert node_facts(1234.0).capacity_mb == 1234.0
    measured = node_facts(None)
    assert measured.capacity_mb > 0 and measured.host


def test_return_free_memory_gives_freed_heap_pages_back():
    # Many small arrays live on glibc's heap; freed, their pages stay resident until the heap is trimmed.
    if not hasattr(ctypes.CDLL(None), "malloc_trim"):
        pytest.skip("not glibc: return_free_memory only collects garbage")
    arrays = [np.ones(1000) for _ in range(20_000)]  # 160 MB in 8 kB blocks
    del arrays[1:]  # one survivor at the bottom keeps the heap from shrinking by itself
    before = _resident_mb()
    return_free_memory()
    assert before - _resident_mb() > 100


def _resident_mb() -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024
