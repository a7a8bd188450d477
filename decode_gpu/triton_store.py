"""Fused KV store in Triton: new K/V rows converted to the pool's dtype and written to their slots.

One program per (new token, KV head) writes that head's K and V rows. Float pools get a cast; int8
pools get q8_0-style quantization (one float16 scale per 32 elements) computed in registers, the same
arithmetic as `KVPool._store`, so the two paths agree bit for bit where division rounds the same way.
A negative slot means "write nothing": padded rows of a static (CUDA-graph) batch point there.
Divisions use div_rn: Triton's `/` may be an approximate division on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decode_gpu.kv_pool import INT8_GROUP

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
def _cast_store(src, pool, row, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM_P2)  # [HEAD_DIM_P2]
    x = tl.load(src + offs_d, mask=offs_d < HEAD_DIM)  # [HEAD_DIM_P2]
    tl.store(pool + row + offs_d, cast_rne(x, pool.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _store_kv_kernel(new_k, new_v, slots, k_pool, v_pool, k_scales, v_scales,
                     nk_s_tok, nk_s_head, nv_s_tok, nv_s_head, pool_s_slot, pool_s_head, sc_s_slot, sc_s_head,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, INT8: tl.constexpr,
                     N_GROUPS_P2: tl.constexpr, GROUP_SIZE: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots + tok).to(tl.int64)
    if slot >= 0:
        k_src = new_k + tok * nk_s_tok + head * nk_s_head
        v_src = new_v + tok * nv_s_tok + head * nv_s_head
        row = slot * pool_s_slot + head * pool_s_head
        if INT8:
            scale_row = slot * sc_s_slot + head * sc_s_head
            _quantize_store(k_src, k_pool, k_scales, row, scale_row, HEAD_DIM // GROUP_SIZE, N_GROUPS_P2, GROUP_SIZE)
            _quantize_store(v_src, v_pool, v_scales, row, scale_row, HEAD_DIM // GROUP_SIZE, N_GROUPS_P2, GROUP_SIZE)
        else:
            _cast_store(k_src, k_pool, row, HEAD_DIM, HEAD_DIM_P2)
            _cast_store(v_src, v_pool, row, HEAD_DIM, HEAD_DIM_P2)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scales: torch.Tensor | None,
             v_scales: torch.Tensor | None, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim] (float, or int8 with scales
    [num_blocks, block_size, num_kv_heads, head_dim / 32]); slots: [n] flat slots, negative = skip;
    keys, values: [n, num_kv_heads, head_dim], any strides with a unit last one."""
    n_new, num_kv_heads, head_dim = keys.shape
    if n_new == 0:
        return
    _check_layout(k_pool, v_pool, keys, values)
    int8 = k_scales is not None
    scale_strides = (k_scales.stride(1), k_scales.stride(2)) if int8 else (0, 0)
    _store_kv_kernel[(n_new, num_kv_heads)](
        keys, values, slots, k_pool, v_pool, k_scales if int8 else k_pool, v_scales if int8 else v_pool,
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        k_pool.stride(1), k_pool.stride(2), *scale_strides,
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), INT8=int8,
        N_GROUPS_P2=triton.next_power_of_2(max(1, head_dim // INT8_GROUP)), GROUP_SIZE=INT8_GROUP)


def _check_layout(k_pool: torch.Tensor, v_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    # slots are flat (block * block_size + offset): that needs contiguous pool blocks
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the Triton KV store needs contiguous pool tensors")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("the Triton KV store needs new K/V rows with a unit last stride")
