"""No network of the project runs oneDNN's strided 1x1 weight gradient, which corrupts the heap on AVX2
CPUs (and on AVX-512 ones at larger inputs); the ISA oneDNN uses is known and logged.

The subprocess tests run the shapes that aborted (scripts/repro_onednn_avx2.py; docs/benchmarks.md, "heap
corruption on AVX2 CPUs") through the project's own network in a child process, so that a heap corruption fails
the test instead of killing the test run. Its runs pin ``ONEDNN_MAX_CPU_ISA=AVX2`` themselves; ``make test`` runs
the network-building tests once more under it (scripts/run_tests.sh), so that an AVX-512 machine exercises the AVX2
kernels too.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, TINY, mpirun
from pre_recipe import PRE_RECIPE
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpi_fnas.config import load_config
from mpi_fnas.cpu_kernels import aten_cpu_capability, cpu_model, onednn_isa, strided_pointwise_convs, to_channels_last
from mpi_fnas.privacy.per_sample import per_sample_gradients
from mpi_fnas.space import DARTS_V2, augment_loss, search_space
from mpi_fnas.space.ops import FactorizedReduce


def loss(outputs, targets):
    """Per-example loss of either network (the augment network's auxiliary head included)."""
    return augment_loss(outputs, targets, 0.4)


class ConvRecorder(TorchDispatchMode):
    """Records (kernel size, stride, weight gradient asked) of every convolution and convolution backward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.calls.append((tuple(args[1].shape[2:]), tuple(args[3]), False))
        elif func is torch.ops.aten.convolution_backward.default:
            self.calls.append((tuple(args[2].shape[2:]), tuple(args[4]), bool(args[10][1])))
        return func(*args, **(kwargs or {}))

    def strided_pointwise_weight_grads(self) -> list:
        return [c for c in self.calls if c[0] == (1, 1) and any(s != 1 for s in c[1]) and c[2]]


def _networks():
    """Every kind of network the project trains, with reduction cells (FactorizedReduce) and the auxiliary head."""
    cfg = load_config(None, [*PRE_RECIPE, "space.channels=4", "space.layers=3", "space.nodes=2", "augment.channels=4",
                             "augment.layers=3", "augment.auxiliary_weight=0.4"])
    darts = search_space("darts")
    yield "darts supernet", darts.build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10)
    yield "darts augment", darts.build_augment_network(DARTS_V2, cfg, seed=0, in_channels=3, num_classes=10)
    dpnas_cfg = load_config(None, [*PRE_RECIPE, "space.kind=dpnas", "space.stage_channels=[4,8,8]", "space.nodes=2"])
    dpnas = search_space("dpnas")
    yield "dpnas supernet", dpnas.build_supernet(dpnas_cfg.space, seed=0, in_channels=3, num_classes=10)
    genotype = dpnas.random_genotype(dpnas_cfg.space, np.random.default_rng(0))
    yield "dpnas augment", dpnas.build_augment_network(genotype, dpnas_cfg, seed=0, in_channels=3, num_classes=10)


@pytest.mark.parametrize("name", ["darts supernet", "darts augment", "dpnas supernet", "dpnas augment"])
def test_no_network_asks_for_a_strided_pointwise_weight_gradient(name):
    """Every convolution the forward, the backward and the per-example gradients run, recorded below the autograd
    engine: none is a 1x1 convolution of stride 2 whose weight gradient is asked (the kernel that corrupted the
    heap)."""
    model = to_channels_last(dict(_networks())[name])
    model.train()
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (4,))
    recorder = ConvRecorder()
    with recorder:
        torch.autograd.grad(loss(model(x), y).sum(), list(model.parameters()))
        per_sample_gradients(model, dict(model.named_parameters()), x, y, loss, method="hooks")
    assert recorder.calls, "no convolution recorded: the recorder saw nothing"
    assert recorder.strided_pointwise_weight_grads() == []
    assert strided_pointwise_convs(model) == []


def test_recorder_sees_a_strided_pointwise_weight_gradient():
    """The recorder above does catch the kernel: a plain ``Conv2d(4, 8, 1, stride=2)`` asks for it."""
    conv = nn.Conv2d(4, 8, 1, stride=2, bias=False)
    recorder = ConvRecorder()
    with recorder:
        torch.autograd.grad(conv(torch.randn(2, 4, 8, 8)).sum(), [conv.weight])
    assert recorder.strided_pointwise_weight_grads() == [((1, 1), (2, 2), True)]


def test_to_channels_last_refuses_a_strided_pointwise_convolution():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 8, 1, stride=2))
    with pytest.raises(ValueError, match=r"1x1 convolutions of stride > 1 \(1\).*oneDNN#6035"):
        to_channels_last(model)
    fine = to_channels_last(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, stride=2), nn.Conv2d(4, 8, 1)))
    assert fine[0].weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("side", [7, 8])
def test_factorized_reduce_equals_darts_strided_convolutions(side):
    """FactorizedReduce's sliced stride-1 convolutions are DARTS' two 1x1 stride-2 convolutions (the odd branch on
    the input shifted by one pixel, zero-padded), in float64, even and odd sides."""
    torch.manual_seed(0)
    op = FactorizedReduce(4, 8, "groupnorm", affine=True).double()
    x = torch.randn(3, 4, side, side, dtype=torch.float64)
    relu = F.relu(x)
    shifted = F.pad(relu, (0, 1, 0, 1))[:, :, 1:, 1:]
    expected = op.norm(torch.cat([F.conv2d(relu, op.conv_even.weight, stride=2),
                                  F.conv2d(shifted, op.conv_odd.weight, stride=2)], dim=1))
    torch.testing.assert_close(op(x), expected, rtol=0, atol=1e-12)


def _child(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


# The shapes that aborted (space.channels=4, 8x8) through the project's supernet, channels-last as a party
# computes, then the last step's gradient against the same network's in float64 (no oneDNN kernel), which also
# catches a silently wrong gradient.
NETWORK_STEPS = """
    import torch, torch.nn.functional as F
    torch.set_num_threads(1)
    from mpi_fnas.config import load_config
    from mpi_fnas.cpu_kernels import onednn_isa, to_channels_last
    from mpi_fnas.space import search_space
    cfg = load_config(None, ["space.kind=darts", "space.ops=[]", "space.channels=4", "space.layers=3", "space.nodes=1"])
    model = to_channels_last(search_space("darts").build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10))
    reference = search_space("darts").build_supernet(cfg.space, seed=0, in_channels=3, num_classes=10).double()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        x = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (4,), generator=g)
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    expected = torch.autograd.grad(F.cross_entropy(reference(x.double()), y), list(reference.parameters()))
    error = max((a.double() - b).abs().max().item() for a, b in zip(grads, expected))
    assert error < 1e-4, error
    print("ok", onednn_isa(), error)
"""


def test_reproducer_shapes_through_the_supernet_under_avx2():
    """Aborted in 2 of 2 runs (glibc: corrupted size vs. prev_size) with DARTS' strided FactorizedReduce."""
    done = _child(NETWORK_STEPS, {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok Intel AVX2"), done.stdout


# The AVX-512 kernel overflows too once the input is large enough (64x64, fewer than 16 channels): the project's
# FactorizedReduce at that size, channels-last, with the machine's own ISA.
FACTORIZED_REDUCE_STEPS = """
    import torch
    torch.set_num_threads(1)
    from mpi_fnas.cpu_kernels import to_channels_last
    from mpi_fnas.space.ops import FactorizedReduce
    torch.manual_seed(0)
    op = to_channels_last(FactorizedReduce(4, 8, "groupnorm", affine=False))
    weights = torch.randn(32, 8, 32, 32)  # a fixed linear function of the normalised output
    for _ in range(30):
        x = torch.randn(32, 4, 64, 64).contiguous(memory_format=torch.channels_last)
        grads = torch.autograd.grad((op(x) * weights).sum(), list(op.parameters()))
    expected = torch.autograd.grad((op.double()(x.double()) * weights).sum(), list(op.parameters()))
    error = max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, expected))
    assert error < 1e-4, error
    print("ok", error)
"""


def test_factorized_reduce_at_a_large_input_with_the_machine_isa():
    """SIGSEGV on AVX-512 (and AVX2) with DARTS' strided convolutions."""
    done = _child(FACTORIZED_REDUCE_STEPS, {})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok"), done.stdout


def test_onednn_isa_follows_onednn_max_cpu_isa():
    """The ISA comes from oneDNN itself: ``ONEDNN_MAX_CPU_ISA=AVX2`` gives AVX2 whatever the CPU; ATen's own
    capability does not follow that variable."""
    done = _child("from mpi_fnas.cpu_kernels import onednn_isa as f; print(f()); print(f())",
                  {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Intel AVX2", "Intel AVX2"]  # the probe prints nothing of its own
    assert onednn_isa() not in ("unknown", "")
    assert aten_cpu_capability() in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "NEON", "SVE256")


def test_cpu_model_is_the_first_model_name_else_the_platforms(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t:  AMD   EPYC 9R14\n\n"
                       "processor\t: 1\nmodel name\t: Other\n")
    assert cpu_model(str(cpuinfo)) == "AMD EPYC 9R14"  # the first model, its spaces as one
    monkeypatch.setattr(platform, "processor", lambda: "x86_64-fallback")
    assert cpu_model(str(tmp_path / "absent")) == "x86_64-fallback"


@pytest.mark.slow
def test_a_private_run_under_avx2_logs_each_rank_isa(tmp_path):
    """One DP-FNAS run, search and augmentation (FactorizedReduce in both networks), every rank on the AVX2
    kernels: it finishes, and /ranks records the ISA of every rank."""
    done = mpirun(3, *TINY, "--set", "mode=dpfnas", "--set", "augment.epochs=1", "--set", "augment.layers=3",
                  "--set", "augment.channels=4", "--set", "augment.batch_size=8", "--out", str(tmp_path),
                  env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert done.returncode == 0, done.stderr[-3000:]
    with h5py.File(tmp_path / "search.h5", "r") as log:
        assert log.attrs["status"] == "finished"
        assert [str(v) for v in log["ranks"].attrs["onednn_isa"]] == ["Intel AVX2"] * 3
        assert len(log["ranks"].attrs["aten_cpu_capability"]) == 3
        assert [str(v) for v in log["ranks"].attrs["cpu_model"]] == [cpu_model()] * 3
