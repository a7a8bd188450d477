"""int4 weights in groups of 32 inputs, each with a scale and a zero, in tinygemm's packed layout (torch's
_weight_int4pack_mm kernels)."""

from __future__ import annotations

import torch
from torch import nn

from decode_gpu.model.quantized_linear import QuantizedLinear

# inputs per int4 (scale, zero) group: 32, the block of llama.cpp's Q4_0/Q4_1 (a Q4_1 GGUF's weights are then
# nearly exact in int4: its blocks are min + k x step); a 128 group lost half the top-1 agreement on the embedded model
INT4_GROUP = 32
INT4_INNER_K_TILES = 2  # tinygemm's packing parameter (2, 4 or 8); 2 accepts any input size divisible by 32


class Int4Linear(QuantizedLinear):
    """Asymmetric 4-bit groups along the input: w = (q - 8) * scale + zero, one (scale, zero) per group of
    `group` inputs per output; tinygemm's packed layout (torch's _weight_int4pack_mm kernels). A GGUF matrix in
    Q4_0, Q4_1 or Q4_K is affine 4-bit in blocks of 32 already: its codes come back exactly."""
    held_as = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 float_above: int | None = None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.group = INT4_GROUP
        if in_features % INT4_GROUP:
            raise ValueError(f"int4 weights need an input size divisible by {INT4_GROUP}, this layer has {in_features}")
        w = weight.detach().float().reshape(out_features, in_features // self.group, self.group)
        low, high = w.amin(dim=2), w.amax(dim=2)  # [out, groups]
        scales = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        zeros = low + 8 * scales  # so that (q - 8) * scale + zero = q * scale + low
        self.register_buffer("qweight", _pack_int4(q.reshape(out_features, in_features)))
        self.register_buffer("scales_and_zeros", torch.stack([scales.T, zeros.T], dim=-1).to(dtype).contiguous())
        self.activation_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.keep_float(weight, float_above)
        self.in_features, self.out_features = in_features, out_features

    def product(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if x2.is_cuda:
            return torch._weight_int4pack_mm(x2, self.qweight, self.group, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_and_zeros)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [out, in] int32 in [0, 15] -> tinygemm's packed layout for q's device."""
    if q.is_cuda:
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two values a byte, the even one high
        return torch._convert_weight_to_int4pack(packed, INT4_INNER_K_TILES)
    return torch._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
