"""The paged KV pool on the device: per layer, K and V blocks, in a float dtype or int8 with group scales.

Created and owned by the model runner; every tensor here lives on the runner's device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
INT8_GROUP = 32  # elements sharing one scale in int8 storage (q8_0-style)
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    storage: str  # "float32", "float16", "bfloat16" or "int8"

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.storage)

    def bytes_per_block(self) -> int:
        """Host memory one block takes when swapped out (the scheduler's swap space is counted in blocks)."""
        return self.block_size * self.bytes_per_token()


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, storage: str) -> int:
    if storage == "int8":  # int8 values + one float16 scale per group
        per_head = head_dim + 2 * (head_dim // INT8_GROUP)
    else:
        per_head = head_dim * torch.empty(0, dtype=STORAGE_DTYPES[storage]).element_size()
    return 2 * num_layers * num_kv_heads * per_head  # K and V


class KVPool:
    def __init__(self, shape: PoolShape, device: torch.device) -> None:
        if shape.storage not in STORAGE_DTYPES:
            raise ValueError(f"KV storage must be one of {sorted(STORAGE_DTYPES)}, not {shape.storage!r}")
        if shape.storage == "int8" and shape.head_dim % INT8_GROUP:
            raise ValueError(f"int8 KV storage needs a head size divisible by {INT8_GROUP}")
        self.shape = shape
        dims = (shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        dtype = STORAGE_DTYPES[shape.storage]
        self.k = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.k_scale = self.v_scale = None
        if shape.storage == "int8":
            scale_dims = dims[:-1] + (shape.head_dim // INT8_GROUP,)
            self.k_scale = [torch.zeros(scale_dims, dtype=torch.float16, device=device) for _ in range(shape.num_layers)]  # [num_blocks, block_size, num_kv_heads, head_dim / 32]
            self.v_scale = [torch.zeros(scale_dims, dtype=torch.float16, device=device) for _ in range(shape.num_layers)]
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %s storage, %.1f MiB on %s",
                 shape.num_blocks, shape.block_size, shape.num_blocks * shape.block_size, shape.storage,
                 shape.num_blocks * shape.block_size * shape.bytes_per_token() / 2**20, device)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """slots: [n] flat pool slots (block * block_size + offset); keys, values: [n, num_kv_heads, head_dim]."""
        self._store(self.k[layer], self.k_scale[layer] if self.k_scale else None, slots, keys)
        self._store(self.v[layer], self.v_scale[layer] if self.v_scale else None, slots, values)

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: any shape S; returns K, V as [*S, num_kv_heads, head_dim] in dtype."""
        return (self._load(self.k[layer], self.k_scale[layer] if self.k_scale else None, slots, dtype),
                self._load(self.v[layer], self.v_scale[layer] if self.v_scale else None, slots, dtype))

    def gather_blocks(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks: [m] pool block ids; returns K, V as [m, block_size, num_kv_heads, head_dim] in dtype. One
        copy per block (not per token), which is what the CPU path's decode attention reads."""
        return (self._load_blocks(self.k[layer], self.k_scale[layer] if self.k_scale else None, blocks, dtype),
                self._load_blocks(self.v[layer], self.v_scale[layer] if self.v_scale else None, blocks, dtype))

    def copy_blocks(self, src: int, dst: int) -> None:
        for tensors in (self.k, self.v, self.k_scale or [], self.v_scale or []):
            for t in tensors:
                t[dst] = t[src]

    def read_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """Every tensor's rows for these blocks, copied to host memory (swap out). On CUDA the host copies
        are pinned and the copies non-blocking: the host goes on at once, and whatever the stream runs next
        (a swap in of these rows, or another sequence's writes to the freed blocks) runs after them."""
        index = device_index(blocks, self.k[0].device)
        return [_to_host(t.index_select(0, index)) for t in self._all_tensors()]

    def write_blocks(self, blocks: list[int], saved: list[torch.Tensor]) -> None:
        """Restore rows saved by read_blocks into (possibly different) blocks (swap in)."""
        index = device_index(blocks, self.k[0].device)
        for t, rows in zip(self._all_tensors(), saved):
            t.index_copy_(0, index, rows.to(t.device, non_blocking=True))

    def _all_tensors(self) -> list[torch.Tensor]:
        return self.k + self.v + (self.k_scale or []) + (self.v_scale or [])

    @staticmethod
    def _store(pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
        flat = pool.view(-1, *pool.shape[2:])  # [num_slots, num_kv_heads, head_dim]
        if scale is None:
            flat[slots] = x.to(pool.dtype)
            return
        groups = x.float().reshape(*x.shape[:-1], -1, INT8_GROUP)  # [n, heads, head_dim / 32, 32]
        group_scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        flat[slots] = torch.round(groups / group_scale).to(torch.int8).reshape(x.shape)
        scale.view(-1, *scale.shape[2:])[slots] = group_scale.squeeze(-1).to(scale.dtype)

    @staticmethod
    def _load_blocks(pool: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
        x = pool.index_select(0, blocks)  # [m, block_size, heads, head_dim]
        if scale is None:
            return x.to(dtype)
        s = scale.index_select(0, blocks).float()  # [m, block_size, heads, head_dim / 32]
        return (x.float().unflatten(-1, (-1, INT8_GROUP)) * s[..., None]).flatten(-2).to(dtype)

    @staticmethod
    def _load(pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = pool.view(-1, *pool.shape[2:])
        if scale is None:
            return flat[slots].to(dtype)
        q = flat[slots].float()  # [*S, heads, head_dim]
        s = scale.view(-1, *scale.shape[2:])[slots].float()  # [*S, heads, head_dim / 32]
        return (q.reshape(*q.shape[:-1], -1, INT8_GROUP) * s[..., None]).reshape(q.shape).to(dtype)


def device_index(ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ids as a device index, through pinned memory on CUDA (a non-blocking copy)."""
    host = torch.as_tensor(ids, dtype=torch.long)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.to("cpu")
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)
