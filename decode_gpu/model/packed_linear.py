"""bfloat16 linear layers on the CPU with their weights prepacked once into oneDNN's blocked layout.

torch's bfloat16 F.linear on the CPU reorders the weight for oneDNN at every call; a PackedLinear does it once and
calls oneDNN's prepacked kernel (AMX where the CPU has it), with the same numbers (docs/decode.md, "Weights").
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """A bfloat16 linear layer on the CPU with its weight reordered once into oneDNN's blocked layout, multiplied by
    oneDNN's prepacked kernel (AMX where the CPU has it): the same numbers as F.linear, whose bfloat16 path on the
    CPU prepares the weight at every call. Over the embedded model's linear layers, 2 threads of an AMX Xeon: 15.7
    against 23.2 ms at one row, 18.1 against 24.9 at 32 (docs/decode.md, "Weights")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", pack_weight(weight.detach()), persistent=False)  # oneDNN layout, [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float_linear(x, self.weight, self.bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout for its linear kernel (a tensor of layout torch._mkldnn)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, for a weight in either layout (pack_weight's or a plain one)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float weights of `dtype` on `device` are held in oneDNN's layout: bfloat16 on a CPU whose oneDNN
    has bfloat16 kernels (AVX-512 and up), unless EDGE_PACKED_WEIGHTS=0. Checked once on a small layer."""
    if device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get("EDGE_PACKED_WEIGHTS", "1") == "0":
        return False
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        weight, x = torch.randn(16, 32, dtype=dtype), torch.randn(3, 32, dtype=dtype)
        return bool(torch.equal(float_linear(x, pack_weight(weight), None), F.linear(x, weight)))
    except (RuntimeError, AttributeError) as e:
        log.warning("oneDNN's prepacked bfloat16 linear is not usable here (%s): float weights stay as they are", e)
        return False


def pack_linears(model: nn.Module, packed: dict[str, PackedLinear] | None = None) -> int:
    """Replace the model's bfloat16 nn.Linear layers on the CPU by PackedLinear ones (a tied lm_head gets its own
    packed copy; the embedding keeps the plain table). packed: layers by module name, already packed from these
    weights (the CPU measurement's), used instead of packing them again. The number replaced."""
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and packs(m.weight.device, m.weight.dtype)]
    for name, module in linears:
        layer = (packed or {}).get(name)
        replace_module(model, name, layer if layer is not None else PackedLinear(module.weight, module.bias))
    return len(linears)


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` in the model in place of the submodule called `name` (e.g. "model.layers.0.mlp.down_proj")."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
