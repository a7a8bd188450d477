"""Paged attention plugged into transformers through its attention interface: Triton kernels on CUDA,
plain torch on the CPU (and as the kernels' test oracle).

For a ragged batch of sequences in one call: the new tokens' K/V are written into the pool at their
slots, then each sequence attends to its whole context, read through its block table, with the right
causal extent (the new tokens are the last query_len of the context). The transformers model code is
used as is; only its attention function changes.

Backends, chosen by EDGE_ATTENTION_BACKEND (backend.py): "triton" reads the pool in place
(triton_attention.py, triton_store.py); "torch" gathers each context into dense tensors and runs a
masked SDPA (torch_attention.py). The batch metadata is built in paged_batch.py.
"""

from __future__ import annotations

import functools

import torch

from decode_gpu.attention.paged_batch import NO_EXTRAS, Extras, PagedBatch
from decode_gpu.attention.torch_attention import torch_attention

ATTN_IMPLEMENTATION = "edge_paged"


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
    extras = Extras(sliding_window or None, softcap or None)
    return attend_paged(paged, module.layer_idx, q, new_k, new_v, scale, extras)[None], None


def attend_paged(paged: PagedBatch, layer: int, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                 scale: float, extras: Extras = NO_EXTRAS) -> torch.Tensor:
    """Store the new tokens' K/V in the pool, then attend each query to its sequence's context: the attention of
    both forwards (transformers' through paged_attention, the native one directly). q: [n_new, n_heads, head_dim];
    new_k, new_v: [n_new, num_kv_heads, head_dim], after RoPE, unit last stride. # [n_new, n_heads, head_dim]"""
    q = paged.pool.rotate_k(q)  # into the basis the pool keeps K in (int4), which leaves every score as it was
    attend = _triton_attention if paged.backend == "triton" else torch_attention
    return attend(paged, layer, q, new_k, new_v, scale, extras)


def _triton_attention(paged: PagedBatch, layer: int, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                      scale: float, extras: Extras = NO_EXTRAS) -> torch.Tensor:
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


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def use_paged_attention(model: torch.nn.Module) -> None:
    """transformers' forward of `model` attends through paged_attention. Registered here, not at import: the engine's
    native forward never imports transformers' modeling code (model/serving_model.py).

    No mask function is registered on purpose: for an attention implementation without one, transformers skips
    mask creation entirely (masking is done inside paged_attention from the block tables). With one, it would
    look for packed sequences in position_ids and read the answer back to the host every forward: a host sync
    in eager steps, found by tests/decode_gpu/test_static_step.py's CPU check of host reads."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
