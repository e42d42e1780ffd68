"""Secure aggregation, spied (docs/privacy.md §8): under ``privacy.aggregation: secure`` a DP party hands
MPI its device report, one 32-byte X25519 public key, and per release only masked uint32 words, never its
unmasked integer total; the server's sum of the masked words is exactly the sum of the unmasked totals (the masks
cancel), in both stages.

``secure_party_release`` (the party's integer total before masking) is wrapped to record its output on each party;
after the run every party's records go to rank 0, which checks the sums across parties. The run checkpoints every 2
steps, so the checkpoint path is spied too.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_waits import quiet_barrier
from pre_recipe import PRE_RECIPE
from test_release_spy import (
    CONVS,
    PASSES,
    PLAN_DIGEST_BYTES,
    SETUP_REPORT,
    SPACES,
    STAGES,
    PointToPointRecorder,
    RecordingChannel,
    check_checkpoint_holds_no_party_state,
    pin_secret_keys,
    plain_data,
)

import mpi_fnas.privacy.release as release_module
from mpi_fnas.config import load_config
from mpi_fnas.federation.memory import AUTO_PASS_MAX, AUTO_PASS_MIN
from mpi_fnas.federation.party_disk import PartyStore
from mpi_fnas.federation.topology import COLLECTIVE, STAR, tree_children, tree_parent
from mpi_fnas.runlog import read_run
from mpi_fnas.secagg.encoding import padded_length, wrap
from mpi_fnas.secagg.keyset import DIGEST_BYTES
from mpi_fnas.secagg.masks import PUBLIC_KEY_BYTES
from mpi_fnas.stages.job import run_job

STEPS = 3
DARTS = ["space.channels=4", "space.layers=3", "space.nodes=1"]


def mid_band(words: np.ndarray) -> float:
    """The fraction of words farther than 2^20 from 0 mod 2^32: ~1 for uniform words, ~0 for an unmasked total
    (a few ten thousand units either side of 0)."""
    return float(np.mean((words > 2**20) & (words < 2**32 - 2**20)))


#: The built-in default's calibration: σ from the secure accountant (its tight subsampling bound), not configured.
TARGET_EPSILON = 3.0


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize(("stage", "passes", "space", "calibrated", "pattern"), [
    ("search", None, "darts", False, STAR), ("augment", None, "darts", False, STAR),
    ("search", PASSES, "darts", False, STAR),
    ("search", None, "dpnas-convs", False, STAR),  # the built-in default's space: D from the largest network of its ops
    ("search", None, "dpnas-convs", True, STAR),  # ... and its σ, calibrated to a target ε by the secure accountant
    ("search", None, "darts", False, COLLECTIVE),  # the words up the binomial tree (runtime.exchange)
])
def test_secure_parties_hand_mpi_only_masked_words_and_one_public_key(monkeypatch, stage, passes, space, calibrated,
                                                                       pattern, shared_dir):
    """`passes`: ``runtime.max_physical_batch`` (None: one pass per batch). `calibrated`: σ planned for
    ``privacy.target_epsilon`` (the default) instead of configured; the words a party hands MPI are the same kind,
    only less noised, so the run's logged ε must still end at the target, not beyond it. `pattern`: under
    collectives a party relays its subtree's words: each message it sends its parent is its own masked words plus
    its children's messages (mod 2^32), still masked, never the subtree's unmasked total."""
    run = STAGES[stage]
    totals: list[np.ndarray] = []
    limits: list[int | None] = []  # each release's max_physical_batch, and its realised batch size
    real = release_module.secure_party_release

    def recording(*args, **kwargs):
        total = real(*args, **kwargs)
        totals.append(wrap(total, 32))
        limits.append((kwargs.get("max_physical_batch"), int(args[2].shape[0])))
        return total

    pin_secret_keys(monkeypatch)
    monkeypatch.setattr(release_module, "secure_party_release", recording)
    cfg = load_config(None, [*PRE_RECIPE,
        "mode=dpfnas", "seed=1", "data.train_size=320", "data.test_size=16", "data.image_size=8",
        *(DARTS if space == "darts" else [*SPACES["dpnas"], CONVS]),
        *run["settings"], "privacy.aggregation=secure", "runtime.progress=off", "checkpoint.every_steps=2",
        *([] if passes is None else [f"runtime.max_physical_batch={passes}"]),
        # ... against the server and one colluding party (privacy.colluders)
        *([f"privacy.target_epsilon={TARGET_EPSILON}", "privacy.colluders=1"] if calibrated else []),
    ])
    world = MPI.COMM_WORLD
    run_dir = shared_dir(f"spy-secure-{stage}-{passes}-{space}-{calibrated}-{pattern}-")
    wire = PointToPointRecorder(world)
    channel = RecordingChannel(wire)
    channel.pattern = pattern  # what mpi_fnas.run's agreement sets (tests/test_topology.py: the choice)
    run_job(cfg, channel, run_dir, stage=stage)
    quiet_barrier(world)
    gathered = world.gather((channel.sent, totals), root=0)
    on_wire = world.gather(wire.buffers, root=0)
    if not channel.is_server:
        assert set(channel.calls) <= {"reduce_sum", "gather_objects", "bcast", "bcast_object", "scatter_objects",
                                      "exchange_among_parties"}
        # To its peers: the digest of the public config and stage plan, then that of the key set it was shown,
        # public and nothing else.
        assert [len(m) for m in channel.peer_messages] == [PLAN_DIGEST_BYTES, DIGEST_BYTES]
        assert channel.objects[0] == SETUP_REPORT
        key = channel.objects[1]  # the only object that is not plain data: its public key, 32 bytes
        assert isinstance(key, bytes) and len(key) == PUBLIC_KEY_BYTES
        assert all(plain_data(obj) for obj in channel.objects[2:]), channel.objects
        per_step = len(run["clips"])
        assert len(channel.sent) == per_step * STEPS == len(totals)  # the step's releases, nothing else
        for sent, total in zip(channel.sent, totals, strict=True):
            assert sent.dtype == np.uint32 and sent.shape == total.shape
            # Masked: nothing like its total. A uniform word lands within 2^20 of 0 with probability 2^-11, so a
            # 32-word A upload may hold one such word: per upload > 0.9 (≥ 4 of 32: p ~ 1e-9), pooled > 0.99.
            assert mid_band(sent) > 0.9 and mid_band(total) < 0.01
        assert mid_band(np.concatenate(channel.sent)) > 0.99
        if passes is not None:  # the releases were made in passes (the sums below still match)
            assert {limit for limit, _ in limits} == {passes} and any(b > passes for _, b in limits)
        else:  # auto: one pass size, from the config alone, whatever the realised batches (data-independent)
            (limit,) = {limit for limit, _ in limits}
            assert AUTO_PASS_MIN <= limit <= AUTO_PASS_MAX and len({b for _, b in limits}) > 1
        return
    state = check_checkpoint_holds_no_party_state(run_dir, run["checkpoint"], party_state=run["party_state"])
    assert (state["stage"], state["step"]) == (stage, 2)
    log = read_run(run_dir / "search.h5")
    privacy = log["privacy"] if stage == "search" else log["augment"]["privacy"]
    assert privacy["aggregation"] == "secure"
    assert np.all(privacy["epsilon_collusion"][-1] > privacy["epsilon"][-1])  # colluders leave 1/K of the noise
    if calibrated:  # every release accounted: the planned steps end at the target, no party beyond it
        assert float(privacy["noise_multiplier_w"]) != float(cfg.privacy.noise_multiplier_w)
        assert TARGET_EPSILON * 0.95 < np.max(privacy["epsilon"][-1]) <= TARGET_EPSILON * (1 + 1e-6)
        assert privacy["colluders"] == 1  # that ε holds with one colluder; so does each party's own
        for rank in range(1, world.Get_size()):
            own = PartyStore(run_dir / "parties" / f"rank{rank}", stage=stage).recorded_epsilon()
            assert own == privacy["epsilon"][-1][rank - 1]
    # On the wire: to its parent (rank 0 in the star), one message a release, never through MPI's own reduce.
    size = world.Get_size()
    for rank in range(1, size):
        parent = tree_parent(rank) if pattern == COLLECTIVE else 0
        assert [(kind, dest) for kind, dest, _ in on_wire[rank]] == [("Isend", parent)] * len(gathered[rank][0])

    def subtree(rank: int) -> list[int]:
        below = [rank]
        for child in tree_children(rank, size) if pattern == COLLECTIVE else []:
            below += subtree(child)
        return below

    for rank in range(1, size):
        for i, (_, _, message) in enumerate(on_wire[rank]):
            relayed = gathered[rank][0][i].copy()
            for child in tree_children(rank, size) if pattern == COLLECTIVE else []:
                relayed += on_wire[child][i][2]
            np.testing.assert_array_equal(message, relayed)  # its words plus its children's messages
            plain = np.sum([gathered[k][1][i] for k in subtree(rank)], axis=0, dtype=np.uint32)
            assert mid_band(message) > 0.9 and mid_band(plain) < 0.01  # masked, never the subtree's total
    if pattern == COLLECTIVE:
        assert any(tree_children(rank, size) for rank in range(1, size))  # some party relayed (4 ranks: party 2)
    # The masks cancel: Σ_k masked words ≡ Σ_k unmasked totals (mod 2^32), release by release.
    parties = gathered[1:]
    for i in range(len(parties[0][0])):
        masked = np.sum([sent[i] for sent, _ in parties], axis=0, dtype=np.uint32)
        plain = np.sum([total[i] for _, total in parties], axis=0, dtype=np.uint32)
        np.testing.assert_array_equal(masked, plain)
        assert not any(np.array_equal(sent[i], total[i]) for sent, total in parties)
        # The length the server sees is public: the same from every party, a whole number of rotation blocks.
        lengths = {sent[i].size for sent, _ in parties}
        assert len(lengths) == 1 and padded_length(min(lengths)) == min(lengths)
