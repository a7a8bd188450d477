"""Which torch device and dtype the decode engine runs on."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CPU features with native bfloat16 dot products (oneDNN uses them for bfloat16 matmuls)
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_ALIGN = 64  # bytes: each tensor of a lazily committed mapping starts on a cache line


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA, and on a CPU with native bfloat16 (AVX512-BF16 or AMX), where the engine's
    step measured 1.35-1.62x faster than float32 from batch 4 up, and at batch 1 too once its weights are
    prepacked (docs/decode.md); float32 on other CPUs, where bfloat16 is emulated and slower."""
    if name == "auto":
        dtype = _auto_dtype(device)
        log.info("--dtype auto: %s on %s", str(dtype).removeprefix("torch."), _describe(device))
        return dtype
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, not {name!r}") from None


def _auto_dtype(device: torch.device) -> torch.dtype:
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_supports_bfloat16() else torch.float32


def _describe(device: torch.device) -> str:
    if device.type != "cpu":
        return str(device)
    support = "native bfloat16" if cpu_supports_bfloat16() else "no native bfloat16"
    return f"a CPU with {support} (capability {torch.backends.cpu.get_cpu_capability()})"


def cpu_supports_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively: the kernel's CPU flags, or torch's own check (non-Linux)."""
    torch_check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # private: absent in some versions
    return bool(_BF16_FLAGS & cpu_flags()) or (callable(torch_check) and bool(torch_check()))


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux: no flags known, so no bfloat16 claimed
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def lazy_zeros(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zero tensors of these shapes. On the CPU they share one private anonymous mapping, whose pages the kernel
    hands out zeroed on their first write: memory becomes resident as it is used (a KV pool's blocks as sequences
    take them), not all at start as torch.zeros's writes make it. Elsewhere, torch.zeros."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    item = torch.empty(0, dtype=dtype).element_size()
    sizes = [-(-math.prod(shape) * item // _ALIGN) * _ALIGN for shape in shapes]
    mapping = mmap.mmap(-1, max(1, sum(sizes)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as a view of it lives
    tensors, start = [], 0
    for shape, size in zip(shapes, sizes):
        n = math.prod(shape) * item
        tensors.append(raw[start:start + n].view(dtype).view(shape))
        start += size
    return tensors


def resident_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the pages these CPU tensors span that are resident now (mincore; a page shared by two counts once).
    0 where libc has no mincore."""
    libc = _libc()
    if libc is None:
        return 0
    page = mmap.PAGESIZE
    spans = sorted((t.data_ptr() // page, -(-(t.data_ptr() + t.numel() * t.element_size()) // page)) for t in tensors
                   if t.device.type == "cpu" and not t.is_mkldnn and t.numel())
    merged: list[list[int]] = []
    for first, end in spans:
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([first, end])
    resident = 0
    for first, end in merged:
        vec = (ctypes.c_ubyte * (end - first))()
        if libc.mincore(ctypes.c_void_p(first * page), ctypes.c_size_t((end - first) * page), vec) == 0:
            resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
    return resident * page


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        return libc
    except (OSError, AttributeError):
        return None
