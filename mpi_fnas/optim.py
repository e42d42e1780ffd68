"""The server's optimizers of one flat float32 parameter vector: SGD (momentum, weight decay) and Adam.

Why not ``torch.optim``: building any torch optimizer imports ``torch._dynamo`` (``add_param_group`` is wrapped by
``torch._disable_dynamo``), 1.3 s of CPU on rank 0 before its first step, on the path every party waits on. These
two take the same tensor operations in the same order as torch's single-tensor CPU path (torch 2.x ``_single_tensor_
sgd`` / ``_single_tensor_adam``, no nesterov, dampening or amsgrad), so their steps are bit-for-bit torch's
(tests/test_optim.py), and their ``state_dict`` has torch's layout, so checkpoints load either way.
"""

from __future__ import annotations

import torch
from torch import nn


class FlatSGD:
    """``torch.optim.SGD([param], lr, momentum, weight_decay)`` for one parameter (n,)."""

    def __init__(self, param: nn.Parameter, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.param = param
        self.param_groups = [{"lr": lr, "momentum": momentum, "dampening": 0, "weight_decay": weight_decay,
                              "nesterov": False, "maximize": False, "params": [0]}]
        self.momentum_buffer: torch.Tensor | None = None

    @torch.no_grad()
    def step(self) -> None:
        """param ← param − lr·(buffer ← momentum·buffer + (g + wd·param)); the first buffer is g + wd·param."""
        group = self.param_groups[0]
        grad = self.param.grad
        if group["weight_decay"] != 0:
            grad = grad.add(self.param, alpha=group["weight_decay"])
        if group["momentum"] != 0:
            if self.momentum_buffer is None:
                self.momentum_buffer = grad.detach().clone()
            else:
                self.momentum_buffer.mul_(group["momentum"]).add_(grad, alpha=1)
            grad = self.momentum_buffer
        self.param.add_(grad, alpha=-group["lr"])

    def state_dict(self) -> dict:
        """The optimizer's state in ``torch.optim.SGD``'s layout (momentum buffer, learning rate), for checkpoints."""
        return {"state": {0: {"momentum_buffer": self.momentum_buffer}}, "param_groups": [dict(self.param_groups[0])]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by :meth:`state_dict`."""
        self.param_groups[0]["lr"] = state["param_groups"][0]["lr"]
        buffer = state["state"].get(0, {}).get("momentum_buffer")
        self.momentum_buffer = buffer.clone() if buffer is not None else None


class FlatAdam:
    """``torch.optim.Adam([param], lr, betas, eps, weight_decay)`` (L2 weight decay, not AdamW) for one parameter."""

    def __init__(self, param: nn.Parameter, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.param = param
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": False,
                              "maximize": False, "params": [0]}]
        self.steps = 0
        self.exp_avg = torch.zeros_like(param, memory_format=torch.preserve_format)
        self.exp_avg_sq = torch.zeros_like(param, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self) -> None:
        """Kingma & Ba's step with bias correction, torch's operation order."""
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        grad = self.param.grad
        self.steps += 1
        if group["weight_decay"] != 0:
            grad = grad.add(self.param, alpha=group["weight_decay"])
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = float(self.steps)
        step_size = group["lr"] / (1 - beta1**step)
        denom = (self.exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        self.param.addcdiv_(self.exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict:
        """The optimizer's state in ``torch.optim.Adam``'s layout (step, moments, learning rate), for checkpoints."""
        return {"state": {0: {"step": torch.tensor(float(self.steps)), "exp_avg": self.exp_avg,
                              "exp_avg_sq": self.exp_avg_sq}},
                "param_groups": [dict(self.param_groups[0])]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by :meth:`state_dict`."""
        self.param_groups[0]["lr"] = state["param_groups"][0]["lr"]
        saved = state["state"].get(0)
        if saved:  # torch leaves the state empty before the first step
            self.steps = int(saved["step"])
            self.exp_avg = saved["exp_avg"].clone()
            self.exp_avg_sq = saved["exp_avg_sq"].clone()
