"""Sibling projections of the same input as one matrix: q/k/v of an attention layer, gate/up of an MLP.

A decode step multiplies every layer's hidden state by q, k and v, then by gate and up: five products of one input,
each a kernel call that reads its own weights. One product by the rows stacked gives the same numbers (each output
is its own dot product) in two calls, with less per-call work and bigger matrices for the kernel: over the embedded
model's 30 layers, prepacked bfloat16 on 2 cores, 15.0 against 12.5 ms at one row and 17.4 against 14.5 at 20
(docs/decode.md, "Fused projections").

The transformers modules keep calling q_proj, k_proj and v_proj in turn. Each becomes a FusedSlice: the first of a
group multiplies the input by the stacked matrix and keeps the product, the others take their columns of it when
handed the same tensor (else they compute it again, never a stale product). The stacked layer is an ordinary
nn.Linear until the weights are packed or quantized (decode_gpu.model.weight_quant), which then treat it as any other
layer: int8/int4/q8_0 scales are per output row, so stacking rows does not change them.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)
GROUPS = {"qkv_fused": ("q_proj", "k_proj", "v_proj"), "gate_up_fused": ("gate_proj", "up_proj")}


class _Group:
    """What a group's slices share: where the stacked layer lives, and the last input and its product."""

    def __init__(self, parent: nn.Module, name: str, last: int) -> None:
        self.parent = parent  # the module owning the slices and the stacked layer (copy.deepcopy keeps the pairing)
        self.name = name
        self.last = last  # the index of the slice called last (it drops the kept product)
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None


class FusedSlice(nn.Module):
    """Columns [start, end) of a stacked projection's product, in place of the projection they were."""

    def __init__(self, group: _Group, index: int, start: int, end: int, in_features: int) -> None:
        super().__init__()
        self._group = group
        self.index, self.start, self.end = index, start, end
        self.in_features, self.out_features = in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._group
        if group.input is not x:
            group.input, group.output = x, getattr(group.parent, group.name)(x)
        y = group.output[..., self.start:self.end]
        if self.index == group.last:
            group.input = group.output = None
        return y

    def extra_repr(self) -> str:
        return f"{self._group.name}[..., {self.start}:{self.end}]"


def fuse_projections(model: nn.Module) -> int:
    """Stack every q/k/v and gate/up group of plain nn.Linear layers of one input size, dtype and device (all with
    a bias or none) into one layer; EDGE_FUSED_PROJECTIONS=0 leaves the model as it is. The number of groups."""
    if os.environ.get("EDGE_FUSED_PROJECTIONS", "1") == "0":
        return 0
    fused = 0
    for parent in list(model.modules()):
        for fused_name, names in GROUPS.items():
            layers = [getattr(parent, name, None) for name in names]
            if not _stackable(layers):
                continue
            stacked = nn.Linear(layers[0].in_features, sum(m.out_features for m in layers),
                                bias=layers[0].bias is not None, device=layers[0].weight.device,
                                dtype=layers[0].weight.dtype)
            with torch.no_grad():
                stacked.weight.copy_(torch.cat([m.weight for m in layers]))
                if stacked.bias is not None:
                    stacked.bias.copy_(torch.cat([m.bias for m in layers]))
            stacked.requires_grad_(False)
            setattr(parent, fused_name, stacked)
            group, start = _Group(parent, fused_name, len(layers) - 1), 0
            for index, (name, layer) in enumerate(zip(names, layers)):
                setattr(parent, name, FusedSlice(group, index, start, start + layer.out_features, layer.in_features))
                start += layer.out_features
            fused += 1
    if fused:
        log.info("stacked %d groups of projections (q/k/v, gate/up) into one matrix each", fused)
    return fused


def _stackable(layers: list) -> bool:
    if not all(type(m) is nn.Linear for m in layers):
        return False
    first = layers[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in layers)
