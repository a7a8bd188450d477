"""Which torch device and dtype the decode engine runs on."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on the CPU (fast, exact) and bfloat16 on CUDA."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, not {name!r}") from None
