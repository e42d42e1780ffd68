"""DPNAS networks (Cheng et al. 2021, §3.2, Fig. 2): a stem -> one stage per entry of ``stage_channels``, each
[cell, 3x3 max pool with stride 2] -> a head.

* stem (``space.stem``): ``conv``, a 3x3 conv (stride 1, or 2 to run the cells at half the input's side); or
  ``scattering``, the fixed scattering transform (:mod:`mpi_fnas.space.scattering`, computed once per example outside
  the network, the ``fixed_stem``) then GroupNorm of its channels without parameters;
* head (``space.head``): ``pool``, average pooling to ``head_pool`` x ``head_pool`` (1: global), flatten, a linear
  classifier; or ``dpnas``, DPNASNet's MNIST head (docs/dpnas.md).

Every cell has the same architecture: one alpha matrix ``(num_edges(nodes), len(primitives))`` (``PRIMITIVES``, or
``space.ops``), no reduction cell. ``DpnasSearchNetwork`` is the supernet the federation searches (weights W apart
from the alpha A); ``DpnasNetwork`` is a derived cell stacked the same way and trained from scratch (the augment
stage). Normalisation is GroupNorm without affine parameters throughout: per example, as DP-SGD needs, and
buffer-free, so a network's state is exactly its parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mpi_fnas.space.dpnas.cells import DerivedDpnasCell, DpnasSearchCell
from mpi_fnas.space.dpnas.genotype import CHOICES, DpnasGenotype, check_primitives, derive_dpnas_genotype, num_edges
from mpi_fnas.space.dpnas.ops import PRIMITIVES
from mpi_fnas.space.ops import make_norm
from mpi_fnas.space.scaffold import WholeNetwork
from mpi_fnas.space.scattering import Scattering

#: GroupNorm groups over the scattering's channels (Tramèr & Boneh's 27 for 81 channels: 3 a group).
SCATTER_GROUPS = 27

if TYPE_CHECKING:  # the type only: the network never imports the privacy package
    from mpi_fnas.keystream import Keystream

ALPHA_INIT_SCALE = 1e-3  # near-uniform op weights at the start of the search (as DARTS)


def stem(in_channels: int, channels: int, stride: int = 1) -> nn.Sequential:
    """3x3 conv (no bias, `stride`) -> GroupNorm (no affine): ``(N, in_channels, H, W)`` ->
    ``(N, channels, ceil(H / stride), ceil(W / stride))``."""
    return nn.Sequential(nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False),
                         make_norm("groupnorm", channels, affine=False))


def downsample() -> nn.MaxPool2d:
    """The pool after every cell: 3x3, stride 2, padding 1: ``(N, C, H, W)`` -> ``(N, C, ceil(H/2), ceil(W/2))``."""
    return nn.MaxPool2d(3, stride=2, padding=1)


def sampled_path(alpha: torch.Tensor, noise: torch.Tensor, temperature: float) -> tuple[torch.Tensor, tuple[int, ...]]:
    """GDAS's draw (Dong & Yang 2019): each edge's op is the argmax of ``alpha + noise`` (Gumbel noise: a draw from
    softmax(alpha)); its weight is 1 in value with the gradient of ``softmax((alpha + noise) / temperature)``
    (straight-through). ``alpha`` (edges, ops), or (N, edges, ops) equal per-example copies; ``noise`` (edges,
    ops). Returns the weights (the shape of ``alpha``) and the op index of every edge."""
    perturbed = alpha + noise.to(device=alpha.device, dtype=alpha.dtype)
    index = (perturbed if perturbed.dim() == 2 else perturbed[0]).detach().argmax(dim=-1)
    soft = F.softmax(perturbed / temperature, dim=-1)
    hard = F.one_hot(index, alpha.shape[-1]).to(soft.dtype)
    return hard - soft.detach() + soft, tuple(int(k) for k in index.tolist())


#: ``space.stem`` and ``space.head``'s values (besides ``search``: the supernet holds every candidate, mixed by a
#: categorical weight the search learns like an edge's).
STEMS, HEADS = CHOICES["stem"], CHOICES["head"]
SEARCH = "search"
#: DPNASNet's head: 1x1 conv to this many channels, the map pooled to HEAD_SIDE x HEAD_SIDE, fc of HEAD_HIDDEN.
HEAD_CHANNELS, HEAD_SIDE, HEAD_HIDDEN = 128, 3, 128


class Front:
    """What the cells read, from the network's input, and what the classifier reads, from the last stage: the stem
    and the head of ``space.stem`` and ``space.head`` (see the module). ``stem(x)``, ``classify(x)``;
    ``fixed_stem``: the scattering applied to the data once (None for the conv stem); ``channels``: the stem's
    output channels."""

    def __init__(self, stem_kind: str, head_kind: str, in_channels: int, stem_channels: int, stem_stride: int,
                 head_pool: int) -> None:
        if stem_kind not in STEMS or head_kind not in HEADS:  # one candidate each (a supernet's choices apart)
            raise ValueError(f"stem must be one of {STEMS} and head one of {HEADS}, got {stem_kind!r}, {head_kind!r}")
        self.fixed_stem = Scattering(in_channels) if stem_kind == "scattering" else None
        if self.fixed_stem is None:
            self.stem, self.channels = stem(in_channels, stem_channels, stem_stride), stem_channels
        else:
            self.channels = self.fixed_stem.out_channels
            self.stem = nn.GroupNorm(SCATTER_GROUPS, self.channels, affine=False)
        self.head_kind, self.head_pool = head_kind, head_pool

    def head_layers(self, c_prev: int, num_classes: int) -> tuple[nn.Module | None, nn.Module]:
        """:func:`head_layers` of this front's head."""
        return head_layers(self.head_kind, c_prev, num_classes, self.head_pool)


def head_layers(kind: str, c_prev: int, num_classes: int, head_pool: int) -> tuple[nn.Module | None, nn.Module]:
    """(the layers before the classifier or None, the classifier) of head `kind` on `c_prev` channels, built after
    the cells (the seeded weights of the stem and the cells do not depend on the head)."""
    if kind == "pool":
        return None, nn.Linear(c_prev * head_pool ** 2, num_classes)
    reduce = nn.Sequential(nn.Conv2d(c_prev, HEAD_CHANNELS, 1, bias=False),
                           make_norm("groupnorm", HEAD_CHANNELS, affine=False))
    classifier = nn.Sequential(nn.Linear(HEAD_CHANNELS * HEAD_SIDE ** 2, HEAD_HIDDEN), nn.Tanh(),
                               nn.Linear(HEAD_HIDDEN, num_classes))
    return reduce, classifier


def classify(x: torch.Tensor, head_reduce: nn.Module | None, classifier: nn.Module, head_pool: int) -> torch.Tensor:
    """The logits of the last stage's maps `x`: the pool head, or DPNASNet's (`head_reduce` set)."""
    if head_reduce is None:
        return classifier(head(x, head_pool))
    return classifier(F.adaptive_avg_pool2d(head_reduce(x), HEAD_SIDE).flatten(1))


class Head(nn.Module):
    """One candidate head of a supernet that searches it (``space.head: search``): ``forward(maps)`` -> logits."""

    def __init__(self, kind: str, c_prev: int, num_classes: int, head_pool: int) -> None:
        super().__init__()
        self.head_pool = head_pool
        self.head_reduce, self.classifier = head_layers(kind, c_prev, num_classes, head_pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of the last stage's maps `x`."""
        return classify(x, self.head_reduce, self.classifier, self.head_pool)


def scattering_branch(in_channels: int, channels: int) -> nn.Sequential:
    """The scattering candidate of a searched stem, after the transform: GroupNorm of its channels, a 1x1 conv to
    the first stage's `channels` and GroupNorm, so that both candidates feed the cells the same channels."""
    scattered = Scattering(in_channels).out_channels
    return nn.Sequential(nn.GroupNorm(SCATTER_GROUPS, scattered, affine=False),
                         nn.Conv2d(scattered, channels, 1, bias=False), make_norm("groupnorm", channels, affine=False))


def choice_weights(beta: torch.Tensor, noise: torch.Tensor | None, temperature: float
                   ) -> tuple[torch.Tensor, int | None]:
    """The weights of a searched choice's candidates: softmax(beta) ((k,), or (N, k) per-example copies), or under
    GDAS (`noise`, (1, k)) the drawn candidate's straight-through one-hot and its index."""
    if noise is None:
        return F.softmax(beta, dim=-1), None
    weights, (index,) = sampled_path(beta.unsqueeze(-2), noise, temperature)
    return weights.squeeze(-2), index


def weighted(weights: torch.Tensor, k: int, logits: torch.Tensor) -> torch.Tensor:
    """Candidate `k`'s `logits` (N, classes) times its weight: ``weights`` (k,) or (N, k)."""
    return logits * (weights[k] if weights.dim() == 1 else weights[:, k:k + 1])


def head(x: torch.Tensor, head_pool: int) -> torch.Tensor:
    """The classifier's input: ``(N, C, H, W)`` average-pooled to ``(N, C, head_pool, head_pool)``, flattened to
    ``(N, C · head_pool²)``; 1 is the global average pool, 2 keeps where in the image a feature was (2x2 quadrants)."""
    return F.adaptive_avg_pool2d(x, head_pool).flatten(1)


def check_input(owner: str, x: torch.Tensor, in_channels: int, fixed_stem: Scattering | None) -> None:
    """ValueError unless `x` is what the network reads: images (N, in_channels, H, W), or under the scattering stem
    their scattering (N, 81·in_channels, h, w)."""
    channels = fixed_stem.out_channels if fixed_stem is not None else in_channels
    if x.dim() != 4 or x.shape[1] != channels:
        what = "the scattering of the images" if fixed_stem is not None else "images"
        raise ValueError(f"{owner} input: expected {what}, (N, {channels}, H, W), got {tuple(x.shape)}")


def _check_sizes(owner: str, stage_channels: Sequence[int], nodes: int, num_classes: int, in_channels: int,
                 stem_stride: int, head_pool: int) -> None:
    if not stage_channels or any(int(c) < 1 for c in stage_channels):
        raise ValueError(f"{owner}: stage_channels must be a non-empty list of integers >= 1, "
                         f"got {list(stage_channels)}")
    for name, value in (("nodes", nodes), ("num_classes", num_classes), ("in_channels", in_channels),
                        ("stem_stride", stem_stride), ("head_pool", head_pool)):
        if value < 1:
            raise ValueError(f"{owner}: {name} must be >= 1, got {value}")


class DpnasSearchNetwork(nn.Module):
    """The DPNAS supernet. ``forward(x)``: ``x`` (N, in_channels, H, W) -> logits (N, num_classes).

    After stage s the maps are ``(N, nodes · stage_channels[s], ceil(H / 2^(s+1)), ...)``. The alpha is created
    last, so for a given seed the weights' initialisation does not depend on its shape. The alpha may be replaced
    (``functional_call``) by per-example copies ``(N, edges, ops)``, example n using row n.

    ``path_noise``: None (the default) mixes every op of every edge by softmax(alpha); a Gumbel draw (edges, ops),
    set by the caller before a step (``search.method: gdas``), runs one op per edge instead (:func:`sampled_path`,
    at ``path_temperature``).
    """

    #: Parameters the forward also takes with a leading batch dimension, one copy per example.
    per_example_parameters = ("alpha", "stem_beta", "head_beta")

    def __init__(self, stage_channels: Sequence[int], num_classes: int, nodes: int = 5, in_channels: int = 3,
                 primitives: Sequence[str] = PRIMITIVES, stem_stride: int = 1, head_pool: int = 1,
                 stem_kind: str = "conv", head_kind: str = "pool") -> None:
        super().__init__()
        _check_sizes("DpnasSearchNetwork", stage_channels, nodes, num_classes, in_channels, stem_stride, head_pool)
        self.head_pool = head_pool
        self.stage_channels = tuple(int(c) for c in stage_channels)
        self.nodes = nodes
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.primitives = check_primitives(primitives)
        self.choices = tuple(name for name, kind in (("stem", stem_kind), ("head", head_kind)) if kind == SEARCH)
        c0 = self.stage_channels[0]
        if stem_kind == SEARCH:  # both candidates, computed from the images in the forward
            self.fixed_stem, self.scattering = None, Scattering(in_channels)
            self.stems = nn.ModuleList([stem(in_channels, c0, stem_stride), scattering_branch(in_channels, c0)])
            c_prev = c0
        else:
            front = Front(stem_kind, "pool", in_channels, c0, stem_stride, head_pool)
            self.fixed_stem, self.stem, c_prev = front.fixed_stem, front.stem, front.channels
        self.cells = nn.ModuleList()
        for channels in self.stage_channels:
            self.cells.append(DpnasSearchCell(nodes, c_prev, channels, self.primitives))
            c_prev = nodes * channels
        self.pool = downsample()
        if head_kind == SEARCH:
            self.heads = nn.ModuleList(Head(kind, c_prev, num_classes, head_pool) for kind in HEADS)
        else:
            self.head_reduce, self.classifier = head_layers(head_kind, c_prev, num_classes, head_pool)
        self.alpha = nn.Parameter(ALPHA_INIT_SCALE * torch.randn(num_edges(nodes), len(self.primitives)))
        for name in self.choices:  # a categorical weight per searched choice, released with the alpha
            setattr(self, f"{name}_beta", nn.Parameter(ALPHA_INIT_SCALE * torch.randn(len(CHOICES[name]))))
        self.path_noise: torch.Tensor | None = None
        self.choice_noise: dict[str, torch.Tensor] | None = None  # GDAS's draw of each searched choice, (1, k)
        self.path_temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the batch `x` (the images, or their scattering under the scattering stem) under the current
        architecture variables."""
        check_input("DpnasSearchNetwork", x, self.in_channels, self.fixed_stem)
        # One softmax (or one sampled path) per forward, shared by every cell.
        if self.path_noise is None:
            weights, path = F.softmax(self.alpha, dim=-1), None
        else:
            weights, path = sampled_path(self.alpha, self.path_noise, self.path_temperature)
        if "stem" not in self.choices:
            return self._through(self.stem(x), weights, path)
        stem_weights, drawn = self._choice("stem")
        logits = 0
        for k, (kind, branch) in enumerate(zip(STEMS, self.stems, strict=True)):
            if drawn is None or k == drawn:  # a GDAS step runs the drawn candidate alone
                features = branch(x if kind == "conv" else self.scattering(x))
                logits = logits + weighted(stem_weights, k, self._through(features, weights, path))
        return logits

    def _through(self, x: torch.Tensor, weights: torch.Tensor, path: tuple[int, ...] | None) -> torch.Tensor:
        """The cells, then the head (or every searched head, weighted), from the stem's output `x`."""
        for cell in self.cells:
            x = self.pool(cell(x, weights, path))
        if "head" not in self.choices:
            return classify(x, self.head_reduce, self.classifier, self.head_pool)
        head_weights, drawn = self._choice("head")
        return sum(weighted(head_weights, k, candidate(x)) for k, candidate in enumerate(self.heads)
                   if drawn is None or k == drawn)

    def _choice(self, name: str) -> tuple[torch.Tensor, int | None]:
        noise = self.choice_noise.get(name) if self.choice_noise is not None else None
        return choice_weights(getattr(self, f"{name}_beta"), noise, self.path_temperature)

    def named_weights(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` for every parameter except the architecture's, in ``named_parameters`` order."""
        architecture = {id(p) for p in self.alphas()}
        return ((name, p) for name, p in self.named_parameters() if id(p) not in architecture)

    def weights(self) -> list[nn.Parameter]:
        """Network weights W: every parameter except the architecture's."""
        return [p for _, p in self.named_weights()]

    def named_alphas(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``("alpha", (edges, ops))``, then a searched choice's ``("stem_beta", (2,))``, ``("head_beta", (2,))``."""
        return iter((("alpha", self.alpha), *((f"{name}_beta", getattr(self, f"{name}_beta"))
                                              for name in self.choices)))

    def alphas(self) -> list[nn.Parameter]:
        """Architecture variables A: ``[alpha]`` (edges, ops), and each searched choice's categorical weight."""
        return [p for _, p in self.named_alphas()]

    def argmax_path(self) -> None:
        """Run the strongest op of every edge and the strongest candidate of every searched choice alone from now
        on (GDAS: the network its single paths train, which rank 0 evaluates)."""
        self.path_noise = torch.zeros_like(self.alpha.detach())
        self.choice_noise = {name: torch.zeros(1, len(CHOICES[name])) for name in self.choices}

    def alpha_softmax(self) -> dict[str, torch.Tensor]:
        """Detached row softmax, keyed as the run log stores it: ``{"normal": (edges, ops), "reduce": (0, ops)}``
        (every cell is the "normal" one; there is no reduction cell, so its matrix has no edge)."""
        with torch.no_grad():
            return {"normal": F.softmax(self.alpha, dim=-1).detach(),
                    "reduce": torch.zeros(0, len(self.primitives), dtype=self.alpha.dtype)}

    def genotype(self) -> DpnasGenotype:
        """The argmax of every edge, ``none`` included (``derive_dpnas_genotype``), and of every searched choice."""
        cell = derive_dpnas_genotype(self.alpha, self.nodes, self.primitives)
        chosen = {name: CHOICES[name][int(getattr(self, f"{name}_beta").detach().argmax())] for name in self.choices}
        return DpnasGenotype(cell.ops, **chosen)


class DpnasNetwork(WholeNetwork):
    """A derived DPNAS cell stacked like the supernet, trained from scratch.

    ``forward(x)``: ``x`` (N, in_channels, H, W) -> logits (N, num_classes). Drop-path: ``drop_path_prob`` (set by
    the caller, 0 by default) and ``mask_stream`` (a Keystream, the masks' only source, required when it is > 0 in
    training).
    """

    def __init__(self, genotype: DpnasGenotype, stage_channels: Sequence[int], num_classes: int,
                 in_channels: int = 3, stem_stride: int = 1, head_pool: int = 1, stem_kind: str = "conv",
                 head_kind: str = "pool") -> None:
        super().__init__()
        if not isinstance(genotype, DpnasGenotype):
            raise TypeError(f"DpnasNetwork: genotype must be a DpnasGenotype, got {type(genotype).__name__}")
        _check_sizes("DpnasNetwork", stage_channels, genotype.nodes, num_classes, in_channels, stem_stride,
                     head_pool)
        self.head_pool = head_pool
        self.genotype = genotype
        self.stage_channels = tuple(int(c) for c in stage_channels)
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.drop_path_prob: float = 0.0
        self.mask_stream: Keystream | None = None
        front = Front(stem_kind, head_kind, in_channels, self.stage_channels[0], stem_stride, head_pool)
        self.fixed_stem, self.stem, c_prev = front.fixed_stem, front.stem, front.channels
        self.cells = nn.ModuleList()
        for channels in self.stage_channels:
            self.cells.append(DerivedDpnasCell(genotype, c_prev, channels))
            c_prev = genotype.nodes * channels
        self.pool = downsample()
        self.head_reduce, self.classifier = front.head_layers(c_prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the batch `x` (the images, or their scattering under the scattering stem)."""
        check_input("DpnasNetwork", x, self.in_channels, self.fixed_stem)
        if not 0.0 <= self.drop_path_prob < 1.0:
            raise ValueError(f"DpnasNetwork: drop_path_prob must be in [0, 1), got {self.drop_path_prob}")
        drop_prob = float(self.drop_path_prob) if self.training else 0.0
        if drop_prob > 0.0 and self.mask_stream is None:
            raise ValueError("DpnasNetwork: drop_path_prob > 0 in training mode needs `mask_stream` (the Keystream "
                             "the drop-path masks are drawn from); the global RNG is never used")
        x = self.stem(x)
        for cell in self.cells:
            x = self.pool(cell(x, drop_prob, self.mask_stream))
        return classify(x, self.head_reduce, self.classifier, self.head_pool)
