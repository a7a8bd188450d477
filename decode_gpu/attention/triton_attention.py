"""Paged attention in Triton: split-KV (flash-decoding), GQA-grouped, reading the pool in place.

Main kernel grid: (sequence, KV head, KV split x query tile). One program holds the query rows of one
KV head's group for up to BLOCK_Q of the sequence's new tokens as one [BLOCK_M, HEAD_DIM] tile (row =
token * GROUP + head within the group), so every K/V element it reads from the pool serves
GROUP * BLOCK_Q rows: decode is bound by those reads. It walks its split of the context BLOCK_N tokens
at a time, looking each token's block up in the block table (so BLOCK_N need not equal the pool's
block size), dequantizes int8 with its group scales, or unpacks int4 and applies its group scales and
minimums, in registers, masks causally (the new tokens are
the last query_len of the context) and keeps an online softmax in base 2. Splits give a short batch
enough programs to fill the GPU: with one split the kernel writes the output itself; with several it
writes each split's normalized output and log-sum-exp, and a merge kernel combines them per
(token, head). Every split length is derived from the context length inside the kernel, so the grid
depends only on the batch shape (CUDA graphs can capture it).

Gemma's layers add two options: a sliding window (a query sees only the last `window` positions, its own
included; the key loop starts at the window, so a long context costs a window's reads) and soft-capped scores
(softcap * tanh(score / softcap), before the softmax).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from decode_gpu.attention.triton_store import cast_rne, quant_bits
from decode_gpu.kv.pool import QUANT_GROUPS

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): exp2 is the cheap instruction
MAX_TILE_ROWS = 64  # query rows (tokens x group heads) per program before the query tokens are tiled


@triton.jit
def _load_kv_tile(pool, scales, base, scale_base, offs_d, ok, HEAD_DIM: tl.constexpr, QUANT_BITS: tl.constexpr,
                  GROUP_SIZE: tl.constexpr):
    """K or V rows of BLOCK_N tokens at pool + base, as float32 when quantized. # [BLOCK_N, HEAD_DIM_P2]"""
    if QUANT_BITS == 4:
        x = _load_int4_tile(pool, scales, base, scale_base, ok, HEAD_DIM, offs_d.shape[0], GROUP_SIZE)
    else:
        mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_N, HEAD_DIM_P2]
        x = tl.load(pool + base[:, None] + offs_d[None, :], mask=mask, other=0.0)
        if QUANT_BITS == 8:
            x = _scale_int8_tile(x, scales, scale_base, ok, HEAD_DIM, GROUP_SIZE)
    return x


@triton.jit
def _scale_int8_tile(x, scales, scale_base, ok, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """int8 codes x [BLOCK_N, HEAD_DIM_P2] times one scale per group, loaded once and broadcast over its
    elements in registers. # [BLOCK_N, HEAD_DIM_P2] float32"""
    n_groups: tl.constexpr = x.shape[1] // GROUP_SIZE
    offs_g = tl.arange(0, n_groups)  # [n_groups]
    group_ok = ok[:, None] & (offs_g[None, :] < HEAD_DIM // GROUP_SIZE)  # [BLOCK_N, n_groups]
    s = tl.load(scales + scale_base[:, None] + offs_g[None, :], mask=group_ok, other=0.0)  # [BLOCK_N, n_groups]
    s = s.to(tl.float32)
    # [BLOCK_N, n_groups, GROUP_SIZE]
    groups = tl.reshape(x.to(tl.float32), (x.shape[0], n_groups, GROUP_SIZE)) * s[:, :, None]
    return tl.reshape(groups, (x.shape[0], x.shape[1]))


@triton.jit
def _load_int4_tile(pool, scales, base, scale_base, ok, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                    GROUP_SIZE: tl.constexpr):
    """int4 rows: HEAD_DIM / 2 bytes per token, element 2i in the low nibble; each group's code * scale + minimum,
    with the (scale, minimum) pairs read as one contiguous run per token. # [BLOCK_N, HEAD_DIM_P2] float32"""
    offs_b = tl.arange(0, HEAD_DIM_P2 // 2)  # [HEAD_DIM_P2 / 2]
    packed = tl.load(pool + base[:, None] + offs_b[None, :], mask=ok[:, None] & (offs_b[None, :] < HEAD_DIM // 2),
                     other=0)  # [BLOCK_N, HEAD_DIM_P2 / 2] uint8
    codes = tl.reshape(tl.join(packed & 0x0F, packed >> 4), (packed.shape[0], HEAD_DIM_P2))  # [BLOCK_N, HEAD_DIM_P2]
    n_groups: tl.constexpr = HEAD_DIM_P2 // GROUP_SIZE
    offs_m = tl.arange(0, 2 * n_groups)  # [2 * n_groups] (scale, minimum) of each group, in order
    meta = tl.load(scales + scale_base[:, None] + offs_m[None, :],
                   mask=ok[:, None] & (offs_m[None, :] < 2 * (HEAD_DIM // GROUP_SIZE)), other=0.0).to(tl.float32)
    scale, low = tl.split(tl.reshape(meta, (packed.shape[0], n_groups, 2)))  # [BLOCK_N, n_groups] each
    groups = tl.reshape(codes.to(tl.float32), (packed.shape[0], n_groups, GROUP_SIZE))  # [BLOCK_N, n_groups, GROUP]
    groups = groups * scale[:, :, None] + low[:, :, None]
    return tl.reshape(groups, (packed.shape[0], HEAD_DIM_P2))


@triton.jit
def _online_softmax_step(qt, k, v, visible, scale_log2, softcap, m_i, l_i, acc, DOT_PRECISION: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr):
    """Fold one tile of keys into the running max m_i [BLOCK_M], sum l_i [BLOCK_M] and output acc
    [BLOCK_M, HEAD_DIM_P2]; the dots run in qt's dtype and accumulate in float32."""
    s = tl.dot(qt, tl.trans(k.to(qt.dtype)), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:  # softcap * tanh(score / softcap), in base 2; tanh(x) = 1 - 2 / (exp(2x) + 1) saturates cleanly
        capped = 1.0 - 2.0 / (tl.exp2(s * (2.0 / softcap)) + 1.0)  # s / LOG2E is the score: exp(2x) = exp2(2s / cap)
        s = capped * (softcap * 1.4426950408889634)  # LOG2E (a module global is not visible in a compiled kernel)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: exp2(-inf) = 0, no NaN
    p = tl.exp2(s - m_base[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_base)  # [BLOCK_M] rescales what was accumulated under the old max
    acc = acc * alpha[:, None] + tl.dot(p.to(qt.dtype), v.to(qt.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _paged_attention_kernel(
        q, k_pool, v_pool, k_scales, v_scales, out, mid_out, mid_lse,
        block_tables, context_lens, query_start, query_lens, scale_log2, window, softcap,
        q_s_tok, q_s_head, kv_s_block, kv_s_off, kv_s_head, sc_s_block, sc_s_off, sc_s_head, bt_s_seq,
        o_s_tok, o_s_head, mo_s_tok, mo_s_head, mo_s_split, ml_s_tok, ml_s_head,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        Q_TILES: tl.constexpr, QUANT_BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, DOT_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) // Q_TILES
    q_tile = tl.program_id(2) % Q_TILES
    ctx_len = tl.load(context_lens + seq)
    q_len = tl.load(query_lens + seq)
    first_tok = tl.load(query_start + seq)  # this sequence's first row in the flat new-token batch

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tok = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query token of each row, within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)  # [BLOCK_M]
    q_pos = ctx_len - q_len + tok  # [BLOCK_M] context position of each row's token
    offs_d = tl.arange(0, HEAD_DIM_P2)  # [HEAD_DIM_P2]
    d_ok = offs_d < HEAD_DIM
    q_rows = (first_tok + tok) * q_s_tok + head * q_s_head  # [BLOCK_M]
    # [BLOCK_M, HEAD_DIM_P2]
    qt = tl.load(q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        qt = qt.to(tl.float32)  # both dots follow qt's dtype

    # this split's keys, cut at the last position any row of this query tile may see
    split_len = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q))
    end = tl.where(q_tile * BLOCK_Q < q_len, end, start)  # a query tile past this sequence's tokens: no work
    if window > 0:  # nothing before the first row's window is visible to any row of the tile
        first_visible = ctx_len - q_len + q_tile * BLOCK_Q - window + 1
        start = tl.maximum(start, first_visible // BLOCK_N * BLOCK_N)  # tile-aligned, as the loop expects
        end = tl.maximum(end, start)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [BLOCK_M] running max of scores (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # [BLOCK_M] running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)  # [BLOCK_M, HEAD_DIM_P2]
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions of this tile's keys
        kv_ok = pos < end
        blk = tl.load(block_tables + seq * bt_s_seq + pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        base = blk * kv_s_block + off * kv_s_off + kv_head * kv_s_head  # [BLOCK_N]
        scale_base = blk * sc_s_block + off * sc_s_off + kv_head * sc_s_head  # [BLOCK_N]
        k = _load_kv_tile(k_pool, k_scales, base, scale_base, offs_d, kv_ok, HEAD_DIM, QUANT_BITS, GROUP_SIZE)
        v = _load_kv_tile(v_pool, v_scales, base, scale_base, offs_d, kv_ok, HEAD_DIM, QUANT_BITS, GROUP_SIZE)
        visible = kv_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N] causal
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(qt, k, v, visible, scale_log2, softcap, m_i, l_i, acc, DOT_PRECISION,
                                             HAS_SOFTCAP)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row that saw no key (empty split) outputs 0
    o = acc / l_safe[:, None]  # [BLOCK_M, HEAD_DIM_P2]
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_rows = (first_tok + tok) * o_s_tok + head * o_s_head  # [BLOCK_M]
        tl.store(out + o_rows[:, None] + offs_d[None, :], cast_rne(o, out.dtype.element_ty), mask=mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # [BLOCK_M] base-2 log-sum-exp
        mo_rows = (first_tok + tok) * mo_s_tok + head * mo_s_head + split * mo_s_split  # [BLOCK_M]
        tl.store(mid_out + mo_rows[:, None] + offs_d[None, :], o, mask=mask)
        tl.store(mid_lse + (first_tok + tok) * ml_s_tok + head * ml_s_head + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(mid_out, mid_lse, out, mo_s_tok, mo_s_head, mo_s_split, ml_s_tok, ml_s_head,
                         o_s_tok, o_s_head, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P2: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)  # [NUM_SPLITS]
    offs_d = tl.arange(0, HEAD_DIM_P2)  # [HEAD_DIM_P2]
    lse = tl.load(mid_lse + tok * ml_s_tok + head * ml_s_head + offs_s)  # [NUM_SPLITS]
    m = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [NUM_SPLITS]; 0 for empty splits
    rows = tok * mo_s_tok + head * mo_s_head + offs_s * mo_s_split  # [NUM_SPLITS]
    # [NUM_SPLITS, HEAD_DIM_P2]
    parts = tl.load(mid_out + rows[:, None] + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    total = tl.sum(weight, axis=0)
    merged = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_P2]
    tl.store(out + tok * o_s_tok + head * o_s_head + offs_d, cast_rne(merged, out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def paged_attention_triton(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                           query_lens: torch.Tensor, max_query_len: int, num_splits: int, scale: float,
                           block_n: int | None = None, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """query: [n_new, n_heads, head_dim] (unit last stride), the new tokens of all sequences in batch order;
    pools: [num_blocks, block_size, num_kv_heads, head_dim] (+ int8 scales [..., head_dim / 32]), or int4 as
    uint8 [..., head_dim / 2] (+ (scale, minimum) pairs [..., head_dim / 32, 2]);
    block_tables: [n_seqs, max_blocks] int32; context_lens, query_start, query_lens: [n_seqs] int32.
    num_splits: a power of two. window: sliding window in positions (None: global); softcap: soft-capping of the
    scores (None: none). Returns [n_new, n_heads, head_dim] in query's dtype."""
    n_new, n_heads, head_dim = query.shape
    n_seqs, num_kv_heads = block_tables.shape[0], k_pool.shape[2]
    out = torch.empty(n_new, n_heads, head_dim, dtype=query.dtype, device=query.device)  # [n_new, n_heads, head_dim]
    if n_new == 0 or n_seqs == 0:
        return out
    tiles = _tiles(n_heads // num_kv_heads, max_query_len, head_dim, block_n)
    mid_out, mid_lse = _split_buffers(n_new, n_heads, head_dim, num_splits, query.device)
    scales = (k_scales.stride(0), k_scales.stride(1), k_scales.stride(2)) if k_scales is not None else (0, 0, 0)
    bits = quant_bits(k_pool, k_scales)
    grid = (n_seqs, num_kv_heads, num_splits * tiles["Q_TILES"])
    _paged_attention_kernel[grid](
        query, k_pool, v_pool, k_scales if k_scales is not None else k_pool,
        v_scales if v_scales is not None else v_pool, out, mid_out, mid_lse,
        block_tables, context_lens, query_start, query_lens, scale * LOG2E, window or 0, softcap or 0.0,
        query.stride(0), query.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), *scales,
        block_tables.stride(0), out.stride(0), out.stride(1), *_strides(mid_out, mid_lse),
        BLOCK_SIZE=k_pool.shape[1], NUM_SPLITS=num_splits, QUANT_BITS=bits,
        GROUP_SIZE=QUANT_GROUPS["int4" if bits == 4 else "int8"],
        HAS_SOFTCAP=bool(softcap), **_dot_options(query.dtype), **tiles, **_launch_options(tiles, query.dtype))
    if num_splits > 1:
        _merge_splits_kernel[(n_new, n_heads)](
            mid_out, mid_lse, out, *_strides(mid_out, mid_lse), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P2=tiles["HEAD_DIM_P2"])
    return out


def _tiles(group: int, max_query_len: int, head_dim: int, block_n: int | None) -> dict[str, int]:
    """Tile sizes (constexprs): query tokens per program, rows per tile (16 at least: tl.dot's minimum)."""
    block_q = min(triton.next_power_of_2(max(1, max_query_len)), _floor_pow2(max(1, MAX_TILE_ROWS // group)))
    return {"GROUP": group, "HEAD_DIM": head_dim, "HEAD_DIM_P2": max(16, triton.next_power_of_2(head_dim)),
            "BLOCK_Q": block_q, "BLOCK_M": max(16, triton.next_power_of_2(block_q * group)),
            "BLOCK_N": block_n or 32, "Q_TILES": triton.cdiv(max(1, max_query_len), block_q)}


def _launch_options(tiles: dict[str, int], dtype: torch.dtype) -> dict[str, int]:
    """Warps and pipeline stages, chosen so that ptxas reports no spills on sm_80 and sm_90 (64-key tiles,
    or 4 warps at head size 128, spilled); untimed: tune on a GPU."""
    small = tiles["HEAD_DIM_P2"] <= 64 and tiles["BLOCK_M"] <= 16 and dtype != torch.float32
    return {"num_warps": 4 if small else 8, "num_stages": 2}


def _dot_options(dtype: torch.dtype) -> dict:
    """float32 dots in full precision (TF32 would lose what a float32 model asks for); bfloat16 dots in
    float32 under the interpreter, whose bfloat16 tl.dot multiplies the raw bits."""
    f32 = dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
    return {"DOT_F32": f32, "DOT_PRECISION": "ieee" if f32 else "tf32"}


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _split_buffers(n_new: int, n_heads: int, head_dim: int, num_splits: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs [n_new, n_heads, num_splits, head_dim] and base-2 log-sum-exps
    [n_new, n_heads, num_splits], float32; 1-element placeholders when there is one split."""
    if num_splits == 1:
        return torch.empty(1, 1, 1, 1, device=device), torch.empty(1, 1, 1, device=device)
    return (torch.empty(n_new, n_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(n_new, n_heads, num_splits, dtype=torch.float32, device=device))


def _strides(mid_out: torch.Tensor, mid_lse: torch.Tensor) -> tuple[int, ...]:
    return mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1)
