"""int8 weights, one scale per output channel: the linear layer (torch's packed int8 kernel) and the input
embedding that shares a tied lm_head's table."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.nn import functional as F

from decode_gpu.model.quantized_linear import QuantizedLinear

log = logging.getLogger(__name__)


class Int8Linear(QuantizedLinear):
    """y = x @ (q * scale).T + b, with q int8 [out, in] and one scale per output channel (symmetric)."""
    held_as = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 float_above: int | None = None) -> None:
        super().__init__()
        w = weight.detach().float()  # [out, in]
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))  # [out]
        self.activation_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.keep_float(weight, float_above)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self._packed_kernel = int8_kernel_works(weight.device, dtype)

    def product(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self._packed_kernel:
            return torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        # no packed int8 kernel on this device: an int8 -> dtype cast of the layer per call (correct, slower)
        return F.linear(x2, self.qweight.to(x2.dtype)) * self.scales


@functools.cache
def int8_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a packed int8 kernel for this device and activation dtype (the CPU's always had one;
    CUDA's depends on the build)."""
    try:
        torch._weight_int8pack_mm(torch.ones(1, 32, device=device, dtype=dtype),
                                  torch.ones(8, 32, device=device, dtype=torch.int8),
                                  torch.ones(8, device=device, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        log.warning("no packed int8 kernel on %s for %s: int8 layers cast their weight per call", device, dtype)
        return False


class Int8Embedding(nn.Module):
    """Rows of an int8 table times their scale: the input embedding, sharing the tied lm_head's int8 weight."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        # buffers, so that the model's byte count and .to() see them; shared with a tied int8 lm_head
        self.register_buffer("qweight", qweight, persistent=False)  # [vocab, hidden] int8
        self.register_buffer("scales", scales, persistent=False)  # [vocab]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.qweight).to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)


def int8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [rows, cols] as int8 [rows, cols] and one scale per row [rows], as Int8Linear holds it."""
    layer = Int8Linear(weight, None, dtype)
    return layer.qweight, layer.scales
