"""The party's DP release: Poisson sampling, per-example gradients, clipping, noise, and the model checks."""

from __future__ import annotations

import itertools
import math
import os
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import perturb_others
from scipy import special, stats
from torch import nn

from mpi_fnas.keystream import KEY_BYTES, Keystream
from mpi_fnas.privacy import (
    PrivacyError,
    check_dp_search_options,
    check_model_for_dp,
    clip_per_sample,
    clipped_sum,
    gaussian_noise,
    layer_grads,
    party_release,
    per_example_cross_entropy,
    per_sample_gradients,
    poisson_sample,
    privatize_per_sample_gradients,
)
from mpi_fnas.privacy.mechanism import secure_party_release, standard_normal_from_bits
from mpi_fnas.privacy.per_sample import hooks_supported, physical_batches
from mpi_fnas.secagg.encoding import Encoding, rotation_signs
from mpi_fnas.space import SearchNetwork

# Significance of the statistical tests. The seeds are fixed, so each test is deterministic; the level only says
# how unlucky a correct implementation would have to be for its seed to fail.
ALPHA = 1e-6


class TinyConvNet(nn.Module):
    """Every layer kind the hooks method handles, including a module called twice (weight sharing).

    ``(b, 3, 8, 8) -> (b, 5)`` logits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1, bias=True)  # dense 3x3 with bias: grouped backward
        self.norm = nn.GroupNorm(2, 6)  # affine
        self.depthwise_dilated = nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=6, bias=False)  # correlation
        self.depthwise_strided = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6, bias=False)  # correlation
        self.grouped = nn.Conv2d(6, 4, 3, padding=1, groups=2, bias=True)  # 2 groups of 3 -> 2: grouped backward
        self.pointwise_strided = nn.Conv2d(4, 4, 1, stride=2, bias=False)  # batched matmul (1x1)
        self.pointwise_grouped = nn.Conv2d(4, 4, 1, groups=2, bias=True)  # offsets (grouped 1x1)
        self.layer_norm = nn.LayerNorm(4)
        self.classifier = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.stem(x)))
        x = self.depthwise_dilated(x) + self.depthwise_dilated(F.relu(x))  # shared module
        x = F.relu(self.grouped(self.depthwise_strided(x)))
        x = self.pointwise_grouped(self.pointwise_strided(x)).mean(dim=(2, 3))
        return self.classifier(self.layer_norm(x))


def loop_gradients(model: nn.Module, names: list[str], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Reference: one ordinary backward per example -> (B, P)."""
    params = dict(model.named_parameters())
    rows = []
    for i in range(inputs.shape[0]):
        model.zero_grad(set_to_none=True)
        per_example_cross_entropy(model(inputs[i : i + 1]), targets[i : i + 1]).sum().backward()
        rows.append(
            torch.cat(
                [
                    (params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])).reshape(-1)
                    for n in names
                ]
            )
        )
    return torch.stack(rows)


def max_relative_row_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((actual - expected).norm(dim=1) / expected.norm(dim=1)).max())


def small_search_network(norm: str = "groupnorm") -> SearchNetwork:
    torch.manual_seed(0)
    return SearchNetwork(4, 10, 2, nodes=2, norm=norm)


def image_batch(batch: int, size: int, classes: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, classes, (batch,), generator=gen)


# -- Poisson sampling -----------------------------------------------------------------------------------------


def test_poisson_sample_is_independent_inclusion_with_rate_q():
    n, q = 20000, 0.05
    gen = Keystream.from_labels("test", 3)
    counts = torch.zeros(n)
    sizes = []
    for _ in range(20):
        idx = poisson_sample(n, q, gen)
        assert idx.dtype == torch.int64
        assert torch.equal(idx, torch.unique(idx)), "indices must be distinct and increasing"
        assert int(idx.min()) >= 0 and int(idx.max()) < n
        counts[idx] += 1
        sizes.append(idx.numel())
    # Total inclusions over 20 draws ~ Binomial(20 n, q): a two-sided ALPHA interval from the sample size.
    total = sum(sizes)
    low, high = stats.binom.interval(1 - ALPHA, 20 * n, q)
    assert low <= total <= high
    # Sizes vary (not "shuffle and take B"): their spread matches Binomial(n, q) (chi-square on the variance).
    var_stat = (len(sizes) - 1) * np.var(sizes, ddof=1) / (n * q * (1 - q))
    assert stats.chi2.ppf(ALPHA / 2, len(sizes) - 1) <= var_stat <= stats.chi2.ppf(1 - ALPHA / 2, len(sizes) - 1)


def test_poisson_sample_edge_rates_and_empty_batches():
    gen = Keystream.from_labels("test", 0)
    assert poisson_sample(100, 0.0, gen).numel() == 0
    assert torch.equal(poisson_sample(100, 1.0, gen), torch.arange(100))
    assert poisson_sample(0, 0.5, gen).numel() == 0
    # With q = 0.01 and N = 5, P(empty) = 0.95: empty batches must come out as valid empty index tensors.
    assert any(poisson_sample(5, 0.01, gen).numel() == 0 for _ in range(10))
    with pytest.raises(ValueError):
        poisson_sample(10, 1.5, gen)


def coin_thresholds(num_examples: int, state: dict) -> np.ndarray:
    """``(num_examples, 2)``: for each example, adjacent float64 ``lo < hi`` with the example out at q = lo, in at hi.

    Example i is in ``poisson_sample(N, q, s)`` iff its coin is below q, so bisection on q, with the stream
    restored to ``state`` before every call, brackets each coin as tightly as float64 q allows, without looking
    inside the sampler.
    """
    brackets = np.zeros((num_examples, 2))
    for i in range(num_examples):
        lo, hi = 0.0, 1.0  # i not picked at q = lo (coins are >= 0), picked at q = hi (coins are < 1)
        while lo < (middle := (lo + hi) / 2) < hi:
            stream = Keystream.from_labels("unused")
            stream.load_state_dict(state)
            if i in set(poisson_sample(num_examples, middle, stream).tolist()):
                hi = middle
            else:
                lo = middle
        brackets[i] = lo, hi
    return brackets


def test_poisson_coins_are_resolved_far_below_float32():
    """The inclusion threshold of every coin lies on no coarse grid: the sampler realises q, not q rounded.

    float32 coins sit on a 2^-24 grid and are compared with q rounded to float32, so coin i's threshold (the q
    where example i enters) is a float32 rounding midpoint, a multiple of 2^-30 for every coin >= 2^-6 (~98% of
    them). A float64 coin's bracket (two adjacent doubles) holds a multiple of 2^-30 with probability ~2^-22.
    """
    num_examples = 64
    state = Keystream.from_labels("test", 11).state_dict()
    brackets = coin_thresholds(num_examples, state)
    assert np.all(brackets[:, 1] - brackets[:, 0] <= 2.0**-53)
    on_grid = np.floor(brackets[:, 1] * 2.0**30) >= brackets[:, 0] * 2.0**30  # a multiple of 2^-30 in [lo, hi]
    assert int(on_grid.sum()) <= 1, f"{int(on_grid.sum())} of {num_examples} coin thresholds on the 2^-30 grid"
    # The thresholds are the coins: uniform on [0, 1) (KS at the suite's level).
    assert stats.kstest(brackets[:, 0], "uniform").pvalue > ALPHA


# -- per-example gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("method", ["vmap", "hooks"])
def test_per_sample_gradients_match_single_example_backward(method, layout):
    torch.manual_seed(0)
    model = TinyConvNet()
    inputs, targets = image_batch(6, 8, 5)
    names = [n for n, _ in model.named_parameters()]
    expected = loop_gradients(model, names, inputs, targets)  # the default layout
    model.to(memory_format=layout)  # a party computes channels-last (mpi_fnas.federation.local_model)
    inputs = inputs.contiguous(memory_format=layout)
    actual = per_sample_gradients(model, dict(model.named_parameters()), inputs, targets, method=method)
    assert actual.shape == (6, sum(p.numel() for p in model.parameters()))
    assert max_relative_row_error(actual, expected) <= 1e-5


@pytest.mark.parametrize(("kernel", "stride", "dilation", "side"),
                         [(5, 1, 1, 8), (5, 2, 2, 7), (3, 2, 2, 9), (5, 1, 2, 5), (7, 2, 1, 6), (3, 1, 1, 8),
                          (3, 2, 1, 7)])
def test_depthwise_per_example_gradients_by_correlation_match_the_loop(kernel, stride, dilation, side):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(4, 4, kernel, stride=stride, padding=dilation * (kernel - 1) // 2, dilation=dilation, groups=4,
                  bias=False),
        nn.Flatten(), nn.LazyLinear(3))
    inputs = torch.randn(5, 4, side, side)
    model(inputs)  # materialise the head
    targets = torch.randint(0, 3, (5,))
    names = ["0.weight"]
    expected = loop_gradients(model, names, inputs, targets)
    for layout in (torch.contiguous_format, torch.channels_last):
        model.to(memory_format=layout)
        actual = per_sample_gradients(model, {"0.weight": model[0].weight}, inputs.contiguous(memory_format=layout),
                                      targets, method="hooks")
        assert max_relative_row_error(actual, expected) <= 1e-5


@pytest.mark.parametrize(("kernel", "stride", "padding", "side"), [(3, 1, 1, 2), (3, 2, 1, 4), (2, 1, 0, 3)])
def test_dense_per_example_gradients_by_unfold_match_the_loop(monkeypatch, kernel, stride, padding, side):
    # 8 input channels and at most 4 output pixels: the unfolded patches' batched matmul, not the grouped kernel.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 5, kernel, stride=stride, padding=padding, bias=True), nn.Flatten(),
                          nn.LazyLinear(3))
    inputs, targets = torch.randn(5, 8, side, side), torch.randint(0, 3, (5,))
    model(inputs)  # materialise the head
    names = ["0.weight", "0.bias"]
    expected = loop_gradients(model, names, inputs, targets)
    unfolded = []
    original = layer_grads.conv_weight_grads_by_unfold
    monkeypatch.setattr(layer_grads, "conv_weight_grads_by_unfold",
                        lambda *args: unfolded.append(1) or original(*args))
    for layout in (torch.contiguous_format, torch.channels_last):
        model.to(memory_format=layout)
        actual = per_sample_gradients(model, {n: dict(model.named_parameters())[n] for n in names},
                                      inputs.contiguous(memory_format=layout), targets, method="hooks")
        assert max_relative_row_error(actual, expected) <= 1e-5
    assert len(unfolded) == 2


def test_per_example_hooks_let_go_of_each_layer_once_the_backward_is_past_it(monkeypatch):
    # A private step's peak memory: when the backward reaches the first conv, the later convs' inputs and outputs
    # must already be freed (not held to the end of the backward by the per-example machinery).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 36, 3))
    inputs, targets = torch.randn(5, 3, 6, 6), torch.randint(0, 3, (5,))
    seen, alive_at_first = [], []
    original = layer_grads.layer_per_example_grads

    def watched(module, x, g_out, *statistics):
        if module is model[0]:  # the backward's last layer: everything behind it should be gone
            alive_at_first.extend(ref() is not None for ref in [*seen, *outputs.values()])
        seen.append(weakref.ref(x))
        return original(module, x, g_out, *statistics)

    outputs = {}
    def keep_a_weak_reference(module, args, out):  # returns None: the output stays as it is
        outputs[module] = weakref.ref(out)

    for index in (2, 4):  # the later convs' outputs, as the forward made them
        model[index].register_forward_hook(keep_a_weak_reference)
    monkeypatch.setattr(layer_grads, "layer_per_example_grads", watched)
    per_sample_gradients(model, dict(model.named_parameters()), inputs, targets, method="hooks")
    # The linear's and the two later convs' inputs, then those convs' outputs.
    assert len(seen) == 4 and alive_at_first == [False] * 5


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_group_norm_per_example_gradients_come_from_the_forwards_saved_statistics(layout):
    # The hooks take each GroupNorm's mean and rstd from its forward's graph node instead of normalising again: the
    # route must be taken, and agree with the per-example loop in float64, also where the mean is far from 0 (the
    # form sum(g * x) - mean * sum(g) cancels there).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 25, 3)).double().to(memory_format=layout)
    with torch.no_grad():
        model[0].bias.fill_(40.0)  # GroupNorm inputs with mean ~40 and std ~1
        model[1].weight.normal_()
        model[1].bias.normal_()
    inputs = torch.randn(6, 3, 5, 5, dtype=torch.float64).contiguous(memory_format=layout)
    targets = torch.randint(0, 3, (6,))
    x = model[0](inputs)
    assert layer_grads.saved_statistics(model[1], model[1](x)) is not None
    assert layer_grads.saved_statistics(model[1], model[1](x).detach()) is None
    names = ["1.weight", "1.bias"]
    # The loop's backward computes every parameter's gradient: torch 2.13's channels-last GroupNorm backward crashes
    # (SIGSEGV) when only its weight and bias are asked for.
    expected = loop_gradients(model, names, inputs, targets)
    actual = per_sample_gradients(model, {n: dict(model.named_parameters())[n] for n in names}, inputs, targets,
                                  method="hooks")
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)


def test_per_sample_gradients_subset_order_chunking_and_no_grad():
    torch.manual_seed(0)
    model = TinyConvNet()
    inputs, targets = image_batch(5, 8, 5)
    names = ["classifier.weight", "stem.bias", "depthwise_dilated.weight"]  # not in model order on purpose
    params = {n: dict(model.named_parameters())[n] for n in names}
    expected = loop_gradients(model, names, inputs, targets)
    for method in ("vmap", "hooks"):
        with torch.no_grad():  # a caller's no_grad must not change the result
            chunked = per_sample_gradients(model, params, inputs, targets, method=method, max_chunk=2)
        assert max_relative_row_error(chunked, expected) <= 1e-5


def test_search_network_per_sample_gradients_weights_and_alphas():
    model = small_search_network()
    inputs, targets = image_batch(4, 16, 10)
    weights, alphas = dict(model.named_weights()), dict(model.named_alphas())
    assert hooks_supported(model, weights) and hooks_supported(model, alphas)  # the alphas as per-example copies
    for params in (weights, alphas, dict(model.named_parameters())):
        expected = loop_gradients(model, list(params), inputs, targets)
        for method in ("auto", "hooks", "vmap"):
            got = per_sample_gradients(model, params, inputs, targets, method=method)
            assert max_relative_row_error(got, expected) <= 1e-5, method


def test_per_example_alpha_copies_are_exact_in_float64():
    """The alphas' per-example copies give each example's own gradient to float64 rounding (vmap: the
    reference), and one example's row does not move when the others change."""
    model = small_search_network().double()
    inputs, targets = image_batch(5, 16, 10)
    inputs = inputs.double()
    alphas = dict(model.named_alphas())
    copies = per_sample_gradients(model, alphas, inputs, targets, method="hooks")
    reference = per_sample_gradients(model, alphas, inputs, targets, method="vmap")
    assert max_relative_row_error(copies, reference) <= 1e-12
    # In chunks the copies are made per chunk (B = chunk size): the same rows.
    chunked = per_sample_gradients(model, alphas, inputs, targets, method="hooks", max_chunk=2)
    assert max_relative_row_error(chunked, copies) <= 1e-12
    # The network has 2 cells, both reduction cells: alpha_normal is unused and its rows are exactly zero.
    assert torch.count_nonzero(copies[:, :model.alpha_normal.numel()]) == 0
    assert torch.count_nonzero(copies[:, model.alpha_normal.numel():]) > 0
    changed = per_sample_gradients(model, alphas, perturb_others(inputs), targets, method="hooks")
    assert torch.allclose(changed[0], copies[0], rtol=1e-12, atol=0)
    assert not torch.allclose(changed[1], copies[1], rtol=1e-3)


def test_per_sample_gradients_reject_reduced_loss_and_unknown_names():
    model = TinyConvNet()
    inputs, targets = image_batch(3, 8, 5)
    params = dict(model.named_parameters())
    for method in ("vmap", "hooks"):
        with pytest.raises(ValueError, match="one loss per example"):
            per_sample_gradients(model, params, inputs, targets, F.cross_entropy, method=method)
    with pytest.raises(KeyError):
        per_sample_gradients(model, {"nope": torch.zeros(1)}, inputs, targets)
    with pytest.raises(ValueError, match="method='hooks'"):
        search = small_search_network()
        search.per_example_parameters = ()  # alphas the forward cannot take per example: no owner, no copies
        per_sample_gradients(search, dict(search.named_alphas()), *image_batch(2, 16, 10), method="hooks")


def test_per_sample_gradients_of_empty_batch():
    model = TinyConvNet()
    empty = per_sample_gradients(model, dict(model.named_parameters()), torch.zeros(0, 3, 8, 8), torch.zeros(0))
    assert empty.shape == (0, sum(p.numel() for p in model.parameters()))


# -- clipping -------------------------------------------------------------------------------------------------


def test_clipping_bounds_every_row_and_keeps_small_rows():
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 0.5, 0.99, 1.0, 3.0, 1e3, 1e6])[:, None]
    grads = torch.randn(7, 500, generator=gen)
    grads = grads / grads.norm(dim=1, keepdim=True) * scales
    bound = 1.0
    clipped = clip_per_sample(grads, bound)
    assert float(clipped.norm(dim=1).max()) <= bound + 1e-6
    small = scales[:, 0] <= bound
    assert torch.allclose(clipped[small], grads[small])  # inside the ball: unchanged
    # Outside: rescaled onto the sphere, same direction (g / max(1, ||g|| / R)).
    big = ~small
    assert torch.allclose(clipped[big].norm(dim=1), torch.full((int(big.sum()),), bound), atol=1e-6)
    cosine = F.cosine_similarity(clipped[big], grads[big], dim=1)
    assert torch.allclose(cosine, torch.ones_like(cosine), atol=1e-6)


def test_clipped_sum_sensitivity_on_the_search_network():
    """Removing any one example changes the pre-noise sum by at most R, on real per-example gradients."""
    model = small_search_network()
    inputs, targets = image_batch(8, 16, 10)
    grads = per_sample_gradients(model, dict(model.named_weights()), inputs, targets)
    bound = 0.01  # the paper's R^G; every example's gradient is far larger, so every row is clipped
    assert float(grads.norm(dim=1).min()) > bound
    assert float(clip_per_sample(grads, bound).norm(dim=1).max()) <= bound + 1e-6
    total = clipped_sum(grads, bound)
    for i in range(grads.shape[0]):
        without_i = clipped_sum(torch.cat([grads[:i], grads[i + 1 :]]), bound)
        assert float((total - without_i).norm()) <= bound + 1e-6


def test_non_finite_example_contributes_nothing():
    grads = torch.ones(3, 4)
    grads[1, 2] = float("nan")
    grads[2, 0] = float("inf")
    clipped = clip_per_sample(grads, 1.0)
    assert torch.isfinite(clipped).all()
    assert torch.equal(clipped[1], torch.zeros(4)) and torch.equal(clipped[2], torch.zeros(4))
    assert torch.allclose(clipped_sum(grads, 1.0), torch.full((4,), 0.5))


def test_clipped_sum_of_no_examples_is_zero():
    assert torch.equal(clipped_sum(torch.zeros(0, 7), 0.1), torch.zeros(7))


# -- the release ----------------------------------------------------------------------------------------------


def assert_iid_normal(samples: torch.Tensor, std: float) -> None:
    """Mean, variance (chi-square CI from the sample size) and shape (KS) of zero-mean normal samples."""
    x = samples.double().numpy()
    n = x.size
    z = stats.norm.ppf(1 - ALPHA / 2)
    chi2 = np.sum((x - x.mean()) ** 2) / std**2
    low, high = stats.chi2.ppf(ALPHA / 2, n - 1), stats.chi2.ppf(1 - ALPHA / 2, n - 1)
    assert low <= chi2 <= high, f"sample std {math.sqrt(chi2 / (n - 1)) * std} vs configured {std}"
    assert abs(x.mean()) <= z * std / math.sqrt(n), f"mean {x.mean()} too far from 0"
    assert stats.kstest(x / std, "norm").pvalue > ALPHA


def weights_release(model: SearchNetwork, inputs: torch.Tensor, targets: torch.Tensor, clip: float, sigma: float,
                    expected_batch: float, stream: Keystream) -> torch.Tensor:
    """party_release of all of `model`'s weights W on (inputs, targets), its noise from `stream`."""
    return party_release(
        model,
        dict(model.named_weights()),
        inputs,
        targets,
        clip_bound=clip,
        noise_multiplier=sigma,
        expected_batch_size=expected_batch,
        noise_stream=stream,
    )


def test_release_noise_has_configured_std_and_zero_mean():
    torch.manual_seed(0)
    model = SearchNetwork(8, 10, 3, nodes=2, norm="groupnorm")  # ~10^5 weights: ~10^5 noise samples
    params = dict(model.named_weights())
    inputs, targets = image_batch(10, 16, 10)
    clip, sigma, expected_batch = 0.01, 1.3, 64.0
    release = weights_release(model, inputs, targets, clip, sigma, expected_batch, Keystream.from_os())
    signal = clipped_sum(per_sample_gradients(model, params, inputs, targets), clip) / expected_batch
    assert release.shape == signal.shape and release.shape[0] > 50_000
    assert_iid_normal(release - signal, sigma * clip / expected_batch)


def test_release_divides_by_expected_not_realised_batch_size():
    """release * B - (noise from the same seed) is exactly the clipped sum, for a batch of 5 and B = 64."""
    model = small_search_network()
    params = dict(model.named_weights())
    inputs, targets = image_batch(5, 16, 10)
    clip, sigma, expected_batch = 0.05, 0.7, 64.0
    release = weights_release(model, inputs, targets, clip, sigma, expected_batch, Keystream.from_labels("test", 9))
    noise = gaussian_noise(release.numel(), std=sigma * clip, stream=Keystream.from_labels("test", 9))
    total = clipped_sum(per_sample_gradients(model, params, inputs, targets), clip)
    assert torch.allclose(release * expected_batch - noise, total, atol=1e-6)
    # The realised size would give a visibly different vector (5 != 64): this check has teeth.
    assert not torch.allclose(release * inputs.shape[0] - noise, total, atol=1e-6)


def test_empty_batch_release_is_pure_noise_over_expected_batch():
    model = small_search_network()
    clip, sigma, expected_batch = 0.01, 1.0, 32.0
    release = weights_release(model, torch.zeros(0, 3, 16, 16), torch.zeros(0, dtype=torch.int64), clip, sigma,
                              expected_batch, Keystream.from_labels("test", 4))
    noise = gaussian_noise(release.numel(), std=sigma * clip, stream=Keystream.from_labels("test", 4))
    assert torch.equal(release, noise / expected_batch)
    assert_iid_normal(release, sigma * clip / expected_batch)


def test_secret_noise_is_normal_and_not_reproducible(monkeypatch):
    """The noise of a secret stream is N(0, std²) keyed by all 32 bytes the OS gave: the same OS bytes give the same
    noise (the key is those bytes, nothing else), a change in the last byte alone gives other noise, and two fresh
    streams differ in (almost) every draw, also shifted by a few draws (not one stream read at two offsets)."""
    a = gaussian_noise(200_000, std=0.3, stream=Keystream.from_os())
    b = gaussian_noise(200_000, std=0.3, stream=Keystream.from_os())
    assert_iid_normal(a, 0.3)
    for shift in range(4):  # equal float32 draws of independent streams: far below 1 expected in 200_000
        equal = int((a[shift:] == b[:b.numel() - shift]).sum()) + int((b[shift:] == a[:a.numel() - shift]).sum())
        assert equal < 10, f"two secret streams agree at {equal} draws, shifted by {shift}"

    requested: list[int] = []

    def noise_with_os_bytes(entropy: bytes) -> torch.Tensor:
        with monkeypatch.context() as patch:
            patch.setattr(os, "urandom", lambda n: requested.append(n) or entropy[:n])
            stream = Keystream.from_os()
        assert stream.secret
        return gaussian_noise(1000, std=0.3, stream=stream)

    entropy = bytes(range(7, 7 + KEY_BYTES))
    noise = noise_with_os_bytes(entropy)
    assert requested == [KEY_BYTES], f"a secret key asked the OS for {requested} bytes, not {KEY_BYTES}"
    assert torch.equal(noise_with_os_bytes(entropy), noise), "the same OS bytes gave other noise"
    assert torch.equal(gaussian_noise(1000, std=0.3, stream=Keystream(entropy, secret=True)), noise), \
        "the key of a secret stream is not the bytes the OS gave"
    changed = noise_with_os_bytes(entropy[:-1] + bytes([entropy[-1] ^ 1]))
    assert int((changed != noise).sum()) > 990, "the last byte the OS gave does not key the noise"


# -- the noise sampler: exact far into the tail ---------------------------------------------------------------
#
# A sampler whose largest output is m leaks: an output beyond m sigma is impossible without the canary, so delta
# is at least P(|N(0,1)| > m) per coordinate. torch.randn in float32 has m = 5.77 (1.6e-8 per coordinate, 4.6e-5 on a
# whole W release of configs/cifar10_dpfnas.yaml). Brute force at 5.8 sigma needs ~3e9 draws; instead:
#
# 1. the transform's tail is counted EXACTLY over all 2^53 inputs (bisection: |z| is monotone in the input),
#    deterministic and with no sampling error, at 5.8 to 8 sigma;
# 2. gaussian_noise is that transform of the stream's 53-bit integers, bit for bit (the old torch.randn path
#    fails here), times std, cast last;
# 3. those integers are uniform on all 53 bits (per-bit frequencies, byte patterns), from a secret stream and a
#    public one;
# 4. a moderate brute-force check of the whole path at 4 and 4.5 sigma (8e6 draws).
# 1-3 make the rate beyond 5.8 sigma the Gaussian one up to 2^-52 absolute; 4 checks the assembly end to end.


def transform_tail_count(threshold: float) -> int:
    """#{k in [0, 2^52): |standard_normal_from_bits(2k)| > threshold}, i.e. the sampler's ``P(|z| > t) 2^52``.

    Bit 0 is the sign and |z| decreases in k, so the count is the first k with |z| <= threshold (bisection).
    """

    def magnitude(k: int) -> float:
        return abs(float(standard_normal_from_bits(torch.tensor([2 * k], dtype=torch.int64))[0]))

    lo, hi = 0, 2**52 - 1
    assert magnitude(lo) > threshold >= magnitude(hi)
    while hi - lo > 1:  # invariant: magnitude(lo) > threshold >= magnitude(hi)
        middle = (lo + hi) // 2
        if magnitude(middle) > threshold:
            lo = middle
        else:
            hi = middle
    return hi


@pytest.mark.parametrize("threshold", [5.8, 6.5, 7.0, 7.5, 8.0])
def test_noise_transform_has_the_exact_gaussian_tail(threshold):
    """Step 1: P(|z| > t) of the transform over uniform 53-bit inputs equals erfc(t / sqrt 2) to one input (2^-52)."""
    count = transform_tail_count(threshold)
    expected = special.erfc(threshold / math.sqrt(2.0)) * 2.0**52  # 2 Phi(-t) 2^52, from erfc, not from ndtri
    assert abs(count - expected) <= 1.0, f"{count} inputs beyond {threshold} sigma, Gaussian {expected:.3f}"


def test_noise_transform_is_monotone_symmetric_and_bounded():
    """What the bisection of step 1 relies on, plus the sign bit: |z| decreasing in k, z(2k + 1) = -z(2k)."""
    for start in (0, 2**20, 2**40, 2**52 - 2**16):
        k = torch.arange(start, start + 2**16, dtype=torch.int64)
        z = standard_normal_from_bits(2 * k)
        assert z.dtype == torch.float64 and bool((z < 0).all())
        assert bool((z[1:] > z[:-1]).all()), f"not strictly increasing near k = {start}"
        assert torch.equal(standard_normal_from_bits(2 * k + 1), -z)
    extremes = standard_normal_from_bits(torch.tensor([0, 1, 2**53 - 2, 2**53 - 1]))
    assert float(extremes.abs().max()) == pytest.approx(-special.ndtri(2.0**-54), rel=1e-12)  # 8.29
    assert float(extremes[2:].abs().max()) < 1e-15  # the cells next to the median


def test_gaussian_noise_is_the_transform_of_the_streams_53_bit_integers():
    """Step 2: the release noise is the exact transform of the stream's 53-bit integers (``Keystream.bits``),
    scaled: the top 53 bits of each 64-bit little-endian word of the AES-CTR stream."""
    size, std = 10_000, 0.7
    words = np.frombuffer(Keystream.from_labels("test", 5).random_bytes(8 * size), dtype="<u8")
    bits = torch.from_numpy((words >> np.uint64(11)).astype(np.int64))
    expected = standard_normal_from_bits(bits) * std
    noise64 = gaussian_noise(size, std=std, stream=Keystream.from_labels("test", 5), dtype=torch.float64)
    assert torch.equal(noise64, expected)
    noise32 = gaussian_noise(size, std=std, stream=Keystream.from_labels("test", 5))
    assert noise32.dtype == torch.float32 and torch.equal(noise32, expected.float())  # cast after scaling
    assert torch.equal(Keystream.from_labels("test", 5).bits(size), bits)


@pytest.mark.parametrize("secret", [False, True])
def test_uniform_bits_are_53_fair_independent_bits(secret):
    """Step 3: every one of the 53 bits is fair, and byte patterns at the top, middle and bottom are uniform."""
    n = 400_000
    bits = (Keystream.from_os() if secret else Keystream.from_labels("test", 2)).bits(n)
    assert bits.shape == (n,) and bits.dtype == torch.int64
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**53
    ones = torch.stack([torch.bitwise_and(torch.bitwise_right_shift(bits, i), 1).sum() for i in range(53)])
    low, high = stats.binom.interval(1 - ALPHA / 53, n, 0.5)
    assert bool(((ones >= low) & (ones <= high)).all()), f"bit frequencies {(ones / n).tolist()}"
    for shift in (0, 24, 45):  # bits 0-7, 24-31 (above a float32 mantissa), 45-52 (the top)
        cells = torch.bincount(torch.bitwise_and(torch.bitwise_right_shift(bits, shift), 255), minlength=256)
        assert stats.chisquare(cells.numpy()).pvalue > ALPHA / 3, f"byte at bit {shift} not uniform"


@pytest.mark.parametrize("secret", [False, True])
def test_noise_tail_frequencies_at_4_and_4_5_sigma(secret):
    """Step 4: 8e6 draws of the whole path; counts beyond 4 and 4.5 std (~506 and ~54) in Binomial intervals."""
    std, chunk, chunks = 2.0, 2_000_000, 4
    stream = Keystream.from_os() if secret else Keystream.from_labels("test", 8)
    beyond = {4.0: 0, 4.5: 0}
    for _ in range(chunks):
        z = gaussian_noise(chunk, std=std, stream=stream, dtype=torch.float64).abs()
        for t in beyond:
            beyond[t] += int((z > t * std).sum())
    for t, count in beyond.items():
        low, high = stats.binom.interval(1 - ALPHA / 2, chunk * chunks, special.erfc(t / math.sqrt(2.0)))
        assert low <= count <= high, f"{count} draws beyond {t} sigma, expected {low:.0f}..{high:.0f}"


def test_release_argument_checks():
    grads = torch.ones(2, 3)
    ok = {"clip_bound": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 2.0}
    stream = Keystream.from_os()
    for key, bad in [("clip_bound", 0.0), ("noise_multiplier", 0.0), ("expected_batch_size", -1.0)]:
        with pytest.raises(ValueError, match=key):
            privatize_per_sample_gradients(grads, **{**ok, key: bad}, noise_stream=stream)


def test_release_refuses_batchnorm_model():
    model = small_search_network(norm="batchnorm")
    inputs, targets = image_batch(4, 16, 10)
    with pytest.raises(PrivacyError, match=r"space\.norm: groupnorm"):
        weights_release(model, inputs, targets, 0.01, 1.0, 4.0, Keystream.from_os())


# -- validators -----------------------------------------------------------------------------------------------


def test_batchnorm_is_refused_naming_the_module():
    with pytest.raises(PrivacyError) as info:
        check_model_for_dp(small_search_network(norm="batchnorm"))
    message = str(info.value)
    assert "'stem.1'" in message and "BatchNorm2d" in message
    assert "space.norm: groupnorm" in message and "per-example clipping" in message.lower()
    with pytest.raises(PrivacyError, match="'1'"):
        check_model_for_dp(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, track_running_stats=False)))
    with pytest.raises(PrivacyError, match="track_running_stats"):
        check_model_for_dp(nn.Sequential(nn.InstanceNorm2d(3, track_running_stats=True)))


def test_per_example_models_are_accepted():
    check_model_for_dp(small_search_network(norm="groupnorm"))
    check_model_for_dp(TinyConvNet())
    check_model_for_dp(nn.Sequential(nn.InstanceNorm2d(3), nn.LayerNorm(3)))


def test_batchnorm_really_mixes_examples():
    """Why the refusal: under BatchNorm, example 0's gradient changes when only example 1 changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    inputs, targets = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    params = {n: p for n, p in model.named_parameters() if not n.startswith("1.")}  # the two Linear layers
    before = per_sample_gradients(model, params, inputs, targets, method="hooks")
    changed = inputs.clone()
    changed[1] += 5.0
    after = per_sample_gradients(model, params, changed, targets, method="hooks")
    assert not torch.allclose(before[0], after[0], atol=1e-4)


def test_second_order_is_refused_under_dp():
    check_dp_search_options("first_order")
    with pytest.raises(PrivacyError, match="Hessian term reads the train shard"):
        check_dp_search_options("second_order")


# -- passes (runtime.max_physical_batch) --------------------------------------------------------------------------


def test_physical_batches_are_equal_consecutive_passes_covering_every_example_once():
    assert physical_batches(0, 4) == [] and physical_batches(7, None) == [slice(0, 7)]
    for count, limit in itertools.product(range(40), (1, 3, 8, 16)):
        passes = physical_batches(count, limit)
        sizes = [part.stop - part.start for part in passes]
        assert sum(sizes) == count and all(1 <= size <= limit for size in sizes)
        assert [part.start for part in passes] == list(itertools.accumulate([0, *sizes[:-1]]))[: len(passes)]
        if count:  # as few passes as the limit allows, their sizes one apart at most
            assert len(passes) == -(-count // limit) and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="at least 1 example"):
        physical_batches(3, 0)


@pytest.mark.parametrize("limit", [1, 3, 7])
def test_a_release_in_passes_is_the_release_in_one_and_no_pass_exceeds_the_limit(limit):
    model = small_search_network()
    inputs, targets = image_batch(10, 16, 10)
    # A clip far below every example's norm: each example is clipped on its own, so clipping a pass's sum, or
    # dividing a pass by its size, would visibly change the release.
    assert bool((per_sample_gradients(model, dict(model.named_weights()), inputs, targets).norm(dim=1) > 0.05).all())
    passes: list[int] = []
    model.register_forward_pre_hook(lambda module, args: passes.append(int(args[0].shape[0])))

    def release(max_physical_batch):
        return party_release(model, dict(model.named_weights()), inputs, targets, clip_bound=0.01,
                             noise_multiplier=0.5, expected_batch_size=8.0,
                             noise_stream=Keystream.from_labels("test", 5), max_physical_batch=max_physical_batch)

    whole = release(None)
    assert passes == [10]
    passes.clear()
    split = release(limit)
    assert sum(passes) == 10 and max(passes) <= limit and len(passes) == -(-10 // limit)
    assert torch.allclose(split, whole, rtol=1e-5, atol=1e-7)


def test_passes_keep_an_empty_batch_pure_noise_and_drop_a_non_finite_example_as_one_pass_does():
    model = small_search_network()
    params = dict(model.named_weights())

    def release(inputs, targets, max_physical_batch):
        return party_release(model, params, inputs, targets, clip_bound=0.05, noise_multiplier=0.5,
                             expected_batch_size=8.0, noise_stream=Keystream.from_labels("edge", 2),
                             max_physical_batch=max_physical_batch)

    empty = release(torch.zeros(0, 3, 16, 16), torch.zeros(0, dtype=torch.int64), 3)
    noise = gaussian_noise(empty.numel(), std=0.5 * 0.05, stream=Keystream.from_labels("edge", 2))
    assert torch.equal(empty, noise / 8.0)
    inputs, targets = image_batch(7, 16, 10)
    poisoned = inputs.clone()
    poisoned[5] = float("inf")  # in the last pass of 3, 2, 2: its gradient is not finite and is dropped
    without = release(torch.cat([inputs[:5], inputs[6:]]), torch.cat([targets[:5], targets[6:]]), None)
    for limit in (None, 3):
        split = release(poisoned, targets, limit)
        assert torch.isfinite(split).all() and torch.allclose(split, without, rtol=1e-5, atol=1e-7)


def test_a_secure_release_in_passes_is_the_release_in_one():
    model = small_search_network()
    params = dict(model.named_weights())
    inputs, targets = image_batch(9, 16, 10)
    dimension = sum(p.numel() for p in params.values())
    encoding = Encoding(dimension, clip=0.01, scale=0.01 / 3000)

    def release(max_physical_batch):
        return secure_party_release(model, params, inputs, targets, encoding=encoding,
                                    signs=rotation_signs(dimension, "run", "search", "W", 1), local_variance=100,
                                    rounding_stream=Keystream.from_labels("round", 1),
                                    noise_stream=Keystream.from_labels("noise", 1),
                                    max_physical_batch=max_physical_batch)

    whole = release(None)
    assert whole.dtype == torch.int64 and torch.equal(release(2), whole)
    # The encoding resolves far below one example's clipped gradient: a pass lost would show.
    assert not torch.equal(secure_party_release(model, params, inputs[:8], targets[:8], encoding=encoding,
                                                signs=rotation_signs(dimension, "run", "search", "W", 1),
                                                local_variance=100, rounding_stream=Keystream.from_labels("round", 1),
                                                noise_stream=Keystream.from_labels("noise", 1)), whole)


class _SharedLinear(nn.Module):
    """A linear layer called twice (shared weights), then a conv-free head: its per-example gradient is the sum of
    both calls', which the layer-by-layer sum must form rather than take from one call's outer product."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x.flatten(1))))))


@pytest.mark.parametrize("network", ["scatter-linear", "cnn-tanh", "shared linear", "dpnas supernet A",
                                     "dpnas supernet W"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_layer_by_layer_clipped_sum_is_the_clipped_sum_of_the_per_example_rows(network, dtype):
    """hook_clipped_sum (a once-called linear layer by its outer product, ‖δ‖·‖x‖ and (c ⊙ δ)ᵀ x; every other layer's
    rows formed one layer at a time) against clipped_sum of the full (B, P) matrix, clips on and off, with a row that
    is not finite counting 0."""
    from mpi_fnas.privacy.per_sample import hook_clipped_sum, per_sample_gradients
    from mpi_fnas.space import build_handcrafted
    from mpi_fnas.space.dpnas import DpnasSearchNetwork

    torch.manual_seed(8)
    if network.startswith("dpnas"):
        net = DpnasSearchNetwork((4, 8), 4, nodes=2, in_channels=1)
        params = dict(net.named_alphas() if network.endswith("A") else net.named_weights())
        x = torch.randn(6, 1, 8, 8)
    elif network == "shared linear":
        net, x = _SharedLinear(), torch.randn(6, 6)
        params = dict(net.named_parameters())
    else:
        net = build_handcrafted(network, seed=0, in_channels=1, num_classes=4, image_size=16)
        x = torch.randn(6, 1, 16, 16)
        x = net.fixed_stem(x) if network.startswith("scatter") else x
        params = dict(net.named_parameters())
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    rows = per_sample_gradients(net, params, x, y, method="hooks").to(dtype)
    norms = rows.norm(dim=1)
    for bound in (float(norms.median()), float(norms.max()) * 2):  # half the rows clipped; none
        expected = clipped_sum(rows, bound)
        got = hook_clipped_sum(net, params, x, y, bound, dtype=dtype)
        assert got.dtype == dtype and got.shape == expected.shape
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6), (network, bound)
    x_bad = x.clone()
    x_bad[2] = float("nan")
    keep = [0, 1, 3, 4, 5]
    assert torch.allclose(hook_clipped_sum(net, params, x_bad, y, 1.0, dtype=dtype),
                          hook_clipped_sum(net, params, x[keep], y[keep], 1.0, dtype=dtype), rtol=1e-4, atol=1e-6)
    assert torch.equal(hook_clipped_sum(net, params, x[:0], y[:0], 1.0, dtype=dtype),
                       torch.zeros(rows.shape[1], dtype=dtype))


def test_a_linear_layers_outer_product_never_forms_its_per_example_gradients(monkeypatch):
    """The linear layer of a ScatterNet (the release's largest part) is summed from δ and x alone."""
    from mpi_fnas.privacy import layer_grads
    from mpi_fnas.privacy.per_sample import hook_clipped_sum
    from mpi_fnas.space import build_handcrafted

    formed: list[type] = []
    real = layer_grads.layer_per_example_grads
    monkeypatch.setattr(layer_grads, "layer_per_example_grads",
                        lambda module, *args: formed.append(type(module)) or real(module, *args))
    net = build_handcrafted("scatter-linear", seed=0, in_channels=1, num_classes=10, image_size=28)
    x = net.fixed_stem(torch.randn(4, 1, 28, 28))
    hook_clipped_sum(net, dict(net.named_parameters()), x, torch.tensor([1, 2, 3, 4]), 0.1)
    assert formed == []
