"""Fused KV store in Triton: new K/V rows converted to the pool's dtype and written to their slots.

One program per (new token, KV head) writes that head's K and V rows. Float pools get a cast; int8
pools get q8_0-style quantization (one float16 scale per 32 elements) and int4 pools asymmetric 4-bit codes
packed two a byte (a float16 scale and minimum per 32 elements), computed in registers with the same
arithmetic as `KVPool._store`, so the two paths agree bit for bit where division rounds the same way.
A negative slot means "write nothing": padded rows of a static (CUDA-graph) batch point there.
Divisions use div_rn: Triton's `/` may be an approximate division on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decode_gpu.kv.pool import QUANT_GROUPS

# adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the nearest integer, ties
# to even, as torch.round does; the interpreter has no libdevice.rint
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """x as DTYPE, rounded to nearest even. float32 -> bfloat16 is done on the bits because Triton's
    interpreter truncates there, so CPU tests would disagree with the GPU and with torch."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # carry into bit 16 when above half, or at half and odd
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _quantize_store(src, pool, scales, row, scale_row, N_GROUPS: tl.constexpr, N_GROUPS_P2: tl.constexpr,
                    GROUP_SIZE: tl.constexpr):
    """One head's row at src -> int8 codes at pool + row, one float16 scale per group at scales + scale_row."""
    offs_g = tl.arange(0, N_GROUPS_P2)  # [N_GROUPS_P2]
    offs = offs_g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [N_GROUPS_P2, GROUP_SIZE]
    ok = offs_g[:, None] < N_GROUPS  # [N_GROUPS_P2, 1]
    groups = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)  # [N_GROUPS_P2, GROUP_SIZE]
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-8), 127.0)  # [N_GROUPS_P2]
    codes = (tl.math.div_rn(groups, scale[:, None]) + _ROUND_MAGIC) - _ROUND_MAGIC  # [N_GROUPS_P2, GROUP_SIZE]
    tl.store(pool + row + offs, codes.to(tl.int8), mask=ok)
    tl.store(scales + scale_row + offs_g, scale.to(tl.float16), mask=offs_g < N_GROUPS)


@triton.jit
def _quantize_store_int4(src, pool, scales, row, scale_row, N_GROUPS: tl.constexpr, N_GROUPS_P2: tl.constexpr,
                         GROUP_SIZE: tl.constexpr):
    """One head's row at src -> codes packed two a byte at pool + row/2 (element 2i low nibble), one float16
    (scale, minimum) pair per group at scales + scale_row."""
    offs_g = tl.arange(0, N_GROUPS_P2)  # [N_GROUPS_P2]
    offs = offs_g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [N_GROUPS_P2, GROUP_SIZE]
    ok = offs_g[:, None] < N_GROUPS  # [N_GROUPS_P2, 1]
    groups = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)  # [N_GROUPS_P2, GROUP_SIZE]
    low = tl.min(groups, axis=1)  # [N_GROUPS_P2]
    scale = tl.maximum(tl.math.div_rn(tl.max(groups, axis=1) - low, 15.0), 1e-8)  # [N_GROUPS_P2]
    codes = (tl.math.div_rn(groups - low[:, None], scale[:, None]) + _ROUND_MAGIC) - _ROUND_MAGIC
    codes = tl.minimum(tl.maximum(codes, 0.0), 15.0).to(tl.uint8)  # [N_GROUPS_P2, GROUP_SIZE]
    even, odd = tl.split(tl.reshape(codes, (N_GROUPS_P2, GROUP_SIZE // 2, 2)))  # [N_GROUPS_P2, GROUP_SIZE / 2] each
    offs_b = offs_g[:, None] * (GROUP_SIZE // 2) + tl.arange(0, GROUP_SIZE // 2)[None, :]  # [N_GROUPS_P2, GROUP / 2]
    tl.store(pool + row + offs_b, even | (odd << 4), mask=ok)
    meta = tl.join(scale, low).to(tl.float16)  # [N_GROUPS_P2, 2]
    offs_m = offs_g[:, None] * 2 + tl.arange(0, 2)[None, :]  # [N_GROUPS_P2, 2]
    tl.store(scales + scale_row + offs_m, meta, mask=ok)


@triton.jit
def _cast_store(src, pool, row, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM_P2)  # [HEAD_DIM_P2]
    x = tl.load(src + offs_d, mask=offs_d < HEAD_DIM)  # [HEAD_DIM_P2]
    tl.store(pool + row + offs_d, cast_rne(x, pool.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _store_kv_kernel(new_k, new_v, slots, k_pool, v_pool, k_scales, v_scales,
                     nk_s_tok, nk_s_head, nv_s_tok, nv_s_head, pool_s_slot, pool_s_head, sc_s_slot, sc_s_head,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, QUANT_BITS: tl.constexpr,
                     N_GROUPS_P2: tl.constexpr, GROUP_SIZE: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots + tok).to(tl.int64)
    if slot >= 0:
        k_src = new_k + tok * nk_s_tok + head * nk_s_head
        v_src = new_v + tok * nv_s_tok + head * nv_s_head
        row = slot * pool_s_slot + head * pool_s_head
        scale_row = slot * sc_s_slot + head * sc_s_head
        if QUANT_BITS == 8:
            _quantize_store(k_src, k_pool, k_scales, row, scale_row, HEAD_DIM // GROUP_SIZE, N_GROUPS_P2, GROUP_SIZE)
            _quantize_store(v_src, v_pool, v_scales, row, scale_row, HEAD_DIM // GROUP_SIZE, N_GROUPS_P2, GROUP_SIZE)
        elif QUANT_BITS == 4:
            _quantize_store_int4(k_src, k_pool, k_scales, row, scale_row, HEAD_DIM // GROUP_SIZE, N_GROUPS_P2,
                                 GROUP_SIZE)
            _quantize_store_int4(v_src, v_pool, v_scales, row, scale_row, HEAD_DIM // GROUP_SIZE, N_GROUPS_P2,
                                 GROUP_SIZE)
        else:
            _cast_store(k_src, k_pool, row, HEAD_DIM, HEAD_DIM_P2)
            _cast_store(v_src, v_pool, row, HEAD_DIM, HEAD_DIM_P2)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scales: torch.Tensor | None,
             v_scales: torch.Tensor | None, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim] (float, or int8 with scales
    [num_blocks, block_size, num_kv_heads, head_dim / 32]), or int4 as uint8 [..., head_dim / 2] with
    (scale, minimum) pairs [..., head_dim / 32, 2]; slots: [n] flat slots, negative = skip;
    keys, values: [n, num_kv_heads, head_dim], any strides with a unit last one."""
    n_new, num_kv_heads, head_dim = keys.shape
    if n_new == 0:
        return
    _check_layout(k_pool, v_pool, keys, values)
    bits = quant_bits(k_pool, k_scales)
    group = QUANT_GROUPS["int4" if bits == 4 else "int8"]
    scale_strides = (k_scales.stride(1), k_scales.stride(2)) if bits else (0, 0)
    _store_kv_kernel[(n_new, num_kv_heads)](
        keys, values, slots, k_pool, v_pool, k_scales if bits else k_pool, v_scales if bits else v_pool,
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        k_pool.stride(1), k_pool.stride(2), *scale_strides,
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), QUANT_BITS=bits,
        N_GROUPS_P2=triton.next_power_of_2(max(1, head_dim // group)), GROUP_SIZE=group)


def quant_bits(pool: torch.Tensor, scales: torch.Tensor | None) -> int:
    """The pool's code width: 0 for a float pool, 8 for int8, 4 for int4 (uint8 bytes of two codes)."""
    if scales is None:
        return 0
    return 4 if pool.dtype == torch.uint8 else 8


def _check_layout(k_pool: torch.Tensor, v_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    # slots are flat (block * block_size + offset): that needs contiguous pool blocks
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the Triton KV store needs contiguous pool tensors")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("the Triton KV store needs new K/V rows with a unit last stride")
