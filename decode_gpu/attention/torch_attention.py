"""The torch path of paged attention: each context gathered from the pool into dense tensors, then a masked
SDPA; on the CPU, and as the Triton kernels' test oracle. The masks cut to a sliding window (and their additive
float forms) are built once per forward by the first layer that needs them and kept on the PagedBatch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decode_gpu.attention.paged_batch import NO_EXTRAS, Extras, PagedBatch

# On the CPU, attention over at most this many (row, context token) pairs runs on one thread: its gather and SDPA
# are a few tens of microseconds of work, and a parallel region that small costs more in its fork and join than it
# saves; on a loaded machine (prefill workers on the same cores) far more, as the region waits for a descheduled
# thread (a batch-1 step's 30 layers: ~4 ms of attention on one thread against 17-500 ms on two, load 4 on 2 cores)
ONE_THREAD_TOKENS = 2048


def torch_attention(paged: PagedBatch, layer: int, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                    scale: float, extras: Extras = NO_EXTRAS) -> torch.Tensor:
    """Gather every context into dense tensors, then one masked SDPA. # [n_new, n_heads, head_dim]"""
    threads = torch.get_num_threads() if q.device.type == "cpu" else 1
    if threads > 1 and (paged.one_thread or _attended_tokens(paged) <= ONE_THREAD_TOKENS):
        torch.set_num_threads(1)
        try:
            paged.pool.write(layer, paged.slot_mapping, new_k, new_v)
            return _torch_context_attention(paged, layer, q, scale, extras)
        finally:
            torch.set_num_threads(threads)
    paged.pool.write(layer, paged.slot_mapping, new_k, new_v)
    return _torch_context_attention(paged, layer, q, scale, extras)


def _attended_tokens(paged: PagedBatch) -> int:
    """(row, context token) pairs the torch path gathers and attends, from host facts (no sync). Groups count whole."""
    if paged.groups:
        return sum(_attended_tokens(group) for _, group in paged.groups)
    blocks = paged.decode_blocks if paged.decode_blocks is not None else paged.gather_blocks
    return blocks.numel() * paged.pool.shape.block_size


def _torch_context_attention(paged: PagedBatch, layer: int, q: torch.Tensor, scale: float,
                             extras: Extras) -> torch.Tensor:
    """After the store: each group of sequences on its own (PagedBatch.groups), else the whole batch, one new
    token each or any number. # q: [n_new, n_heads, head_dim] -> the same shape"""
    if paged.groups:
        out = torch.empty_like(q)
        for rows, group in paged.groups:
            out.index_copy_(0, rows, _torch_context_attention(group, layer, q.index_select(0, rows), scale, extras))
        return out
    if paged.decode_blocks is not None:
        return _torch_decode_attention(paged, layer, q, scale, extras)
    return _torch_query_attention(paged, layer, q, scale, extras)


def _torch_query_attention(paged: PagedBatch, layer: int, q: torch.Tensor, scale: float,
                           extras: Extras) -> torch.Tensor:
    """Queries of any length per sequence. # q: [n_new, n_heads, head_dim] -> the same shape"""
    n_seqs, max_q = paged.query_index.shape
    # [n_seqs * n_blocks, block_size, num_kv_heads, head_dim]
    k_ctx, v_ctx = paged.pool.gather_blocks(layer, paged.gather_blocks, q.dtype)
    k_ctx = k_ctx.view(n_seqs, -1, *k_ctx.shape[2:])  # [n_seqs, span, num_kv_heads, head_dim]
    v_ctx = v_ctx.view(n_seqs, -1, *v_ctx.shape[2:])
    # [n_seqs, max_query, n_heads, head_dim]
    q_seq = q.index_select(0, paged.query_index.view(-1)).view(n_seqs, max_q, *q.shape[1:])
    # [n_seqs, heads, len, head_dim]
    q_seq, k_ctx, v_ctx = q_seq.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2)
    if extras.softcap is None:
        # [n_seqs, n_heads, max_query, head_dim]
        out = _attend_grouped(paged, q_seq, k_ctx, v_ctx, extras.window, scale)
    else:
        out = _attend(q_seq, k_ctx, v_ctx, _mask(paged, extras.window)[:, None], scale, extras.softcap)
    out = out.transpose(1, 2).reshape(n_seqs * max_q, *q.shape[1:])  # [n_seqs * max_query, n_heads, head_dim]
    return out.index_select(0, paged.output_rows)  # [n_new, n_heads, head_dim]: the new tokens are in sequence order


def _torch_decode_attention(paged: PagedBatch, layer: int, q: torch.Tensor, scale: float,
                            extras: Extras) -> torch.Tensor:
    """One new token per sequence: gather whole blocks (one copy per block, not per token) and mask each
    row past its context. # q: [n_seqs, n_heads, head_dim] -> [n_seqs, n_heads, head_dim]"""
    n_seqs = q.shape[0]
    # [n_seqs * n_blocks, block_size, num_kv_heads, head_dim]
    k_ctx, v_ctx = paged.pool.gather_blocks(layer, paged.decode_blocks, q.dtype)
    if paged.decode_len is not None:
        return _exact_decode_attention(paged, q, k_ctx, v_ctx, scale, extras)
    k_ctx = k_ctx.view(n_seqs, -1, *k_ctx.shape[2:]).transpose(1, 2)  # [n_seqs, kv_heads, span, head_dim]
    v_ctx = v_ctx.view(n_seqs, -1, *v_ctx.shape[2:]).transpose(1, 2)
    if extras.softcap is None:  # the grouped layout, in every dtype (see there)
        return _attend_grouped(paged, q[:, :, None], k_ctx, v_ctx, extras.window, scale)[:, :, 0]
    mask = _mask(paged, extras.window)  # [n_seqs, 1, 1, span]
    out = _attend(q[:, :, None], k_ctx, v_ctx, mask, scale, extras.softcap)  # [n_seqs, n_heads, 1, head_dim]
    return out[:, :, 0]


def _exact_decode_attention(paged: PagedBatch, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                            scale: float, extras: Extras) -> torch.Tensor:
    """Every row's context is exactly paged.decode_len long: the gathered blocks cut to it (to its last `window`
    positions on a sliding layer) and attended with no mask, which is what the mask would leave.
    q: [n_seqs, n_heads, head_dim]; k_ctx, v_ctx: [n_seqs * n_blocks, block_size, kv_heads, head_dim]
    -> [n_seqs, n_heads, head_dim]"""
    n_seqs, n_heads, d = q.shape
    length = paged.decode_len
    start = max(0, length - extras.window) if extras.window else 0
    k = k_ctx.view(n_seqs, -1, *k_ctx.shape[2:])[:, start:length].transpose(1, 2)  # [n_seqs, kv_heads, len, d]
    v = v_ctx.view(n_seqs, -1, *v_ctx.shape[2:])[:, start:length].transpose(1, 2)
    kv_heads = k.shape[1]
    if extras.softcap is not None:
        return _attend(q[:, :, None], k, v, None, scale, extras.softcap)[:, :, 0]
    # the query heads of a KV head as its query rows (_attend_grouped's layout)
    out = F.scaled_dot_product_attention(q.reshape(n_seqs, kv_heads, n_heads // kv_heads, d), k, v, scale=scale)
    return out.view(n_seqs, n_heads, d)


def _mask(paged: PagedBatch, window: int | None) -> torch.Tensor:
    """The torch path's mask (decode: [n_seqs, 1, 1, span]; else [n_seqs, max_query, span]), cut to the last
    `window` positions of each query: once per forward, shared by every sliding layer."""
    decode = paged.decode_blocks is not None
    mask = paged.decode_mask if decode else paged.query_mask
    if not window:
        return mask
    if window not in paged.window_masks:
        if decode:  # the query sits at context_len - 1
            span = torch.arange(mask.shape[-1], device=mask.device)  # [span]
            cut = mask & (span[None, :] >= paged.context_lens[:, None] - window)[:, None, None]
        else:
            max_q, span = mask.shape[1:]
            # [n_seqs, max_q]
            query_pos = (paged.context_lens - paged.query_lens)[:, None] + torch.arange(max_q, device=mask.device)
            key_pos = torch.arange(span, device=mask.device)  # [span]
            in_window = key_pos[None, None, :] > query_pos[:, :, None] - window  # [n_seqs, max_q, span]
            cut = mask & (in_window | ~paged.query_valid[:, :, None])  # padded rows keep their one key
        paged.window_masks[window] = cut
    return paged.window_masks[window]


def _attend_grouped(paged: PagedBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                    scale: float) -> torch.Tensor:
    """Masked SDPA with the query heads that share a KV head stacked as query rows of that head, under an additive
    float mask. SDPA's own GQA on the CPU costs more: a verify step's attention (4 sequences x 5 queries, 256
    keys, 9 heads on 3) takes 130 us a layer in bfloat16 with enable_gqa and a boolean mask, 65 us so; one query
    in float32 293 against 195. One query in bfloat16 was 183 against 208 on the AVX2 machine, and the decode path
    kept enable_gqa there, but on a CPU with native bfloat16 (AVX512, 2026-12-05) enable_gqa's one query took 6x
    the grouped layout's: 1024 against 171 us at 8 sequences, 4139 against 649 at 32 (a third of a batch-32 step):
    every path takes this layout now. Each query row sees the same keys either way, so the result is the same.
    q: [n, n_heads, n_q, d]; k, v: [n, kv_heads, n_k, d] -> [n, n_heads, n_q, d]"""
    n, n_heads, n_q, d = q.shape
    kv_heads = k.shape[1]
    group = n_heads // kv_heads
    # head h = kv_head * group + g, so row g * n_q + i of KV head kv_head is query i of head h
    out = F.scaled_dot_product_attention(q.reshape(n, kv_heads, group * n_q, d), k, v,
                                         attn_mask=_additive_mask(paged, window, group, q.dtype), scale=scale)
    return out.view(n, n_heads, n_q, d)


def _additive_mask(paged: PagedBatch, window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:
    """_mask as an additive float mask (0 or -inf), once a forward: decode [n, 1, 1, n_k] (the same for every head and
    group); else [n, 1, group * n_q, n_k], the queries repeated for each head of a group (_attend_grouped's rows)."""
    key = (window, group, dtype)
    if key not in paged.additive_masks:
        mask = _mask(paged, window)  # decode: [n, 1, 1, n_k]; else [n, n_q, n_k]
        rows = mask[:, 0] if mask.dim() == 4 else mask.repeat(1, group, 1)  # [n, 1 or group * n_q, n_k]
        additive = torch.zeros(rows.shape, dtype=dtype, device=rows.device).masked_fill_(~rows, float("-inf"))
        paged.additive_masks[key] = additive[:, None]  # [n, 1, 1 or group * n_q, n_k]
    return paged.additive_masks[key]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
    """Masked attention; SDPA unless the scores are soft-capped, which SDPA cannot do.
    q: [n, n_heads, n_q, d]; k, v: [n, kv_heads, n_k, d]; mask: broadcastable to [n, n_heads, n_q, n_k], or None
    (every key is attended)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, n_heads, n_k, d]
    scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)  # [n, n_heads, n_q, n_k]
    scores = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return weights @ v
