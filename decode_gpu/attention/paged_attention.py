"""Paged attention plugged into transformers through its attention interface: Triton kernels on CUDA,
plain torch on the CPU (and as the kernels' test oracle).

For a ragged batch of sequences in one call: the new tokens' K/V are written into the pool at their
slots, then each sequence attends to its whole context, read through its block table, with the right
causal extent (the new tokens are the last query_len of the context). The transformers model code is
used as is; only its attention function changes.

Backends, chosen by EDGE_ATTENTION_BACKEND (read once per process): "triton" reads the pool in place
(triton_attention.py, triton_store.py); "torch" gathers each context into dense tensors and runs a
masked SDPA; "auto" (the default) is triton on CUDA when Triton is installed, torch elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from decode_gpu.kv.pool import KVPool

log = logging.getLogger(__name__)
ATTN_IMPLEMENTATION = "edge_paged"
BACKENDS = ("auto", "torch", "triton")
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # shorter splits cost more in the merge than their parallelism gains


@dataclass(frozen=True)
class PagedBatch:
    """Attention metadata for one forward; the model runner builds it, the attention function reads it."""
    pool: KVPool
    backend: str  # "torch" or "triton"
    # [n_new] int32 pool slot of each new token, in batch order (negative: not stored, Triton path)
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [n_seqs, max_blocks] int32 pool blocks of each sequence, padded with 0
    context_lens: torch.Tensor  # [n_seqs] int32 context length of each sequence, new tokens included
    query_start: torch.Tensor  # [n_seqs] int32 index of each sequence's first new token in the batch
    query_lens: torch.Tensor  # [n_seqs] int32 new tokens of each sequence
    max_query_len: int
    num_splits: int  # KV splits per sequence in the Triton kernel, a power of two
    # the torch path's dense view (None on the triton path, which needs none of it)
    gather_blocks: torch.Tensor | None = None  # [n_seqs * n_blocks] each sequence's context's pool blocks, padded
    # [n_seqs, max_query] index into the new tokens of each sequence's queries, padded
    query_index: torch.Tensor | None = None
    query_valid: torch.Tensor | None = None  # [n_seqs, max_query] False on padding rows
    output_rows: torch.Tensor | None = None  # [n_new] index of each new token's row in the [n_seqs * max_query] output
    # [n_seqs, max_query, n_blocks * block_size] True where a query may attend to a key
    query_mask: torch.Tensor | None = None
    # the torch path's decode view (one new token per sequence, step_inputs.StepInputs builds it)
    decode_blocks: torch.Tensor | None = None  # [n_seqs * n_blocks] each sequence's first n_blocks pool blocks
    decode_mask: torch.Tensor | None = None  # [n_seqs, 1, 1, n_blocks * block_size] True inside the context
    # the torch path on the CPU: sequences of similar context length attended apart, each group padded to its own
    # longest context: (the group's new tokens [g] long, in batch order, and its own PagedBatch, which holds the
    # dense view; this batch's is then left out); empty: all together
    groups: tuple[tuple[torch.Tensor, PagedBatch], ...] = ()
    # the torch path's masks cut to a sliding window, by window: built by the first sliding layer of the forward
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, compare=False, repr=False)
    # the same as additive float masks for _attend_grouped, by (window, group, dtype): built by the first layer
    additive_masks: dict[tuple, torch.Tensor] = field(default_factory=dict, init=False, compare=False, repr=False)


@functools.cache
def configured_backend() -> str:
    """EDGE_ATTENTION_BACKEND, read once: the choice must not change between the layers of a forward."""
    name = os.environ.get("EDGE_ATTENTION_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"EDGE_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}, not {name!r}")
    return name


def resolve_backend(device: torch.device) -> str:
    name = configured_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "triton":
        if not _triton_available():
            raise RuntimeError("EDGE_ATTENTION_BACKEND=triton but Triton is not installed (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the Triton attention runs on the CPU only under TRITON_INTERPRET=1, "
                               "set before triton is imported")
    return name


@functools.cache
def _triton_available() -> bool:
    found = importlib.util.find_spec("triton") is not None
    if not found:
        log.warning("Triton is not installed: paged attention uses the torch gather path (slow on a GPU)")
    return found


def build_paged_batch(pool: KVPool, block_tables: list[list[int]], context_lens: list[int],
                      query_lens: list[int], device: torch.device, backend: str | None = None,
                      num_splits: int | None = None) -> PagedBatch:
    """Sequence i has context_lens[i] tokens after this step, of which the last query_lens[i] are new.
    A sequence may have no new tokens (a padded row): it is attended for nobody and stores nothing."""
    backend = backend or resolve_backend(device)
    bs = pool.shape.block_size
    starts = list(itertools.accumulate(query_lens, initial=0))[:-1]
    slots = [table[p // bs] * bs + p % bs for table, n_ctx, n_q in zip(block_tables, context_lens, query_lens)
             for p in range(n_ctx - n_q, n_ctx)]
    width = max(1, *map(len, block_tables))
    tables = [x for table in block_tables for x in (*table, *[0] * (width - len(table)))]
    # one host-to-device copy for every index tensor
    packed = torch.tensor(slots + context_lens + starts + query_lens + tables, dtype=torch.int32).to(device)
    n_seqs = len(block_tables)
    slot_mapping, ctx, start, q_lens, flat_tables = packed.split([len(slots), n_seqs, n_seqs, n_seqs, n_seqs * width])
    num_splits = num_splits or choose_num_splits(n_seqs, pool.shape.num_kv_heads, max(context_lens), device)
    dense = {}
    if backend == "torch":
        groups = length_groups(context_lens, bs) if device.type == "cpu" and n_seqs > 1 else []
        if len(groups) > 1:
            dense["groups"] = tuple(_query_group(pool, [block_tables[i] for i in rows], [context_lens[i] for i in rows],
                                                 [query_lens[i] for i in rows], [starts[i] for i in rows], device)
                                    for rows in groups)
        else:
            dense = _dense_index(bs, block_tables, context_lens, query_lens, device)
    return PagedBatch(pool, backend, slot_mapping, flat_tables.view(n_seqs, width), ctx, start, q_lens,
                      max(query_lens), num_splits, **dense)


def _query_group(pool: KVPool, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                 starts: list[int], device: torch.device) -> tuple[torch.Tensor, PagedBatch]:
    """Some sequences of a multi-token batch as a batch of their own (torch path): (their new tokens' rows in the
    whole batch, in order, and the PagedBatch whose queries are those rows)."""
    rows = torch.tensor([r for start, n_q in zip(starts, query_lens) for r in range(start, start + n_q)],
                        dtype=torch.long, device=device)  # [g_new]
    group_starts = list(itertools.accumulate(query_lens, initial=0))[:-1]
    width = max(map(len, block_tables))
    tables = torch.tensor([[*t, *[0] * (width - len(t))] for t in block_tables], dtype=torch.int32, device=device)
    as_tensor = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    group = PagedBatch(pool, "torch", as_tensor([]), tables, as_tensor(context_lens), as_tensor(group_starts),
                       as_tensor(query_lens), max(query_lens), 1,
                       **_dense_index(pool.shape.block_size, block_tables, context_lens, query_lens, device))
    return rows, group


# What attending to one group of rows more costs, in tokens of context gathered and attended (a gather of K and V,
# an SDPA, a copy in and out: about 40 us a layer, as much as about 450 tokens, bfloat16 on 2 cores of a Xeon)
GROUP_COST_TOKENS = 512
MAX_GROUPS = 4


def length_groups(context_lens: list[int], block_size: int) -> list[list[int]]:
    """Sequences split into groups of similar context length (at most MAX_GROUPS), each to be padded only to its own
    longest context on the CPU's torch path: the split that gathers the fewest tokens, counting GROUP_COST_TOKENS a
    group. Without it a batch of short contexts and one long one gathers and attends the long one's length for
    every sequence."""
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    blocks = [-(-context_lens[i] // block_size) * block_size for i in order]  # padded lengths, ascending
    n = len(order)
    if n * blocks[-1] - sum(blocks) <= GROUP_COST_TOKENS:  # padding to the longest costs less than a group more
        return [order]
    # best[g][i]: (cost, start of the last group) of the first i sequences in g groups
    best = [[(0, 0)] + [(float("inf"), 0)] * n]
    for _ in range(MAX_GROUPS):
        prev, row = best[-1], [(0, 0)] + [(float("inf"), 0)] * n
        for i in range(1, n + 1):
            row[i] = min((prev[j][0] + (i - j) * blocks[i - 1] + GROUP_COST_TOKENS, j) for j in range(i))
        best.append(row)
    groups_used = min(range(1, MAX_GROUPS + 1), key=lambda g: best[g][n][0])
    groups, end = [], n
    for g in range(groups_used, 0, -1):
        start = best[g][end][1]
        groups.append([order[i] for i in range(start, end)])
        end = start
    return [group for group in groups[::-1] if group]  # an empty group is never cheaper, but never return one


def choose_num_splits(n_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough programs for about two waves over the GPU's SMs, no split shorter than MIN_SPLIT_TOKENS;
    a power of two so the kernel compiles for few values."""
    want = -(-2 * _num_sms(device) // max(1, n_seqs * num_kv_heads))
    n = max(1, min(want, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splits only add work
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _dense_index(bs: int, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The torch path's gather blocks, query index and causal mask, padded to the longest context (in whole
    blocks: one copy per block, as the decode path reads them) and the longest query."""
    n_seqs, max_q = len(block_tables), max(query_lens)
    n_blocks = -(-max(context_lens) // bs)
    gather = torch.zeros(n_seqs, n_blocks, dtype=torch.long)  # [n_seqs, n_blocks] padded with block 0, masked
    query_index = torch.zeros(n_seqs, max_q, dtype=torch.long)  # [n_seqs, max_q]
    valid = torch.zeros(n_seqs, max_q, dtype=torch.bool)  # [n_seqs, max_q]
    output_rows = torch.cat([torch.arange(i * max_q, i * max_q + n_q) for i, n_q in enumerate(query_lens)])  # [n_new]
    mask = torch.zeros(n_seqs, max_q, n_blocks * bs, dtype=torch.bool)  # [n_seqs, max_q, span]
    start = 0
    for i, (table, n_ctx, n_q) in enumerate(zip(block_tables, context_lens, query_lens)):
        positions = torch.arange(n_ctx)  # [n_ctx]
        used = -(-n_ctx // bs)
        gather[i, :used] = torch.tensor(table[:used], dtype=torch.long)
        query_index[i, :n_q] = torch.arange(start, start + n_q)
        valid[i, :n_q] = True
        query_pos = torch.arange(n_ctx - n_q, n_ctx)  # [n_q]
        mask[i, :n_q, :n_ctx] = positions[None, :] <= query_pos[:, None]  # causal within the context
        mask[i, n_q:, 0] = True  # padded query rows attend somewhere (dropped later) so softmax stays finite
        start += n_q
    return {"gather_blocks": gather.flatten().to(device), "query_index": query_index.to(device),
            "query_valid": valid.to(device), "output_rows": output_rows.to(device), "query_mask": mask.to(device)}


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    paged: PagedBatch | None = None, sliding_window: int | None = None, softcap: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """query: [1, n_heads, n_new, head_dim]; key/value: [1, num_kv_heads, n_new, head_dim] (after RoPE).
    sliding_window: a query sees only the last `sliding_window` positions, its own included (Gemma's local
    layers); softcap: scores pass through softcap * tanh(score / softcap) (Gemma 2).
    Returns [1, n_new, n_heads, head_dim] as transformers expects."""
    if paged is None:
        raise RuntimeError("edge_paged attention needs a PagedBatch passed as `paged=` to the model forward")
    q = _unit_last_stride(query[0].transpose(0, 1))  # [n_new, n_heads, head_dim]
    new_k = _unit_last_stride(key[0].transpose(0, 1))  # [n_new, num_kv_heads, head_dim]
    new_v = _unit_last_stride(value[0].transpose(0, 1))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = paged.pool.rotate_k(q)  # into the basis the pool keeps K in (int4), which leaves every score as it was
    extras = _Extras(sliding_window or None, softcap or None)
    attend = _triton_attention if paged.backend == "triton" else _torch_attention
    return attend(paged, module.layer_idx, q, new_k, new_v, scale, extras)[None], None


@dataclass(frozen=True)
class _Extras:
    window: int | None
    softcap: float | None



def _triton_attention(paged: PagedBatch, layer: int, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                      scale: float, extras: _Extras = _Extras(None, None)) -> torch.Tensor:
    """Fused store, then the paged kernel reading the pool in place. # [n_new, n_heads, head_dim]"""
    store_kv, attend = _triton_kernels()
    pool = paged.pool
    k_scales = pool.k_scale[layer] if pool.k_scale else None
    v_scales = pool.v_scale[layer] if pool.v_scale else None
    store_kv(pool.k[layer], pool.v[layer], k_scales, v_scales, paged.slot_mapping, pool.rotate_k(new_k), new_v)
    return attend(q, pool.k[layer], pool.v[layer], k_scales, v_scales, paged.block_tables, paged.context_lens,
                  paged.query_start, paged.query_lens, paged.max_query_len, paged.num_splits, scale,
                  window=extras.window, softcap=extras.softcap)


@functools.cache
def _triton_kernels():
    # imported on first use: the kernels are defined at import, and under TRITON_INTERPRET only if it is set by then
    from decode_gpu.attention.triton_attention import paged_attention_triton
    from decode_gpu.attention.triton_store import store_kv
    return store_kv, paged_attention_triton


def _torch_attention(paged: PagedBatch, layer: int, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                     scale: float, extras: _Extras = _Extras(None, None)) -> torch.Tensor:
    """Gather every context into dense tensors, then one masked SDPA. # [n_new, n_heads, head_dim]"""
    paged.pool.write(layer, paged.slot_mapping, new_k, new_v)
    return _torch_context_attention(paged, layer, q, scale, extras)


def _torch_context_attention(paged: PagedBatch, layer: int, q: torch.Tensor, scale: float,
                             extras: _Extras) -> torch.Tensor:
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
                           extras: _Extras) -> torch.Tensor:
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
                            extras: _Extras) -> torch.Tensor:
    """One new token per sequence: gather whole blocks (one copy per block, not per token) and mask each
    row past its context. # q: [n_seqs, n_heads, head_dim] -> [n_seqs, n_heads, head_dim]"""
    n_seqs = q.shape[0]
    # [n_seqs * n_blocks, block_size, num_kv_heads, head_dim]
    k_ctx, v_ctx = paged.pool.gather_blocks(layer, paged.decode_blocks, q.dtype)
    k_ctx = k_ctx.view(n_seqs, -1, *k_ctx.shape[2:]).transpose(1, 2)  # [n_seqs, kv_heads, span, head_dim]
    v_ctx = v_ctx.view(n_seqs, -1, *v_ctx.shape[2:]).transpose(1, 2)
    if extras.softcap is None and q.dtype == torch.float32:  # the grouped layout wins in float32 only (see there)
        return _attend_grouped(paged, q[:, :, None], k_ctx, v_ctx, extras.window, scale)[:, :, 0]
    if extras.softcap is None:  # SDPA's own GQA under the additive mask: 5-10 % faster than under the boolean one
        group = q.shape[1] // k_ctx.shape[1]
        out = F.scaled_dot_product_attention(q[:, :, None], k_ctx, v_ctx, scale=scale, enable_gqa=True,
                                             attn_mask=_additive_mask(paged, extras.window, group, q.dtype))
        return out[:, :, 0]
    mask = _mask(paged, extras.window)  # [n_seqs, 1, 1, span]
    out = _attend(q[:, :, None], k_ctx, v_ctx, mask, scale, extras.softcap)  # [n_seqs, n_heads, 1, head_dim]
    return out[:, :, 0]


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
    in float32 293 against 195. One query in bfloat16 is the exception (183 against 208): the decode path keeps
    enable_gqa there, under the same additive mask. Each query row sees the same keys either way, so the result is
    the same.
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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """Masked attention; SDPA unless the scores are soft-capped, which SDPA cannot do.
    q: [n, n_heads, n_q, d]; k, v: [n, kv_heads, n_k, d]; mask: broadcastable to [n, n_heads, n_q, n_k]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, n_heads, n_k, d]
    scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)  # [n, n_heads, n_q, n_k]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return weights @ v


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# No mask function is registered on purpose: for an attention implementation without one, transformers skips
# mask creation entirely (masking is done inside paged_attention from the block tables). With one, it would
# look for packed sequences in position_ids and read the answer back to the host every forward: a host sync
# in eager steps, found by tests/decode_gpu/test_static_step.py's CPU check of host reads.
AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
