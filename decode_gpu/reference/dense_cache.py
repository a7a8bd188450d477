"""The dense KV cache: one sequence's K/V as a transformers DynamicCache, written through the importer's
`KVWriter` interface. The handoff tests, `edge check-model` and `bench.handoff_bench` import handoffs into it (the
tests and check-model then run the reference decoder, dense_decoder.py, on its `cache`); serving writes into the
paged pool instead (`PagedKVWriter` in decode_gpu/runner/memory_moves.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig


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
