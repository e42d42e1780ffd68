"""The cost model's arithmetic (mpi_fnas/report/cost_model.py): a star exchange around rank 0's link or collectives
(the channel's tree, MPICH's algorithms), parties
sharing cores, strong scaling at a fixed amount of data, and the paper's Table 1 read through it. Its check against
real runs on shaped links is scripts/cost_table.sh (docs/hpc.md), not a test: it takes minutes and measures time."""

from __future__ import annotations

import math

import pytest

from mpi_fnas.report.cost_model import (
    Comparison,
    IterationTime,
    Link,
    MeasuredSearch,
    StepCosts,
    bcast_values,
    comparison_figure,
    markdown_table,
    predict_step,
    rank0_link_values,
    reduce_values,
    scaling_table,
    strong_scaling_efficiency,
    transfer_to_compute_for,
)

COSTS = StepCosts(party_step_seconds=0.4, server_seconds=0.01, message_seconds=0.0, num_w=100_000, num_a=80)


def test_link_rates_parse_as_tc_writes_them():
    assert Link.parse("100mbit").bandwidth_bits == 100e6
    assert Link.parse("1gbit", 0.001) == Link(1e9, 0.001)
    assert Link.parse("15mbit").bandwidth_bits == 15e6
    assert Link.parse("unlimited").bandwidth_bits == math.inf
    with pytest.raises(ValueError, match="rate"):
        Link.parse("100mb")


def test_a_step_is_the_parties_turns_plus_k_copies_each_way_over_rank_0s_link():
    step = predict_step(COSTS, parties=8, link=Link(100e6), cores=2)
    assert step.party == pytest.approx(0.4 * 9 / 2)  # 8 parties and rank 0 on 2 cores take 4.5 turns
    # G and H in, W and A out: 2 × 8 × 4 bytes × 100,080 values, at 100 Mbit/s
    assert step.transfer == pytest.approx(2 * 8 * 4 * 100_080 * 8 / 100e6)
    assert step.total == pytest.approx(step.party + step.transfer + 0.01)
    # a core each: the parties' compute no longer grows with K, the transfer still does
    own = predict_step(COSTS, parties=8, link=Link(100e6), cores=9)
    assert own.party == 0.4 and own.transfer == step.transfer
    assert predict_step(COSTS, parties=4, link=Link(math.inf), cores=2).transfer == 0.0


def test_latency_and_message_costs_add_per_exchange():
    costs = StepCosts(0.4, 0.0, message_seconds=0.001, num_w=0, num_a=0)
    step = predict_step(costs, parties=2, link=Link(math.inf, latency_seconds=0.01), cores=2)
    assert step.transfer == pytest.approx(8 * 0.01 + 4 * 2 * 0.001)


def test_strong_scaling_is_t1_over_k_tk_and_the_paper_reads_as_two_thirds_transfer():
    link = Link(100e6)
    t1 = predict_step(COSTS, 1, link, 2).total
    t8 = predict_step(COSTS, 8, link, 9).total
    assert strong_scaling_efficiency(COSTS, 8, link) == pytest.approx(t1 / t8)
    assert strong_scaling_efficiency(COSTS, 8, Link(math.inf)) == pytest.approx(1.0)
    # Table 1: 1.25 GPU-days at K = 1, 0.59 at K = 8 -> 26.5 %; under (1 + c) / (1 + 8c), c = 0.66 of the compute
    paper = 1.25 / (8 * 0.59)
    c = transfer_to_compute_for(paper, 8)
    assert c == pytest.approx(0.656, abs=0.005)
    assert (1 + c) / (1 + 8 * c) == pytest.approx(paper)
    # 80 % at K = 8 needs the transfer below 1/27 of the compute
    assert transfer_to_compute_for(0.8, 8) == pytest.approx(0.2 / 5.4)


def test_the_table_and_figure_show_every_run():
    measured, predicted = IterationTime(8.0, 2.0, 0.1), IterationTime(0.5, 0.1, 0.0)
    rows = [Comparison("50mbit", MeasuredSearch(parties, 16, measured), predicted) for parties in (2, 4, 8)]
    table = markdown_table(rows)
    assert table.count("\n") == 5 and "| 8 | 50mbit | star | 16 | 10.1 | 9.6 | -5% |" in table
    assert comparison_figure(rows)[:8] == b"\x89PNG\r\n\x1a\n"


def test_collectives_put_a_trees_copies_on_rank_0s_link_and_follow_mpichs_choice():
    n = 100_000  # 400 kB: long for MPICH's reduce, medium for its broadcast
    # the channel's own tree (secure words): one copy from each of rank 0's ⌈log2(K + 1)⌉ children
    assert reduce_values(n, 9, "collective", own_tree=True) == 4 * n
    assert reduce_values(n, 33, "collective", own_tree=True) == 6 * n
    # MPI_Ireduce of floats: reduce-scatter + gather, 2 (1 - 1/p) copies where K + 1 is a power of two; one copy
    # where rank 0 is folded onto rank 1 first; binomial for a short message
    assert reduce_values(n, 8, "collective", own_tree=False) == pytest.approx(2 * n * 7 / 8)
    assert reduce_values(n, 9, "collective", own_tree=False) == n
    assert reduce_values(80, 9, "collective", own_tree=False) == 4 * 80
    # MPI_Ibcast: binomial below 8 ranks or 12 kB, else scatter + allgather
    assert bcast_values(n, 5, "collective") == 3 * n
    assert bcast_values(n, 9, "collective") == pytest.approx(2 * n * 8 / 9)
    assert bcast_values(80, 33, "collective") == 6 * 80
    assert reduce_values(n, 9, "star", own_tree=True) == bcast_values(n, 9, "star") == 8 * n


def test_values_on_rank_0s_link_meet_the_trees_bound_and_the_star_grows_with_k():
    num_w, num_a = 77_906, 80
    for parties in (2, 4, 8, 16, 32):
        depth = math.ceil(math.log2(parties + 1))
        secure = rank0_link_values(num_w, num_a, parties, "collective", secure=True)
        assert secure <= 2 * (num_w + num_a) * depth
        assert rank0_link_values(num_w, num_a, parties, "collective", secure=False) <= secure
        assert rank0_link_values(num_w, num_a, parties, "star", secure=True) == 2 * parties * (num_w + num_a)
    # so the collective step's transfer stops growing linearly and strong scaling holds up at K = 64 on 10 Gbit/s
    link = Link(10e9)
    star = strong_scaling_efficiency(COSTS, 64, link, "star", secure=True)
    tree = strong_scaling_efficiency(COSTS, 64, link, "collective", secure=True)
    assert tree > star and tree > 0.9
    table = scaling_table(COSTS, [64, 1024], link, secure=True)
    assert table.count("\n") == 4 and table.startswith("| K | star: step (s)")
