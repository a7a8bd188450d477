"""Which paged-attention backend a process uses, chosen by EDGE_ATTENTION_BACKEND (read once per process):
"triton" reads the pool in place, "torch" gathers each context into dense tensors, "auto" (the default) is
triton on CUDA when Triton is installed, torch elsewhere."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)
BACKENDS = ("auto", "torch", "triton")


@functools.cache
def configured_backend() -> str:
    """EDGE_ATTENTION_BACKEND, read once: the choice must not change between the layers of a forward."""
    name = os.environ.get("EDGE_ATTENTION_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"EDGE_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}, not {name!r}")
    return name


def resolve_backend(device: torch.device) -> str:
    name = configured_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "triton":
        if not _triton_available():
            raise RuntimeError("EDGE_ATTENTION_BACKEND=triton but Triton is not installed (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the Triton attention runs on the CPU only under TRITON_INTERPRET=1, "
                               "set before triton is imported")
    return name


@functools.cache
def _triton_available() -> bool:
    found = importlib.util.find_spec("triton") is not None
    if not found:
        log.warning("Triton is not installed: paged attention uses the torch gather path (slow on a GPU)")
    return found
