"""The paged KV pool on the device: per layer, K and V blocks, in a float dtype, or int8 / int4 with group scales.

int8: q8_0-style, one float16 scale per 32 elements, codes in [-127, 127]. int4: two codes a byte (element
2i in the low nibble, 2i + 1 in the high one), one float16 (scale, minimum) pair per 32 elements, value =
code * scale + minimum with codes in [0, 15]. Chosen by teacher-forced fidelity on the embedded SmolLM2
(top-1 agreement / mean KL against float32 storage over 256 positions, codes simulated in the attention):
asymmetric groups of 32 0.92 / 0.048 (the pool itself, unrotated: 0.90 / 0.045, tests/decode_gpu/test_kv_pool_int4.py);
symmetric q4_0-style codes in groups of 32 0.86 / 0.093, in groups of 16 (the same bytes as ours) 0.87 / 0.062;
asymmetric groups of 64 0.84 / 0.146, of 16 0.89 / 0.033 (a fifth more bytes). K after RoPE is what suffers
(V alone in int4: 0.97 / 0.008), so int4 K is stored rotated (rotate_k; queries are rotated alike), as llama.cpp
does: the pool then gives 0.93 / 0.036. A head of 64 is 40 bytes against int8's 68: 0.59x.

Created and owned by the model runner; every tensor here lives on the runner's device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from decode_gpu.kv.importer import unrotate
from decode_gpu.runner.device import lazy_zeros

log = logging.getLogger(__name__)
INT8_GROUP = 32  # elements sharing one scale in int8 storage (q8_0-style)
INT4_GROUP = 32  # elements sharing one (scale, minimum) pair in int4 storage
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
                  "int4": torch.uint8}
QUANT_GROUPS = {"int8": INT8_GROUP, "int4": INT4_GROUP}  # quantized storages: elements per group


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    storage: str  # "float32", "float16", "bfloat16", "int8" or "int4"

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.storage)

    def bytes_per_block(self) -> int:
        """Host memory one block takes when swapped out (the scheduler's swap space is counted in blocks)."""
        return self.block_size * self.bytes_per_token()


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, storage: str) -> int:
    if storage == "int8":  # int8 values + one float16 scale per group
        per_head = head_dim + 2 * (head_dim // INT8_GROUP)
    elif storage == "int4":  # two values a byte + a float16 scale and minimum per group
        per_head = head_dim // 2 + 4 * (head_dim // INT4_GROUP)
    else:
        per_head = head_dim * torch.empty(0, dtype=STORAGE_DTYPES[storage]).element_size()
    return 2 * num_layers * num_kv_heads * per_head  # K and V


def storage_fits(storage: str, head_dim: int) -> bool:
    """Whether a pool of this storage can hold heads of this size (quantized groups must tile the head)."""
    return storage in STORAGE_DTYPES and head_dim % QUANT_GROUPS.get(storage, 1) == 0


class KVPool:
    def __init__(self, shape: PoolShape, device: torch.device) -> None:
        if shape.storage not in STORAGE_DTYPES:
            raise ValueError(f"KV storage must be one of {sorted(STORAGE_DTYPES)}, not {shape.storage!r}")
        if not storage_fits(shape.storage, shape.head_dim):
            raise ValueError(f"{shape.storage} KV storage needs a head size divisible by {QUANT_GROUPS[shape.storage]}")
        self.shape = shape
        self.int4 = shape.storage == "int4"
        # int4 K is stored rotated, which spreads a few large channels over the group (head_dim is a multiple of 32)
        self.k_rotation = shape.head_dim & -shape.head_dim if self.int4 else 0
        row = shape.head_dim // 2 if self.int4 else shape.head_dim  # int4: two codes a byte
        dims = (shape.num_blocks, shape.block_size, shape.num_kv_heads, row)
        dtype = STORAGE_DTYPES[shape.storage]
        # [num_blocks, block_size, num_kv_heads, head_dim (/ 2 for int4)]; on the CPU resident as blocks are used
        n = shape.num_layers
        kv = lazy_zeros([dims] * 2 * n, dtype, device)
        self.k, self.v = kv[:n], kv[n:]
        self.k_scale = self.v_scale = None
        if shape.storage in QUANT_GROUPS:
            # int8: [..., head_dim / 32] scales; int4: [..., head_dim / 32, 2] (scale, minimum) pairs
            scale_dims = dims[:-1] + (shape.head_dim // QUANT_GROUPS[shape.storage],) + ((2,) if self.int4 else ())
            scales = lazy_zeros([scale_dims] * 2 * n, torch.float16, device)
            self.k_scale, self.v_scale = scales[:n], scales[n:]
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %s storage, %.1f MiB on %s",
                 shape.num_blocks, shape.block_size, shape.num_blocks * shape.block_size, shape.storage,
                 shape.num_blocks * shape.block_size * shape.bytes_per_token() / 2**20, device)

    def rotate_k(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, head_dim] in the basis K is stored in (an int4 pool's: each run of k_rotation elements
        times the orthonormal Walsh-Hadamard H; a query rotated alike gives the same scores, H being orthonormal and
        symmetric); unchanged for other storages."""
        if not self.k_rotation:
            return x
        return unrotate(x.float(), self.k_rotation).to(x.dtype)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """slots: [n] flat pool slots (block * block_size + offset); keys, values: [n, num_kv_heads, head_dim].
        An int4 pool stores the keys rotated (rotate_k): gather and gather_blocks give them back that way."""
        self._store(self.k[layer], self.k_scale[layer] if self.k_scale else None, slots, self.rotate_k(keys))
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

    def _store(self, pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
        flat = pool.view(-1, *pool.shape[2:])  # [num_slots, num_kv_heads, head_dim (/ 2 for int4)]
        if scale is None:
            flat[slots] = x.to(pool.dtype)
            return
        codes, group_scale = quantize_int4(x) if self.int4 else quantize_int8(x)
        flat[slots] = codes
        scale.view(-1, *scale.shape[2:])[slots] = group_scale

    def _load_blocks(self, pool: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
        x = pool.index_select(0, blocks)  # [m, block_size, heads, head_dim (/ 2 for int4)]
        if scale is None:
            return x.to(dtype)
        return self._dequantize(x, scale.index_select(0, blocks), dtype)

    def _load(self, pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
        flat = pool.view(-1, *pool.shape[2:])
        if scale is None:
            return flat[slots].to(dtype)
        return self._dequantize(flat[slots], scale.view(-1, *scale.shape[2:])[slots], dtype)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(codes, scale, dtype) if self.int4 else dequantize_int8(codes, scale, dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] -> int8 codes [..., head_dim] and float16 scales [..., head_dim / 32]."""
    groups = x.float().unflatten(-1, (-1, INT8_GROUP))  # [..., head_dim / 32, 32]
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0  # [..., head_dim / 32, 1]
    return torch.round(groups / scale).to(torch.int8).flatten(-2), scale.squeeze(-1).to(torch.float16)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes: [..., head_dim] int8; scale: [..., head_dim / 32] -> [..., head_dim] in dtype."""
    return (codes.float().unflatten(-1, (-1, INT8_GROUP)) * scale.float()[..., None]).flatten(-2).to(dtype)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] -> packed codes [..., head_dim / 2] uint8 and (scale, minimum) [..., head_dim / 32, 2]
    float16. The scale's floor keeps an all-equal (or all-zero) group finite: its codes are all 0."""
    groups = x.float().unflatten(-1, (-1, INT4_GROUP))  # [..., head_dim / 32, 32]
    low = groups.amin(dim=-1, keepdim=True)  # [..., head_dim / 32, 1]
    scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15.0).clamp_min(1e-8)
    codes = torch.round((groups - low) / scale).clamp(0, 15).to(torch.uint8).flatten(-2)  # [..., head_dim]
    return pack_int4(codes), torch.cat([scale, low], dim=-1).to(torch.float16)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed: [..., head_dim / 2] uint8; scale: [..., head_dim / 32, 2] -> [..., head_dim] in dtype."""
    groups = unpack_int4(packed).float().unflatten(-1, (-1, INT4_GROUP))  # [..., head_dim / 32, 32]
    meta = scale.float()  # [..., head_dim / 32, 2]
    return (groups * meta[..., :1] + meta[..., 1:]).flatten(-2).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., n] uint8 in [0, 15], n even -> [..., n / 2]; element 2i low nibble, 2i + 1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed: [..., n / 2] uint8 -> codes [..., n] uint8, inverse of pack_int4."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def device_index(ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ids as a device index, through pinned memory on CUDA (a non-blocking copy)."""
    host = torch.as_tensor(ids, dtype=torch.long)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.to("cpu")
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)
