"""The parties' device path: what a party computes on MPI_FNAS_TEST_DEVICE (default cpu; cuda on a GPU machine, see
scripts/device_check.sh) equals what it computes on the CPU. The secret-looking draws are made on the CPU and moved,
so they are equal bit for bit; the gradients agree up to float rounding (TF32 off: the same precision on both)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from mpi_fnas.bench.party_step import make_party
from mpi_fnas.config import load_config
from mpi_fnas.data.augmentation import augment_images
from mpi_fnas.federation.flat import STATS
from mpi_fnas.federation.placement import select_device, visible_gpu_count
from mpi_fnas.federation.shard import Shard
from mpi_fnas.keystream import Keystream
from mpi_fnas.privacy.mechanism import gaussian_noise
from mpi_fnas.space.derived import drop_path_mask

TINY = ["space.kind=darts", "space.ops=[]", "space.channels=4", "space.layers=3", "space.nodes=1",
        "space.norm=groupnorm", "data.image_size=8", "search.batch_size=4"]


@contextlib.contextmanager
def full_float32():
    """TF32 off for matmuls and convolutions (a GPU's default for convolutions), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_the_device_is_the_one_asked_for_and_placement_agrees(torch_device):
    x = torch.zeros(2, device=torch_device)
    assert x.device.type == torch.device(torch_device).type
    gpus = visible_gpu_count()
    assert select_device(1, local_rank=1, visible_gpus=gpus) == ("cuda:0" if gpus else "cpu")
    if torch_device.startswith("cuda"):
        assert gpus >= 1 and select_device(1, local_rank=1, visible_gpus=gpus, preference="cuda") == "cuda:0"


def test_gaussian_noise_is_the_same_numbers_on_the_device(torch_device):
    on_cpu = gaussian_noise(10_000, std=0.7, stream=Keystream.from_labels("device", 1))
    there = gaussian_noise(10_000, std=0.7, stream=Keystream.from_labels("device", 1), device=torch_device)
    assert there.device.type == torch.device(torch_device).type
    assert torch.equal(there.cpu(), on_cpu)


def test_drop_path_mask_and_augmentation_are_the_same_on_the_device(torch_device):
    mask = drop_path_mask(500, 0.3, Keystream.from_labels("mask", 0), device=torch.device("cpu"), dtype=torch.float32)
    there = drop_path_mask(500, 0.3, Keystream.from_labels("mask", 0), device=torch.device(torch_device),
                           dtype=torch.float32)
    assert torch.equal(there.cpu(), mask)
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    kwargs = {"cutout": 3, "crop_padding": 2, "flip": True}
    augmented = augment_images(x, stream=Keystream.from_labels("aug", 0), **kwargs)
    there = augment_images(x.to(torch_device), stream=Keystream.from_labels("aug", 0), **kwargs)
    assert there.device.type == torch.device(torch_device).type
    assert torch.equal(there.cpu(), augmented)


def test_shard_examples_come_back_on_the_shards_device(torch_device):
    shard = Shard(torch.randn(6, 1, 4, 4).to(torch_device), torch.arange(6).to(torch_device))
    x, y = shard.examples(torch.tensor([4, 1]))  # indices on the CPU, as the batch streams draw them
    assert x.device.type == y.device.type == torch.device(torch_device).type
    assert y.cpu().tolist() == [4, 1]


@pytest.mark.parametrize("private", [False, True])
def test_party_releases_on_the_device_match_the_cpus(torch_device, private):
    """The search party's W and A releases, plain and private (reproducible streams: the same Poisson coins and
    noise on both), computed on the device and on the CPU from the same weights and inputs."""
    cfg = load_config(None, [*TINY, "privacy.reproducible_noise=true", "privacy.noise_multiplier_w=0.01",
                             "privacy.noise_multiplier_a=0.01"])
    with full_float32():
        cpu_party = make_party(cfg, private=private)
        party = make_party(cfg, private=private, device=torch_device)
        assert {p.device.type for p in party.model.parameters()} == {torch.device(torch_device).type}
        for release in ("w_release", "a_release"):
            expected, got = getattr(cpu_party, release)().copy(), getattr(party, release)().copy()
            assert got.dtype == np.float32 and got.shape == expected.shape
            if private:
                assert np.all(got[-STATS:] == 0)  # nothing but the release leaves a private party, on any device
            error = np.linalg.norm(got[:-STATS] - expected[:-STATS]) / np.linalg.norm(expected[:-STATS])
            assert error < 1e-4, (release, error)
