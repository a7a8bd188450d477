"""Dequantize llama.cpp KV bytes on the device: the wire carries blocks, the GPU turns them into floats."""

from __future__ import annotations

import numpy as np
import torch

from contracts.kv_dtypes import kv_dtype


def dequantize(raw: bytes, dtype_name: str, n_elems_per_row: int, device: torch.device) -> torch.Tensor:
    """Return float32 [n_rows, n_elems_per_row] from llama.cpp row bytes; the bytes cross to the device as-is."""
    spec = kv_dtype(dtype_name)
    data = to_device(raw, device)  # [n_bytes]
    if not spec.quantized:
        return data.view(torch.float16).float().view(-1, n_elems_per_row)
    blocks = data.view(-1, spec.block_bytes)  # [n_blocks, block_bytes]
    scale = blocks[:, :2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    if spec.name == "q8_0":
        quants = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n_blocks, 32]
    else:  # q4_0: low nibbles are elements 0..15, high nibbles 16..31, stored with an offset of 8
        nibbles = blocks[:, 2:]  # [n_blocks, 16]
        quants = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float() - 8.0  # [n_blocks, 32]
    return (quants * scale).view(-1, n_elems_per_row)


def to_device(raw: bytes, device: torch.device) -> torch.Tensor:
    """The bytes as a uint8 tensor on the device. On CUDA through pinned memory with a non-blocking copy,
    so the engine thread does not wait for the transfer (later kernels on the stream do). # [n_bytes]"""
    if not raw:  # nothing left to import (a prompt wholly in the prefix cache); frombuffer refuses empty buffers
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    host = torch.empty(len(raw), dtype=torch.uint8, pin_memory=True)
    host.numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
    return host.to(device, non_blocking=True)
