"""Party and server computations without MPI: second-order term vs autograd, batches, schedule, flat buffers."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpi_fnas.config import SearchConfig
from mpi_fnas.evaluation import evaluate
from mpi_fnas.federation.flat import STATS, assign, flatten, numel
from mpi_fnas.federation.global_model import search_server
from mpi_fnas.federation.local_model import Party, search_party
from mpi_fnas.federation.memory import pass_examples
from mpi_fnas.federation.randomness import PartyRandomness
from mpi_fnas.federation.schedules import search_learning_rate
from mpi_fnas.federation.shard import BatchStream, Shard
from mpi_fnas.keystream import Keystream
from mpi_fnas.space import SearchNetwork


class SmoothSupernet(torch.nn.Module):
    """A tiny smooth (tanh/sigmoid) stand-in with the supernet's weights()/alphas() split.

    The DARTS supernet has ReLU/max-pool kinks and per-channel normalisation over a few pixels, so a finite
    difference with DARTS' ε = 0.01/‖v‖ is far from the exact Hessian-vector product there (measured: ≥ 60 %
    error even in float64). On a smooth model the same formula must agree with autograd to O(ε²): that pins the
    formula (2ε divisor, W±, ξ, the train batch) independently of the network's non-smoothness.
    """

    def __init__(self, features: int = 12, classes: int = 3) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(features, features) for _ in range(3))
        self.head = torch.nn.Linear(features, classes)
        self.alpha = torch.nn.Parameter(1e-1 * torch.randn(2, 3))

    def weights(self):
        return [p for name, p in self.named_parameters() if name != "alpha"]

    def alphas(self):
        return [self.alpha]

    def forward(self, x):
        h = x.flatten(1)
        for edge in range(2):
            w = torch.softmax(self.alpha[edge], 0)
            b = self.branches
            h = w[0] * torch.tanh(b[0](h)) + w[1] * torch.sigmoid(b[1](h)) + w[2] * b[2](h)
        return self.head(h)


def tiny_party(seed: int = 0, n: int = 6, smooth: bool = False) -> Party:
    torch.manual_seed(seed)
    if smooth:
        model = SmoothSupernet()
        shape = (12,)
    else:
        model = SearchNetwork(channels=4, num_classes=3, layers=3, nodes=2, in_channels=3, norm="groupnorm")
        shape = (3, 8, 8)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, *shape, generator=g)
    y = torch.randint(0, 3, (2 * n,), generator=g)
    return search_party(model, Shard(x[:n], y[:n]), Shard(x[n:], y[n:]), batch_size=10**6,
                        randomness=PartyRandomness.create("reproducible", seed=seed, rank=1))


def grad_a(party: Party, w: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    assign(party.w_params, w)
    loss = F.cross_entropy(party.model(x), y)
    grads = torch.autograd.grad(loss, party.a_params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                      for g, p in zip(grads, party.a_params, strict=True)])


def exact_second_order(party: Party, w_before: np.ndarray, w_new: np.ndarray, v: np.ndarray, xi: float) -> np.ndarray:
    """∇_A L_val(W') − ξ·∇_A⟨∇_W L_tr(W), v⟩ by double backward (an exact Hessian-vector product)."""
    model, w_params, a_params = party.model, party.w_params, party.a_params
    first = grad_a(party, w_new, party.val.x, party.val.y)
    assign(w_params, w_before)
    loss_tr = F.cross_entropy(model(party.train.x), party.train.y)
    grads_w = torch.autograd.grad(loss_tr, w_params, create_graph=True)
    chunks = np.split(v, np.cumsum([p.numel() for p in w_params])[:-1])
    dot = sum((g * torch.from_numpy(c).view_as(g)).sum() for g, c in zip(grads_w, chunks, strict=True))
    mixed = torch.autograd.grad(dot, a_params, allow_unused=True)
    mixed = torch.cat([(m if m is not None else torch.zeros_like(p)).reshape(-1)
                       for m, p in zip(mixed, a_params, strict=True)])
    assign(w_params, w_new)
    return (first - xi * mixed).detach().numpy()


def second_order_release(party: Party, xi: float):
    """Drive one second-order party step as the loop does (K = 1: the aggregate v is the party's v_k)."""
    w_before = flatten(party.w_params)
    g = party.w_release()[:-STATS].copy()  # uses the whole train shard (batch ≥ shard)
    w_new = (w_before - xi * g).astype(np.float32)
    party.load_w(w_new)
    v = party.val_gradients().copy()
    h = party.a_release_second_order(v, xi)[:-STATS].copy()
    return h, w_before, w_new, v


def test_second_order_matches_autograd_hessian_vector_product():
    party = tiny_party(smooth=True)
    xi = 0.5
    h, w_before, w_new, v = second_order_release(party, xi)
    exact = exact_second_order(party, w_before, w_new, v, xi)
    hessian_term = np.linalg.norm(exact - exact_second_order(party, w_before, w_new, np.zeros_like(v), xi))
    assert hessian_term > 0.05 * np.linalg.norm(exact)  # the term is big enough for the check to bite
    assert np.linalg.norm(h - exact) <= 1e-2 * hessian_term
    np.testing.assert_array_equal(flatten(party.w_params), w_new)  # W' restored after probing W±


def test_second_order_on_the_supernet_is_the_darts_finite_difference():
    """On the real supernet: H = ∇_A L_val(W') − ξ (∇_A L_tr(W + εv) − ∇_A L_tr(W − εv)) / (2ε), ε = 0.01/‖v‖."""
    party = tiny_party()
    xi = 0.3
    h, w_before, w_new, v = second_order_release(party, xi)
    eps = 0.01 / np.linalg.norm(v.astype(np.float64))
    x, y = party.train.x, party.train.y
    plus = grad_a(party, w_before + eps * v, x, y)
    minus = grad_a(party, w_before - eps * v, x, y)
    expected = grad_a(party, w_new, party.val.x, party.val.y) - xi * (plus - minus) / (2 * eps)
    np.testing.assert_allclose(h, expected.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_release_layout_and_stats():
    party = tiny_party(n=5)
    out = party.w_release()
    assert out.shape == (party.num_w + STATS,) and out.dtype == np.float32
    loss_sum, correct, count, seconds = out[-STATS:]
    assert count == 5 and 0 <= correct <= 5 and loss_sum > 0 and seconds > 0
    # The gradient part is the gradient of the mean loss.
    party.model.zero_grad()
    F.cross_entropy(party.model(party.train.x), party.train.y).backward()
    expected = np.concatenate([p.grad.reshape(-1).numpy() for p in party.w_params])
    np.testing.assert_allclose(out[:-STATS], expected, rtol=1e-5, atol=1e-7)
    a = party.a_release()
    assert a.shape == (party.num_a + STATS,) and a[-2] == 5


def test_a_party_computes_channels_last_and_releases_the_default_layouts_gradient():
    torch.manual_seed(0)
    model = SearchNetwork(channels=4, num_classes=3, layers=3, nodes=2, in_channels=3, norm="groupnorm")
    reference = copy.deepcopy(model)  # stays in the default layout
    x, y = torch.randn(5, 3, 8, 8), torch.randint(0, 3, (5,))
    party = search_party(model, Shard(x, y), Shard(x, y), batch_size=10**6,
                         randomness=PartyRandomness.create("reproducible", seed=0, rank=1))
    convs = [m for m in party.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    assert party.train.x.is_contiguous(memory_format=torch.channels_last)
    F.cross_entropy(reference(x), y).backward()
    expected = np.concatenate([p.grad.reshape(-1).numpy() for p in reference.weights()])
    np.testing.assert_allclose(party.w_release()[:-STATS], expected, rtol=1e-4, atol=1e-6)


def test_an_exact_step_in_passes_is_the_step_in_one():
    whole, split = tiny_party(n=7), tiny_party(n=7)
    split.max_physical_batch = 3  # passes of 3, 2 and 2 examples
    for release in ("w_release", "a_release"):
        expected, got = getattr(whole, release)(), getattr(split, release)()
        np.testing.assert_allclose(got[:-STATS], expected[:-STATS], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got[-STATS:-1], expected[-STATS:-1], rtol=1e-5)  # loss sum, correct, count
    assert split.w_release()[-2] == 7


def test_a_party_sizes_an_auto_pass_from_its_own_network_and_examples():
    model = SearchNetwork(channels=4, num_classes=3, layers=3, nodes=2, in_channels=3, norm="groupnorm")
    expected = pass_examples("auto", model, (3, 8, 8))
    x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 3, (12,))
    party = search_party(model, Shard(x[:6], y[:6]), Shard(x[6:], y[6:]), batch_size=4,
                         randomness=PartyRandomness.create("reproducible", seed=0, rank=1), max_physical_batch="auto")
    assert party.max_physical_batch == expected > 32  # a number of examples, more than the old fixed 32 here


def test_batch_stream_visits_every_example_once_per_pass():
    stream = BatchStream(10, 3, Keystream.from_labels("test", 1))
    seen = torch.cat([stream.next() for _ in range(3)])  # 9 of 10, no repeats within a pass
    assert len(set(seen.tolist())) == 9
    nxt = stream.next()  # fewer than 3 unseen left → reshuffle
    assert nxt.numel() == 3
    full = BatchStream(4, 100, Keystream.from_labels("test", 1))
    assert sorted(full.next().tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        BatchStream(0, 3, Keystream.from_labels("test", 1))


def test_cosine_schedule_endpoints_and_server_uses_it():
    s = SearchConfig(epochs=4, w_lr=0.1, w_lr_min=0.01)
    assert search_learning_rate(s, 0) == pytest.approx(0.1)
    assert search_learning_rate(s, 2) == pytest.approx(0.055)
    assert search_learning_rate(s, 4) == pytest.approx(0.01)
    assert all(search_learning_rate(s, e) > search_learning_rate(s, e + 1) for e in range(4))
    torch.manual_seed(0)
    server = search_server(SearchNetwork(channels=4, num_classes=3, layers=1, nodes=1, norm="groupnorm"), s,
                           parties=2, steps_per_epoch=5)
    server.begin_step(16)  # the first step of epoch 3
    assert server.lr == pytest.approx(0.01 + 0.045 * (1 + math.cos(math.pi * 0.75)))


def test_server_mean_vs_sum_aggregation():
    torch.manual_seed(0)
    model = SearchNetwork(channels=4, num_classes=3, layers=1, nodes=1, norm="groupnorm")
    for aggregate, scale in (("mean", 0.25), ("sum", 1.0)):
        server = search_server(model, SearchConfig(aggregate=aggregate, w_momentum=0, w_weight_decay=0,
                                                   w_grad_clip=0, w_lr=0.1), parties=4)
        w0 = server.w_buffer.copy()
        grad = np.ones_like(w0)
        server.step_w(grad)
        np.testing.assert_allclose(server.w_buffer, w0 - 0.1 * scale * grad, rtol=1e-6)


def test_the_server_evaluates_channels_last_and_keeps_w_and_a_in_the_default_order():
    # Rank 0 computes channels-last (speed): its W and A must still be the default layout's flat vectors, and its
    # evaluation that of the default-layout network on the same weights.
    torch.manual_seed(0)
    reference = SearchNetwork(channels=4, num_classes=3, layers=3, nodes=2, norm="groupnorm")
    w, a = flatten(list(reference.weights())), flatten(list(reference.alphas()))
    server = search_server(copy.deepcopy(reference), SearchConfig(), parties=2)
    conv = next(m for m in server.model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
    np.testing.assert_array_equal(server.w_buffer, w)
    np.testing.assert_array_equal(server.a_buffer, a)
    server.w_buffer[:] += np.linspace(-0.1, 0.1, w.size, dtype=np.float32)  # a new global W, then evaluated
    assign(list(reference.weights()), server.w_buffer)
    x, y = torch.randn(70, 3, 8, 8), torch.randint(0, 3, (70,))
    expected = evaluate(reference, x, y, batch_size=32)
    np.testing.assert_allclose(server.evaluate(x, y), expected, rtol=1e-5)
    assert expected[1] not in (0, 70)  # a loss and a count of correct answers that could differ


def test_flat_round_trip_and_shape_check():
    tensors = [torch.zeros(2, 3), torch.zeros(4)]
    vec = np.arange(10, dtype=np.float32)
    assign(tensors, vec)
    assert tensors[0][1, 2] == 5 and tensors[1][3] == 9
    np.testing.assert_array_equal(flatten(tensors), vec)
    assert numel(tensors) == 10
    with pytest.raises(ValueError):
        assign(tensors, np.zeros(9, dtype=np.float32))


def test_a_dp_party_refuses_every_unnoised_path_whatever_its_config():
    """The refusal lives where releases are made: a Config changed in code cannot slip second order (or the final
    validation evaluation) past a DP party, because the party itself refuses to compute those vectors."""
    from mpi_fnas.privacy import DPParams, PrivacyError

    plain = tiny_party()
    dp = DPParams(noise_multiplier_w=1.0, noise_multiplier_a=1.0, clip_w=1.0, clip_a=0.1, expected_batch_size=2.0)
    party = search_party(plain.model, plain.train, plain.val, batch_size=2,
                         randomness=PartyRandomness.create("secret", seed=0, rank=1), dp=dp)
    party.w_release()
    party.load_w(flatten(party.w_params))
    for unnoised in (party.val_gradients, party.evaluate_val,
                     lambda: party.a_release_second_order(np.zeros(party.num_w, np.float32), 0.1)):
        with pytest.raises(PrivacyError, match="DP party does not release"):
            unnoised()
    assert np.all(party.a_release()[-STATS:] == 0)  # the noised path still works, with a zero tail


def test_alpha_movement_is_one_and_zero_at_uniform_and_moves_with_a():
    """The summary's measure of a search that moved A: entropy (÷ log ops) and top-op margin, means over edges."""
    torch.manual_seed(0)
    server = search_server(SearchNetwork(channels=4, num_classes=3, layers=1, nodes=2, norm="groupnorm"),
                           SearchConfig(), parties=1)
    server.a.data.zero_()
    entropy, margin = server.alpha_movement()
    assert math.isclose(entropy, 1.0, abs_tol=1e-9) and math.isclose(margin, 0.0, abs_tol=1e-9)
    edges = server.a.numel() // 8  # 8 ops per edge, normal and reduce cells
    server.a.data.view(edges, 8)[0, 3] = math.log(7 * 3)  # edge 0: p = 3/4 on op 3, 1/28 on each other op
    entropy, margin = server.alpha_movement()
    p = np.array([0.75] + [0.25 / 7] * 7)
    assert math.isclose(entropy, (edges - 1 + float(-(p * np.log(p)).sum() / np.log(8))) / edges, rel_tol=1e-6)
    assert math.isclose(margin, (0.75 - 0.25 / 7) / edges, rel_tol=1e-6)


@pytest.mark.parametrize(("entropy", "hinted"), [(0.9999, True), (0.967, False)])
def test_the_summary_says_when_the_search_left_a_where_it_started(entropy: float, hinted: bool):
    """The DARTS values in 10 private steps end at entropy 0.9999 (the cell is an argmax over noise): the summary
    says so and names the keys that move A; a search that steered (0.967 on mnist-5k) gets no such line."""
    from mpi_fnas.stages.search import SearchOutcome
    from mpi_fnas.stages.summary import summary

    outcome = SearchOutcome(mode="dpfnas", genotype="dpnas=skip_connect@0|skip_connect@0,none@1", epochs=2, steps=10,
                            test_acc=0.1, stop_reason="completed", parties=8, val_acc=float("nan"),
                            val_loss=float("nan"), w=np.zeros(1), a=np.zeros(1), alpha_entropy=entropy,
                            alpha_margin=0.0009)
    text = summary(outcome, None)
    assert f"entropy {entropy:.4f} of uniform's" in text
    assert ("A has barely moved" in text) == hinted
    if hinted:
        assert "search.a_lr" in text and "search.batch_size" in text
