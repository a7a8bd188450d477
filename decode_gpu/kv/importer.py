"""Turn a KV handoff into the decode model's K/V: check it fits, dequantize, un-rotate, un-permute, write.

llama.cpp stores K = H · P(RoPE(k)) and V = H · v, where P is the LLaMA converter's row permutation
(interleaved RoPE) and H the orthonormal Walsh-Hadamard rotation applied to quantized caches. H is
symmetric with H·H = I, so applying H again undoes it; P is undone by de-interleaving.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from contracts.handoff import KVHandoff
from contracts.identity import GGUFIdentity
from contracts.kv_dtypes import kv_dtype
from decode_gpu.kv.dequant import dequantize


class HandoffMismatchError(ValueError):
    """The handoff was made by a different model, or for a different attention shape."""


class KVWriter(Protocol):
    """What a handoff is written through: `PagedKVWriter` (into a sequence's blocks of the paged pool,
    decode_gpu/runner/memory_moves.py) and the reference `DenseKVCache` implement it."""

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [n_tokens, num_kv_heads, head_dim] in the Hugging Face layout, after RoPE."""


def check_handoff_matches(handoff: KVHandoff, model: GGUFIdentity) -> None:
    lay = handoff.layout
    expected = {
        "model fingerprint": (handoff.model_fingerprint, model.fingerprint),
        "layers": (lay.n_layer, model.n_layer),
        "KV heads": (lay.num_kv_heads, model.num_kv_heads),
        "K head size": (lay.head_dim_k, model.head_dim_k),
        "V head size": (lay.head_dim_v, model.head_dim_v),
        "RoPE layout": (lay.rope_layout, model.rope_layout),
        "sliding-window layers": (lay.swa_layers, model.swa_layers),
    }
    diffs = [f"{name}: handoff {got!r}, decode model {want!r}" for name, (got, want) in expected.items() if got != want]
    if diffs:
        raise HandoffMismatchError(f"handoff {handoff.request_id} does not fit the loaded model "
                                   f"{model.path}: " + "; ".join(diffs))


@functools.lru_cache(maxsize=8)
def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """Orthonormal Sylvester Walsh-Hadamard matrix, as ggml_gen_hadamard builds it. # [n, n]"""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(device)


def unrotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x: [n_tokens, n_heads, head_dim]; multiply each run of `block` head elements by H again."""
    if block == 0:
        return x
    t, nh, d = x.shape
    return (x.reshape(t, nh, d // block, block) @ hadamard(block, x.device)).reshape(t, nh, d)


def unpermute_interleaved(k: torch.Tensor) -> torch.Tensor:
    """llama.cpp index 2i is HF index i and 2i+1 is HF index i + d/2. # [n_tokens, n_heads, head_dim]"""
    return torch.cat([k[..., 0::2], k[..., 1::2]], dim=-1)


def import_handoff(handoff: KVHandoff, model: GGUFIdentity, writer: KVWriter, device: torch.device,
                   start: int = 0) -> None:
    """Write the handoff's K/V of positions start..n-1 (the earlier ones are in the pool already: prefix caching,
    which is off for sliding-window models) through the writer, which places row 0 at position `start`."""
    check_handoff_matches(handoff, model)
    lay = handoff.layout
    if start and lay.swa_layers:
        raise ValueError("a handoff with sliding-window layers is imported whole")
    n_embd_k = lay.num_kv_heads * lay.head_dim_k
    k_row = kv_dtype(lay.k_dtype).row_bytes(n_embd_k)
    for layer in range(lay.n_layer):
        n_rows = lay.rows(layer, handoff.n_tokens) - start
        keys = dequantize(handoff.k_layers[layer][start * k_row:], lay.k_dtype, n_embd_k, device)
        keys = unrotate(keys.view(n_rows, lay.num_kv_heads, lay.head_dim_k), lay.k_rotation)
        if lay.rope_layout == "interleaved":
            keys = unpermute_interleaved(keys)
        values = unrotate(_values(handoff.v_layers[layer], lay, n_rows, start, device), lay.v_rotation)
        skipped = handoff.n_tokens - start - n_rows  # before a sliding window: never attended, written as zeros
        writer.write_layer(layer, _pad_front(keys, skipped), _pad_front(values, skipped))


def _pad_front(x: torch.Tensor, n: int) -> torch.Tensor:
    """n zero rows before x. # [n_rows, heads, head_dim] -> [n + n_rows, heads, head_dim]"""
    return x if n == 0 else torch.cat([x.new_zeros(n, *x.shape[1:]), x])


def _values(raw: bytes, lay, n_rows: int, start: int, device: torch.device) -> torch.Tensor:
    """V of the last n_rows tokens (from `start`) as [n_rows, num_kv_heads, head_dim_v]; llama.cpp without flash
    attention stores V transposed, which is unquantized, so its rows are cut after the cast."""
    n_embd_v = lay.num_kv_heads * lay.head_dim_v
    if lay.v_transposed:
        values = dequantize(raw, lay.v_dtype, start + n_rows, device).t()[start:]  # [n_embd_v, n] -> [n_rows, n_embd_v]
    else:
        values = dequantize(raw[start * kv_dtype(lay.v_dtype).row_bytes(n_embd_v):], lay.v_dtype, n_embd_v, device)
    return values.reshape(n_rows, lay.num_kv_heads, lay.head_dim_v)
