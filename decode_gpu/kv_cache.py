"""The interface a KV handoff is written through, and the dense cache that implements it for now.

`KVWriter` is what the paged cache will implement too: the importer only ever calls `write_layer`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache, PretrainedConfig


class KVWriter(Protocol):
    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [n_tokens, num_kv_heads, head_dim] in the Hugging Face layout, after RoPE."""


class DenseKVCache:
    """One sequence's KV as a transformers DynamicCache (contiguous, grows by concatenation)."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype) -> None:
        self.cache = DynamicCache(config=config)
        self.dtype = dtype
        self._next_layer = 0

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if layer != self._next_layer:  # DynamicCache fills layers in order
            raise ValueError(f"layer {layer} written out of order, expected {self._next_layer}")
        # [n_tokens, num_kv_heads, head_dim] -> [1, num_kv_heads, n_tokens, head_dim]
        self.cache.update(keys.transpose(0, 1)[None].to(self.dtype), values.transpose(0, 1)[None].to(self.dtype), layer)
        self._next_layer += 1

    @property
    def n_tokens(self) -> int:
        return self.cache.get_seq_length()
