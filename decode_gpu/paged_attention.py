"""Paged attention in plain torch (CPU and CUDA), plugged into transformers through its attention interface.

For a ragged batch of sequences in one call: the new tokens' K/V are written into the pool at their
slots, then each sequence's whole context is gathered through its block table and attended to with
the right causal extent. The transformers model code is used as is; only its attention function changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from decode_gpu.kv_pool import KVPool

ATTN_IMPLEMENTATION = "edge_paged"


@dataclass(frozen=True)
class PagedBatch:
    """Attention metadata for one forward; the model runner builds it, the attention function reads it."""
    pool: KVPool
    slot_mapping: torch.Tensor  # [n_new] pool slot of each new token, in batch order
    gather_slots: torch.Tensor  # [n_seqs, max_context] slots of each sequence's context (new tokens included), padded
    context_lens: torch.Tensor  # [n_seqs] context length of each sequence, new tokens included
    query_index: torch.Tensor  # [n_seqs, max_query] index into the new tokens of each sequence's queries, padded
    query_valid: torch.Tensor  # [n_seqs, max_query] False on padding rows
    query_mask: torch.Tensor  # [n_seqs, max_query, max_context] True where a query may attend to a key


def build_paged_batch(pool: KVPool, block_tables: list[list[int]], context_lens: list[int],
                      query_lens: list[int], device: torch.device) -> PagedBatch:
    """Sequence i has context_lens[i] tokens after this step, of which the last query_lens[i] are new."""
    bs = pool.shape.block_size
    max_ctx, max_q = max(context_lens), max(query_lens)
    gather = torch.zeros(len(block_tables), max_ctx, dtype=torch.long)
    query_index = torch.zeros(len(block_tables), max_q, dtype=torch.long)
    valid = torch.zeros(len(block_tables), max_q, dtype=torch.bool)
    mask = torch.zeros(len(block_tables), max_q, max_ctx, dtype=torch.bool)
    slots, start = [], 0
    for i, (table, n_ctx, n_q) in enumerate(zip(block_tables, context_lens, query_lens)):
        positions = torch.arange(n_ctx)
        seq_slots = torch.tensor(table, dtype=torch.long)[positions // bs] * bs + positions % bs
        gather[i, :n_ctx] = seq_slots
        slots.append(seq_slots[n_ctx - n_q:])
        query_index[i, :n_q] = torch.arange(start, start + n_q)
        valid[i, :n_q] = True
        query_pos = torch.arange(n_ctx - n_q, n_ctx)
        mask[i, :n_q, :n_ctx] = positions[None, :] <= query_pos[:, None]  # causal within the context
        mask[i, n_q:, 0] = True  # padded query rows attend somewhere (dropped later) so softmax stays finite
        start += n_q
    return PagedBatch(pool, torch.cat(slots).to(device), gather.to(device),
                      torch.tensor(context_lens, device=device), query_index.to(device), valid.to(device), mask.to(device))


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    paged: PagedBatch | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query: [1, n_heads, n_new, head_dim]; key/value: [1, num_kv_heads, n_new, head_dim] (after RoPE).
    Returns [1, n_new, n_heads, head_dim] as transformers expects."""
    if paged is None:
        raise RuntimeError("edge_paged attention needs a PagedBatch passed as `paged=` to the model forward")
    layer = module.layer_idx
    new_k = key[0].transpose(0, 1)  # [n_new, num_kv_heads, head_dim]
    new_v = value[0].transpose(0, 1)
    paged.pool.write(layer, paged.slot_mapping, new_k, new_v)
    k_ctx, v_ctx = paged.pool.gather(layer, paged.gather_slots, query.dtype)  # [n_seqs, max_ctx, num_kv_heads, head_dim]
    q = query[0].transpose(0, 1)[paged.query_index]  # [n_seqs, max_query, n_heads, head_dim]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),  # [n_seqs, heads, len, head_dim]
        attn_mask=paged.query_mask[:, None], scale=scaling, enable_gqa=True)  # [n_seqs, n_heads, max_query, head_dim]
    out = out.transpose(1, 2)  # [n_seqs, max_query, n_heads, head_dim]
    flat = torch.empty(query.shape[2], *out.shape[2:], dtype=out.dtype, device=out.device)  # [n_new, n_heads, head_dim]
    flat[paged.query_index[paged.query_valid]] = out[paged.query_valid]
    return flat[None], None


def _no_mask(*args, **kwargs) -> None:
    return None  # masking is done inside paged_attention from the block tables


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
