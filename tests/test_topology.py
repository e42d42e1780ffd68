"""The exchange pattern (``runtime.exchange``): the binomial tree's shape, what a party can see of the partial sums it
relays under secure aggregation (real pairwise masks), and rank 0's choice of the pattern."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from pre_recipe import PRE_RECIPE

from mpi_fnas.config import load_config
from mpi_fnas.federation.memory import NodeFacts
from mpi_fnas.federation.topology import (
    COLLECTIVE,
    STAR,
    choose_exchange,
    collective_refusal,
    tree_children,
    tree_parent,
)
from mpi_fnas.secagg.masks import PairwiseMasks


def subtree(rank: int, size: int, children=tree_children) -> set[int]:
    below = {rank}
    for child in children(rank, size):
        below |= subtree(child, size, children)
    return below


@pytest.mark.parametrize("size", range(1, 41))
def test_the_binomial_tree_reaches_every_rank_once_and_rank_0_has_log2_children(size):
    for rank in range(1, size):
        parent = tree_parent(rank)
        assert 0 <= parent < rank and rank in tree_children(parent, size)
    assert subtree(0, size) == set(range(size))
    assert sum(len(tree_children(rank, size)) for rank in range(size)) == size - 1
    assert len(tree_children(0, size)) == math.ceil(math.log2(size)) if size > 1 else tree_children(0, 1) == []
    if size > 1:
        assert tree_children(1, size) == []  # party 1 is a leaf under rank 0


N, RELEASE = 64, {"stage": "search", "step": 3, "release": "W"}


def relayed_sums(parties: int, children=tree_children) -> tuple[dict, dict, dict]:
    """Real pairwise masks of `parties` parties: ({party: its plain uint32 words}, {party: its PairwiseMasks},
    {(holder, child): the sum of the uploads of the child's subtree, which the holder receives}) in the tree
    `children` builds (holders that are parties: rank 0 holds no pair key)."""
    masks = {k: PairwiseMasks(k) for k in range(1, parties + 1)}
    keys = {k: m.public_key for k, m in masks.items()}
    for m in masks.values():
        m.agree(keys, parties=parties)
    rng = np.random.default_rng(parties)
    plain = {k: rng.integers(0, 2**32, N, dtype=np.uint32) for k in masks}
    upload = {k: plain[k] + masks[k].mask(N, **RELEASE) for k in masks}  # a party's sealed words (mod 2^32)
    received = {}
    for holder in masks:
        for child in children(holder, parties + 1):
            words = np.zeros(N, dtype=np.uint32)
            for k in subtree(child, parties + 1, children):
                words += upload[k]
            received[(holder, child)] = words
    return plain, masks, received


def pair_mask(masks: dict, sender: int, peer: int) -> np.ndarray:
    """What `sender`'s upload carries of the pair (sender, peer): computable by either of the two, no one else."""
    one = PairwiseMasks.__new__(PairwiseMasks)
    one.rank, one.run_id, one._shared = sender, masks[sender].run_id, {peer: masks[sender]._shared[peer]}
    return one.mask(N, **RELEASE)


def opened(words: np.ndarray, senders: set[int], known: set[int], masks: dict) -> np.ndarray:
    """`words` (a sum of `senders`' uploads) less every pair mask between a sender and a party of `known`."""
    out = words.copy()
    for sender in senders:
        for peer in known - senders:
            out -= pair_mask(masks, sender, peer)
    return out


def chain(rank: int, size: int) -> list[int]:
    """A tree the channel must not build: 0 ← 1 ← 2 ← … (party 1 relays everyone else's sum)."""
    return [rank + 1] if rank + 1 < size else []


@pytest.mark.parametrize("parties", [3, 4, 7, 8, 12])
def test_no_party_can_remove_the_masks_of_a_partial_sum_it_relays(parties):
    """Under secure aggregation a party of the tree receives its children's subtree sums. Its own pair keys do not
    open them, nor would every other party's but party 1's: party 1 is in no party's subtree, so each such sum
    keeps the masks shared with party 1. With every key (a collusion with party 1: refused with privacy.colluders
    > 0) it would open exactly."""
    plain, masks, received = relayed_sums(parties)
    everyone = set(masks)
    assert received  # K >= 3: party 2 relays party 3's upload
    for (holder, child), words in received.items():
        senders = subtree(child, parties + 1)
        truth = sum((plain[k] for k in senders), start=np.zeros(N, dtype=np.uint32))
        assert not np.array_equal(opened(words, senders, {holder}, masks), truth), (holder, child)
        assert not np.array_equal(opened(words, senders, everyone - {1}, masks), truth), (holder, child)
        np.testing.assert_array_equal(opened(words, senders, everyone, masks), truth)


def test_in_a_chain_a_relaying_party_would_open_the_sum_of_the_others():
    """The check above fails for a tree the channel does not build: in a chain party 1 receives parties 2..K's sum
    and removes every mask in it with its own keys."""
    plain, masks, received = relayed_sums(4, chain)
    words, senders = received[(1, 2)], {2, 3, 4}
    truth = sum((plain[k] for k in senders), start=np.zeros(N, dtype=np.uint32))
    np.testing.assert_array_equal(opened(words, senders, {1}, masks), truth)


def cfg(*changes: str):
    return load_config(None, [*PRE_RECIPE, *changes])


def facts(host_ranks: dict[str, tuple[int, int]]) -> list[NodeFacts]:
    """{host: (ranks, cores)} as every rank reports it, rank 0 first."""
    return [NodeFacts(host, 1e6, "test", cores) for host, (ranks, cores) in host_ranks.items() for _ in range(ranks)]


def test_auto_keeps_the_star_on_a_crowded_node_and_takes_collectives_with_a_core_per_rank():
    dp = cfg("mode=dpfnas")
    assert dp.runtime.exchange == "auto"
    assert choose_exchange(dp, facts({"a": (9, 2)})) == (
        STAR, "auto: node a runs 9 ranks on 2 cores (a tree's hops would wait for sleeping ranks)")
    assert choose_exchange(dp, facts({"a": (5, 8), "b": (4, 4)})) == (
        COLLECTIVE, "auto: every node has a core for each of its ranks")
    assert choose_exchange(cfg("mode=dpfnas", "runtime.exchange=collective"), facts({"a": (9, 2)}))[0] == COLLECTIVE
    assert choose_exchange(cfg("mode=dpfnas", "runtime.exchange=star"), facts({"a": (2, 8)}))[0] == STAR


@pytest.mark.parametrize(("changes", "reason"), [
    (["mode=fnas"], r"^mode fnas: a reduction tree would hand raw gradient sums to other parties"),
    (["mode=vanilla"], r"^mode vanilla: "),
    (["mode=dpfnas", "privacy.colluders=1"], r"^privacy\.colluders 1: parties colluding with each other"),
    (["mode=dpfnas", "privacy.aggregation=local", "federation.selection=random", "federation.select=1"],
     r"^federation\.selection random gathers each party's own release"),
    (["mode=dpfnas", "runtime.exchange=star"], r"^runtime\.exchange is star$"),
])
def test_what_keeps_the_star_whatever_the_nodes(changes, reason):
    config = cfg(*changes)
    assert collective_refusal(config) is not None
    pattern, why = choose_exchange(config, facts({"a": (3, 64)}))
    assert pattern == STAR
    assert re.match(reason, why), why


def test_plain_fnas_takes_collectives_only_when_asked():
    assert collective_refusal(cfg("mode=fnas", "runtime.exchange=collective")) is None
    assert choose_exchange(cfg("mode=fnas", "runtime.exchange=collective"), facts({"a": (3, 1)})) == (
        COLLECTIVE, "runtime.exchange is collective")
    assert collective_refusal(cfg("mode=dpfnas", "privacy.aggregation=local")) is None
