"""The server's flat optimizers take torch's steps bit for bit, and their checkpoints load either way."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpi_fnas.optim import FlatAdam, FlatSGD

CASES = [
    ("sgd", {"lr": 0.025, "momentum": 0.9, "weight_decay": 3e-4}),
    ("sgd", {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}),
    ("adam", {"lr": 6e-4, "betas": (0.5, 0.999), "weight_decay": 1e-3}),
    ("adam", {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.0}),
]


def _pair(kind: str, settings: dict, n: int = 257) -> tuple:
    start = torch.randn(n, generator=torch.Generator().manual_seed(5))
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    if kind == "sgd":
        return ours, FlatSGD(ours, **settings), theirs, torch.optim.SGD([theirs], **settings)
    return ours, FlatAdam(ours, **settings), theirs, torch.optim.Adam([theirs], **settings)


def _steps(pairs: tuple, count: int, seed: int, lr_change: bool = True) -> None:
    ours, our_opt, theirs, their_opt = pairs
    gen = torch.Generator().manual_seed(seed)
    for step in range(count):
        grad = torch.randn(ours.shape, generator=gen) * (10.0 ** (step % 3 - 1))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        if lr_change:  # the server sets each step's scheduled rate through param_groups
            our_opt.param_groups[0]["lr"] = their_opt.param_groups[0]["lr"] = 0.01 / (step + 1)
        our_opt.step()
        their_opt.step()


@pytest.mark.parametrize(("kind", "settings"), CASES)
def test_steps_equal_torch_bit_for_bit(kind, settings):
    pairs = _pair(kind, settings)
    _steps(pairs, 12, seed=1)
    assert torch.equal(pairs[0].data, pairs[2].data)
    assert not torch.equal(pairs[0].data, _pair(kind, settings)[0].data)  # the steps moved it


@pytest.mark.parametrize(("kind", "settings"), CASES)
def test_checkpoint_loads_either_way(kind, settings):
    pairs = _pair(kind, settings)
    ours, our_opt, theirs, their_opt = pairs
    _steps(pairs, 5, seed=2)
    # torch's state into ours, ours into torch: continuing both must still agree bit for bit
    fresh_ours, fresh_our_opt, fresh_theirs, fresh_their_opt = _pair(kind, settings)
    with torch.no_grad():
        fresh_ours.copy_(theirs)
        fresh_theirs.copy_(ours)
    fresh_our_opt.load_state_dict(copy.deepcopy(their_opt.state_dict()))  # as torch.save/torch.load hand it back
    fresh_their_opt.load_state_dict(copy.deepcopy(our_opt.state_dict()))
    _steps((fresh_ours, fresh_our_opt, fresh_theirs, fresh_their_opt), 4, seed=3, lr_change=False)
    _steps(pairs, 4, seed=3, lr_change=False)
    for tensor in (fresh_ours, fresh_theirs):
        assert torch.equal(tensor.data, ours.data)


def test_state_before_the_first_step_loads():
    param = nn.Parameter(torch.ones(3))
    adam = FlatAdam(param, lr=0.1)
    adam.load_state_dict(torch.optim.Adam([nn.Parameter(torch.ones(3))], lr=0.2).state_dict())
    assert adam.steps == 0 and adam.param_groups[0]["lr"] == 0.2
