"""ADADP's step-size rule (mpi_fnas.federation.adadp): no MPI, no autograd.

The factor stays within [α_min, α_max]; on a noise-free quadratic η settles where err ≈ tol; the next iterate,
rejection and the server's two W rounds follow the settings; η survives a checkpoint exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pre_recipe import PRE_RECIPE

from mpi_fnas.config import ConfigError, load_config
from mpi_fnas.federation.adadp import AdadpSettings, AdadpStep, adadp_settings, relative_error, step_factor, w_rounds
from mpi_fnas.federation.global_model import Server, augment_server, search_server
from mpi_fnas.space import Genotype, build_augment_network, build_supernet


@pytest.mark.parametrize("factor", ["linear", "sqrt"])
def test_factor_stays_within_alpha_min_and_alpha_max(factor):
    settings = AdadpSettings(tol=1.0, factor=factor)
    errors = [0.0, 1e-12, 0.5, 0.95, 1.0, 1.05, 2.0, 1e12, math.inf, math.nan]
    factors = [step_factor(err, settings) for err in errors]
    assert all(0.9 <= f <= 1.1 for f in factors), factors
    assert factors[0] == 1.1 and factors[-3] == 0.9 and factors[-1] == 0.9  # no error grows, NaN shrinks
    assert factors[4] == 1.0
    inner = step_factor(1.05, settings)
    assert inner == pytest.approx(1 / 1.05 if factor == "linear" else math.sqrt(1 / 1.05))


def test_relative_error_is_the_papers_eq_6():
    full = np.array([0.5, -4.0, 2.0], dtype=np.float32)
    hat = np.array([0.25, -3.0, 2.0], dtype=np.float32)
    # e = (0.25 / 1, 1 / 4, 0): the coordinate above 1 in magnitude is relative, the other absolute
    assert relative_error(full, hat) == pytest.approx(math.hypot(0.25, 0.25))


def quadratic_gradient(w: np.ndarray) -> np.ndarray:
    """∇ of ½ Σ h_i w_i² with curvatures h = (1, 3, 10): an exact, noise-free gradient."""
    return np.array([1.0, 3.0, 10.0], dtype=np.float32) * w


def run_on_quadratic(settings: AdadpSettings, w: np.ndarray, lr: float, steps: int, *, move: bool
                     ) -> tuple[list[float], np.ndarray]:
    """ADADP on the quadratic; with `move` False W stays put (η adapts at a fixed point). Errors per step."""
    rule, errors = AdadpStep(settings, lr), []
    for _ in range(steps):
        w_half = rule.half(w, quadratic_gradient(w))
        w_next = rule.finish(w_half, quadratic_gradient(w_half))
        errors.append(rule.err)
        if move:
            w = w_next
    return errors, w


@pytest.mark.parametrize("lr", [1e-4, 0.05, 0.19])
def test_sqrt_factor_settles_eta_where_err_is_tol(lr):
    # Noise-free, err = c·η² (the Euler step's local error): the sqrt factor solves err = tol, within the clamp.
    tol = 1e-3
    w = np.array([3.0, -2.0, 0.5], dtype=np.float32)
    errors, _ = run_on_quadratic(AdadpSettings(tol=tol, factor="sqrt"), w, lr, 200, move=False)
    assert errors[-1] == pytest.approx(tol, rel=1e-3)
    assert abs(errors[0] - tol) > 0.05 * tol  # it did have to move


def test_linear_factor_settles_eta_where_err_is_tol_on_the_geometric_mean():
    # err ∝ η² makes tol/err overshoot: η alternates around the fixed point, with err·err' = tol² on the cycle.
    tol = 1e-3
    w = np.array([3.0, -2.0, 0.5], dtype=np.float32)
    errors, _ = run_on_quadratic(AdadpSettings(tol=tol, factor="linear"), w, 1e-4, 300, move=False)
    assert math.sqrt(errors[-1] * errors[-2]) == pytest.approx(tol, rel=1e-3)
    assert 0.8 * tol < min(errors[-10:]) and max(errors[-10:]) < 1.25 * tol


def test_moving_adadp_descends_the_quadratic_from_any_initial_step_size():
    w0 = np.array([3.0, -2.0, 0.5], dtype=np.float32)
    for lr in (1e-3, 0.1, 10.0):
        _, w = run_on_quadratic(AdadpSettings(tol=0.1, reject=True), w0, lr, 300, move=True)
        assert np.linalg.norm(w) < 1e-2 * np.linalg.norm(w0), (lr, w)


def test_next_iterate_and_rejection_follow_the_settings():
    w = np.array([1.0, -2.0], dtype=np.float32)
    g1, g2 = np.array([1.0, 1.0], dtype=np.float32), np.array([3.0, -1.0], dtype=np.float32)
    expected = {"extrapolated": w - 0.5 * g1 - 0.5 * g2, "full": w - 1.0 * g1}
    for name, want in expected.items():
        rule = AdadpStep(AdadpSettings(tol=10.0, next=name), lr=1.0)
        assert np.allclose(rule.finish(rule.half(w, g1), g2), want)
        assert rule.lr_used == 1.0 and rule.lr == pytest.approx(1.1)  # err 1.0·… < tol: η grows by α_max
    rejecting = AdadpStep(AdadpSettings(tol=1e-3, reject=True), lr=1.0)
    assert np.array_equal(rejecting.finish(rejecting.half(w, g1), g2), w)  # discarded: W stays
    assert rejecting.lr == pytest.approx(0.9)


def test_settings_defaults_follow_the_mode_and_momentum_is_refused():
    private = adadp_settings(load_config(None, [*PRE_RECIPE, "mode=dpfnas"]))
    plain = adadp_settings(load_config(None, [*PRE_RECIPE, "mode=fnas"]))
    assert (private.tol, private.reject) == (1.0, False) and (plain.tol, plain.reject) == (0.1, True)
    assert w_rounds("adadp") == 2 and w_rounds("sgd") == 1
    with pytest.raises(ConfigError, match=r"search\.w_momentum") as refused:
        load_config(None, [*PRE_RECIPE, "search.w_optimizer=adadp"])
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"^search\.order: second_order is refused with search\.w_optimizer"):
        load_config(None, [*PRE_RECIPE, "mode=fnas", "search.w_optimizer=adadp", "search.w_momentum=0",
                           "search.order=second_order"])
    # η₀ below search.w_lr_min is fine: ADADP has no cosine schedule
    tiny = load_config(None, [*PRE_RECIPE, "search.w_optimizer=adadp", "search.w_momentum=0", "search.w_lr=0.0001"])
    assert tiny.search.w_lr == 0.0001


GENOTYPE = ("normal=sep_conv_3x3@0,skip_connect@1;normal_concat=2;"
            "reduce=max_pool_3x3@0,avg_pool_3x3@1;reduce_concat=2")


@pytest.mark.parametrize("stage", ["search", "augment"])
def test_server_two_w_rounds_log_values_and_exact_resume(stage: str):
    """Either stage's server: W_half, then the next W from the mean of K = 2 releases; η adapts, the log values
    follow, and a state_dict resumes it exactly."""
    if stage == "search":
        cfg = load_config(None, [*PRE_RECIPE, "mode=fnas", "search.w_optimizer=adadp", "search.w_momentum=0",
                                 "space.channels=2",
                                 "space.layers=1", "space.nodes=1", "search.w_grad_clip=0", "search.w_weight_decay=0",
                                 "adadp.reject=false"])

        def server() -> Server:
            return search_server(build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10), cfg.search, 2,
                                 adadp=adadp_settings(cfg))
    else:
        cfg = load_config(None, [*PRE_RECIPE, "mode=fnas", "augment.optimizer=adadp", "augment.momentum=0",
                                 "augment.lr=0.1",
                                 "augment.grad_clip=0", "augment.weight_decay=0", "adadp.reject=false"])

        def server() -> Server:
            model = build_augment_network(Genotype.from_string(GENOTYPE), channels=4, layers=2, seed=0,
                                          in_channels=3, num_classes=10)
            return augment_server(model, cfg.augment, 2, steps=10, adadp=adadp_settings(cfg))

    first, rng = server(), np.random.default_rng(0)
    assert all(np.isnan(first.log_values()))  # no iteration yet
    w0, n = first.w_buffer.copy(), first.w.numel()
    g1, g2 = (rng.normal(size=n).astype(np.float32) for _ in range(2))
    first.adadp_half_step(g1)
    assert np.allclose(first.w_buffer, w0 - 0.05 * g1 / 2, atol=1e-6)  # W_half from the mean over K = 2
    first.adadp_full_step(g2)
    assert np.allclose(first.w_buffer, w0 - 0.05 * (g1 + g2) / 2, atol=1e-6)
    assert first.log_values() == (0.1, first.adadp.err) and first.adadp.err > 0
    assert 0.09 <= first.adadp.lr <= 0.11 and first.adadp.lr != 0.1
    state = first.state_dict()
    second = server()
    second.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    assert second.adadp.lr == first.adadp.lr and second.log_values() == first.log_values()
    for s in (first, second):
        s.adadp_half_step(g2)
        s.adadp_full_step(g1)
    assert np.array_equal(first.w_buffer, second.w_buffer) and first.adadp.lr == second.adadp.lr
