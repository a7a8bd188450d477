"""Which torch device and dtype the decode engine runs on."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CPU features with native bfloat16 dot products (oneDNN uses them for bfloat16 matmuls)
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


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
