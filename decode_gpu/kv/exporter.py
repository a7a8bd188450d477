"""The pool's KV of a finished sequence turned back into llama.cpp's rows: the inverse of kv/importer.py.

The engine thread copies a finished sequence's blocks out of the pool (KVPool.read_blocks: one copy, no encoding);
this runs later on another thread (decode_gpu.kv.kv_return): dequantize the pool's storage, undo an int4 pool's own
K rotation, permute K back to llama.cpp's interleaved RoPE rows (LLaMA family), apply llama.cpp's Hadamard rotation,
and quantize to the handoff's KV type exactly as ggml's reference quantizers do (q8_0, q4_0; f16 a cast).
"""

from __future__ import annotations

import torch

from contracts.handoff import KVLayout
from contracts.kv_dtypes import kv_dtype
from decode_gpu.kv.importer import unrotate
from decode_gpu.kv.pool import PoolShape, dequantize_int4, dequantize_int8


def permute_interleaved(k: torch.Tensor) -> torch.Tensor:
    """HF index i goes to llama.cpp index 2i, HF i + d/2 to 2i+1 (inverse of unpermute_interleaved).
    # [n, heads, head_dim] -> [n, heads, head_dim]"""
    half = k.shape[-1] // 2
    return torch.stack([k[..., :half], k[..., half:]], dim=-1).flatten(-2)


def quantize_rows(x: torch.Tensor, dtype_name: str) -> bytes:
    """x: [n_rows, n_elems] float32 -> llama.cpp row bytes of that type (ggml's quantize_row_*_ref)."""
    spec = kv_dtype(dtype_name)
    if not spec.quantized:
        return x.to(torch.float16).contiguous().numpy().tobytes()
    blocks = x.float().reshape(-1, spec.block_elems)  # [n_blocks, 32]
    if spec.name == "q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127.0  # [n_blocks, 1]
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        scaled = blocks * inv
        codes = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8).view(torch.uint8)
    else:  # q4_0: d = (the element of largest magnitude, signed) / -8, codes (x / d + 8.5) truncated, at most 15
        at = blocks.abs().argmax(dim=1, keepdim=True)
        d = blocks.gather(1, at) / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(blocks * inv + 8.5), max=15).to(torch.uint8)  # [n_blocks, 32]
        codes = q[:, :16] | (q[:, 16:] << 4)  # element j low nibble, j + 16 high
    scale = d.to(torch.float16).view(torch.uint8)  # [n_blocks, 2]
    return torch.cat([scale, codes], dim=1).contiguous().numpy().tobytes()


def export_layers(saved: list[torch.Tensor], shape: PoolShape, n_tokens: int,
                  layout: KVLayout) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """saved: KVPool.read_blocks' tensors of a sequence's blocks in order (K layers, V layers, then their scales);
    its first n_tokens positions as the handoff's per-layer K and V bytes in layout's types and rotations."""
    n = shape.num_layers
    scales = saved[2 * n:] if len(saved) > 2 * n else None
    pool_k_rotation = shape.head_dim & -shape.head_dim if shape.storage == "int4" else 0
    k_layers, v_layers = [], []
    for layer in range(n):
        keys = _floats(saved[layer], scales[layer] if scales else None, shape, n_tokens)
        keys = unrotate(keys, pool_k_rotation)  # an int4 pool keeps K rotated; H twice is the identity
        if layout.rope_layout == "interleaved":
            keys = permute_interleaved(keys)
        keys = unrotate(keys, layout.k_rotation)  # llama.cpp's rotation: the same H
        values = _floats(saved[n + layer], scales[n + layer] if scales else None, shape, n_tokens)
        values = unrotate(values, layout.v_rotation).reshape(n_tokens, -1)  # [n, n_embd_v]
        k_layers.append(quantize_rows(keys.reshape(n_tokens, -1), layout.k_dtype))
        v_layers.append(quantize_rows(values.t().contiguous() if layout.v_transposed else values, layout.v_dtype))
    return tuple(k_layers), tuple(v_layers)


def _floats(codes: torch.Tensor, scale: torch.Tensor | None, shape: PoolShape, n_tokens: int) -> torch.Tensor:
    """Blocks of one layer as float32 positions. # [m, block_size, heads, row] -> [n_tokens, heads, head_dim]"""
    if scale is None:
        x = codes.float()
    elif shape.storage == "int4":
        x = dequantize_int4(codes, scale, torch.float32)
    else:
        x = dequantize_int8(codes, scale, torch.float32)
    return x.reshape(-1, shape.num_kv_heads, shape.head_dim)[:n_tokens]
