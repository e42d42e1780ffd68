"""The "augment" network of the DARTS evaluation protocol: a derived genotype stacked and trained from scratch.

``DerivedCell`` is the discrete cell of a ``Genotype`` (every intermediate node is the sum of exactly two ops),
``AugmentNetwork`` stacks ``layers`` of them like the supernet does (same stem, same reduction positions) and
optionally carries DARTS' auxiliary classifier head. Unlike the supernet, ops are ``affine=True`` and pools have
no trailing norm (DARTS' evaluation cells: nothing competes with an architecture weight any more).

Drop-path (DARTS' regulariser for evaluation training) zeroes whole op outputs, here independently *per
example*: under DP-SGD every example's gradient must depend on that example alone, and a mask shared by the
batch would couple them. The masks come from a :class:`~mpi_fnas.keystream.Keystream` held by the
network (the party's secret sampling stream), never from the global RNG: under DP they must be as unpredictable as
the Poisson coins (docs/privacy.md §2.1). They are drawn once per batched forward, one per example, so the
per-example gradients must come from that forward (the ``hooks`` method), not from ``vmap``'s one forward per
example.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mpi_fnas.space.genotype import EDGES_PER_NODE, Genotype
from mpi_fnas.space.ops import PRIMITIVES, make_norm, make_op
from mpi_fnas.space.scaffold import CellNetwork, CellPlace, check_sizes

if TYPE_CHECKING:  # the type only: the network never imports the privacy package
    from mpi_fnas.keystream import Keystream

__all__ = [
    "AugmentNetwork",
    "AuxiliaryHead",
    "DerivedCell",
    "augment_loss",
    "build_augment_network",
    "drop_path",
    "drop_path_mask",
]

AUX_HIDDEN_CHANNELS = 128  # DARTS' CIFAR auxiliary head widths
AUX_FEATURES = 768
AUX_POOLED_SIZE = 2  # the head's 2x2 conv consumes a 2x2 map


def drop_path_mask(
    batch: int, drop_prob: float, stream: Keystream, *, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Per-example drop-path scale ``m_i / (1 - p)``, ``m_i ~ Bernoulli(1 - p)``: ``(batch, 1, 1, 1)``.

    Drawn from ``stream`` alone (float64 uniforms on the CPU), then moved to ``device`` / ``dtype``.
    """
    keep = 1.0 - drop_prob
    uniform = stream.uniform((batch, 1, 1, 1))
    # Dividing by keep makes the expected output equal the undropped one, so eval needs no rescaling.
    return ((uniform < keep).to(dtype) / keep).to(device)


def drop_path(x: torch.Tensor, drop_prob: float, stream: Keystream | None) -> torch.Tensor:
    """``x`` (N, C, H, W) with each example's map independently zeroed with probability ``drop_prob`` and the
    kept ones scaled by ``1 / (1 - drop_prob)``; out of place. ``drop_prob == 0`` returns ``x`` itself."""
    if drop_prob == 0.0:
        return x
    if stream is None:
        raise ValueError("drop_path: drop_prob > 0 needs a Keystream for the masks (got None)")
    return x * drop_path_mask(x.shape[0], drop_prob, stream, device=x.device, dtype=x.dtype)


class DerivedCell(nn.Module):
    """One discrete cell of ``genotype`` (its reduce cell when ``reduction``, else its normal cell).

    ``forward(s0, s1, drop_prob=0.0, stream=None)``: ``s0`` (N, place.c_prev_prev, H0, W0), ``s1`` (N,
    place.c_prev, H1, W1) -> (N, len(concat) * place.channels, ceil(H1 / r), ceil(W1 / r)) with r = 2 for a
    reduction cell, else 1. ``s0`` has twice the resolution of ``s1`` when the previous cell reduced
    (``place.reduction_prev``).
    Drop-path applies in training mode only, to every op output except an identity.
    """

    def __init__(self, genotype: Genotype, place: CellPlace, norm: str) -> None:
        super().__init__()
        if not isinstance(genotype, Genotype):
            raise TypeError(f"DerivedCell: genotype must be a Genotype, got {type(genotype).__name__}")
        edges = genotype.reduce if place.reduction else genotype.normal
        concat = genotype.reduce_concat if place.reduction else genotype.normal_concat
        for op_name, _ in edges:
            # `none` would make the node a constant zero input: never part of a derived cell (derive_genotype
            # and Genotype.from_string refuse it too).
            if op_name == "none" or op_name not in PRIMITIVES:
                raise ValueError(
                    f"DerivedCell: op {op_name!r} cannot be built; expected one of "
                    f"{', '.join(p for p in PRIMITIVES if p != 'none')}"
                )
        self.reduction = place.reduction
        self.nodes = len(edges) // EDGES_PER_NODE
        self.concat = tuple(concat)
        self.indices = tuple(j for _, j in edges)  # input state of each op, in genotype order
        self.preprocess0, self.preprocess1 = place.inputs(norm, affine=True)
        self.ops = nn.ModuleList(
            make_op(name, place.channels, place.stride(j), norm, affine=True, pool_norm=False) for name, j in edges
        )

    @property
    def out_channels_multiplier(self) -> int:
        """Output channels per cell channel: the number of concatenated states."""
        return len(self.concat)

    def forward(
        self,
        s0: torch.Tensor,
        s1: torch.Tensor,
        drop_prob: float = 0.0,
        stream: Keystream | None = None,
    ) -> torch.Tensor:
        """The cell's output from the two previous states, with per-example drop-path at `drop_prob` drawn from
        `stream`."""
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        use_drop_path = self.training and drop_prob > 0.0
        for node in range(self.nodes):
            node_sum = None
            for k in range(node * EDGES_PER_NODE, (node + 1) * EDGES_PER_NODE):
                op = self.ops[k]
                out = op(states[self.indices[k]])
                # An identity carries the input unchanged (DARTS never drops it): dropping it would only add noise
                # to the path that keeps deep cells trainable.
                if use_drop_path and not isinstance(op, nn.Identity):
                    out = drop_path(out, drop_prob, stream)
                # Out of place: the per-example-gradient hooks refuse in-place updates of layer outputs.
                node_sum = out if node_sum is None else node_sum + out
            states.append(node_sum)
        return torch.cat([states[k] for k in self.concat], dim=1)


class AuxiliaryHead(nn.Module):
    """DARTS' CIFAR auxiliary classifier: ``(N, channels_in, H, W)`` -> logits ``(N, num_classes)``.

    ReLU, average pooling to 2x2, conv 1x1 -> 128, norm, ReLU, conv 2x2 -> 768, norm, ReLU, linear. DARTS pools
    its 8x8 maps with a 5x5 window at stride 3; adaptive pooling gives the same 2x2 map at any resolution (e.g.
    the 4x4 maps of 16x16 images).
    """

    def __init__(self, channels_in: int, num_classes: int, norm: str) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.ReLU(inplace=False),
            nn.AdaptiveAvgPool2d(AUX_POOLED_SIZE),
            nn.Conv2d(channels_in, AUX_HIDDEN_CHANNELS, 1, bias=False),
            make_norm(norm, AUX_HIDDEN_CHANNELS, affine=True),
            nn.ReLU(inplace=False),
            nn.Conv2d(AUX_HIDDEN_CHANNELS, AUX_FEATURES, AUX_POOLED_SIZE, bias=False),  # -> (N, 768, 1, 1)
            make_norm(norm, AUX_FEATURES, affine=True),
            nn.ReLU(inplace=False),
        )
        self.classifier = nn.Linear(AUX_FEATURES, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The auxiliary logits of the features `x`."""
        return self.classifier(self.features(x).flatten(1))


class AugmentNetwork(CellNetwork):
    """DARTS evaluation network: stem, ``layers`` ``DerivedCell``s, global average pooling, linear classifier.

    Cells at ``layers // 3`` and ``2 * layers // 3`` are reduction cells (the supernet's rule). With
    ``auxiliary``, ``AuxiliaryHead`` reads the output of cell ``2 * layers // 3``.

    ``forward(x)``: ``x`` (N, in_channels, H, W) -> logits (N, num_classes); in training mode with
    ``auxiliary``, ``(logits, aux_logits)``, both (N, num_classes) (``augment_loss`` takes either form).

    Drop-path: ``drop_path_prob`` (set by the caller, e.g. each epoch; 0 by default) and ``mask_stream`` (a
    Keystream, the masks' only source; required when ``drop_path_prob > 0`` in training mode).
    """

    def __init__(
        self,
        genotype: Genotype,
        channels: int,
        num_classes: int,
        layers: int,
        in_channels: int = 3,
        stem_multiplier: int = 3,
        norm: str = "groupnorm",
        auxiliary: bool = False,
    ) -> None:
        if not isinstance(genotype, Genotype):
            raise TypeError(f"AugmentNetwork: genotype must be a Genotype, got {type(genotype).__name__}")
        check_sizes("AugmentNetwork", channels=channels, num_classes=num_classes, layers=layers,
                    stem_multiplier=stem_multiplier, in_channels=in_channels)

        super().__init__(channels, num_classes, layers, in_channels, stem_multiplier, norm,
                         lambda place: DerivedCell(genotype, place, norm))
        self.genotype = genotype
        self.aux_layer = 2 * layers // 3 if auxiliary else None
        self.drop_path_prob: float = 0.0
        self.mask_stream: Keystream | None = None
        # Created last so that, for a given seed, the main network's initial weights do not depend on `auxiliary`.
        self.auxiliary_head = (AuxiliaryHead(self.cell_channels[self.aux_layer], num_classes, norm)
                               if self.aux_layer is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits of the batch `x` (and the auxiliary head's, while training with one)."""
        self.check_input(x)
        if not 0.0 <= self.drop_path_prob < 1.0:
            raise ValueError(f"AugmentNetwork: drop_path_prob must be in [0, 1), got {self.drop_path_prob}")
        drop_prob = float(self.drop_path_prob) if self.training else 0.0
        if drop_prob > 0.0 and self.mask_stream is None:
            raise ValueError(
                "AugmentNetwork: drop_path_prob > 0 in training mode needs `mask_stream` (the Keystream the "
                "drop-path masks are drawn from); the global RNG is never used"
            )
        aux_logits = None
        s0 = s1 = self.stem(x)
        for layer, cell in enumerate(self.cells):
            s0, s1 = s1, cell(s0, s1, drop_prob, self.mask_stream)
            if layer == self.aux_layer and self.training:
                assert self.auxiliary_head is not None
                aux_logits = self.auxiliary_head(s1)
        pooled = F.adaptive_avg_pool2d(s1, 1).flatten(1)  # (N, final cell channels)
        logits = self.classifier(pooled)
        return logits if aux_logits is None else (logits, aux_logits)

    def weights(self) -> list[nn.Parameter]:
        """Every parameter (auxiliary head included), in ``named_parameters`` order: what the server federates."""
        return list(self.parameters())

    def main_parameters(self) -> list[nn.Parameter]:
        """Parameters without the auxiliary head (training-only; not part of the evaluated model)."""
        aux = set() if self.auxiliary_head is None else {id(p) for p in self.auxiliary_head.parameters()}
        return [p for p in self.parameters() if id(p) not in aux]

    def num_params(self) -> int:
        """Number of scalar parameters without the auxiliary head (the paper's "Params (M)", times 1e6)."""
        return sum(p.numel() for p in self.main_parameters())


def augment_loss(
    outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor, auxiliary_weight: float
) -> torch.Tensor:
    """Per-example loss ``(b,)``: cross-entropy of the logits, plus ``auxiliary_weight`` times the cross-entropy
    of the auxiliary logits when ``outputs`` is ``(logits, aux_logits)`` (``AugmentNetwork`` in training mode)."""
    if isinstance(outputs, tuple):
        logits, aux_logits = outputs
        return F.cross_entropy(logits, targets, reduction="none") + auxiliary_weight * F.cross_entropy(
            aux_logits, targets, reduction="none"
        )
    return F.cross_entropy(outputs, targets, reduction="none")


def build_augment_network(
    genotype: Genotype,
    *,
    channels: int,
    layers: int,
    seed: int,
    in_channels: int,
    num_classes: int,
    stem_multiplier: int = 3,
    norm: str = "groupnorm",
    auxiliary: bool = False,
) -> AugmentNetwork:
    """``AugmentNetwork`` initialised from ``seed``: every rank calling it with the same arguments gets
    bit-identical weights."""
    torch.manual_seed(seed)
    return AugmentNetwork(
        genotype, channels, num_classes, layers, in_channels=in_channels, stem_multiplier=stem_multiplier,
        norm=norm, auxiliary=auxiliary,
    )
