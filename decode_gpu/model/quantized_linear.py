"""The base of the weight-only quantized linear layers (Int8Linear, Int4Linear, GGMLLinear): a packed product of
the quantized weight, and optionally the float weight too, for batches of more rows than the packed kernels win at.
"""

from __future__ import annotations

import torch
from torch import nn

from decode_gpu.model.packed_linear import float_linear, pack_weight, packs


class QuantizedLinear(nn.Module):
    """A weight-only quantized linear layer. float_above: also keep the float weight and use it for inputs of more
    rows than this. On a CPU the packed int kernels win at small batches (fewer bytes, less work) and lose at larger
    ones to the bfloat16 kernel (AMX); None: quantized only. A subclass sets activation_dtype and bias and defines
    product(x2), [rows, in] -> [rows, out]."""
    held_as: str  # the weight_dtype this layer holds
    in_features: int
    out_features: int

    def keep_float(self, weight: torch.Tensor, float_above: int | None) -> None:
        """Hold the float weight too, for inputs of more rows than float_above (None: quantized only); on a CPU
        with oneDNN bfloat16, in oneDNN's layout (PackedLinear)."""
        self.float_above = float_above
        for held in (self._parameters, self._buffers, self.__dict__):
            held.pop("weight", None)
        if float_above is None:
            self.weight = None
        elif weight.is_mkldnn:  # packed already (a PackedLinear's, from the CPU measurement)
            self.register_buffer("weight", weight, persistent=False)
        elif packs(weight.device, self.activation_dtype):
            self.register_buffer("weight", pack_weight(weight.detach().to(self.activation_dtype)), persistent=False)
        else:
            self.weight = nn.Parameter(weight.detach().to(self.activation_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        x2 = x.reshape(-1, self.in_features)
        if self.float_above is not None and x2.shape[0] > self.float_above:
            return float_linear(x, self.weight, self.bias)
        y = self.product(x2)  # [rows, out]
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
