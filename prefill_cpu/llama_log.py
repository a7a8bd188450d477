"""Capture llama.cpp's log lines while a context is created, to read facts it only logs.

llama.cpp decides at context creation whether it rotates quantized K/V (`attn_rot_k = 1`) and says so
only in its log; we read the decision rather than re-deriving it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

import llama_cpp
from llama_cpp import _logger as llama_cpp_logger

log = logging.getLogger(__name__)


@contextlib.contextmanager
def captured_llama_log(lines: list[str]):
    """Append every llama.cpp log fragment to `lines`, then restore llama-cpp-python's own callback."""

    @llama_cpp.llama_log_callback
    def _collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR still reach the operator
            log.warning("llama.cpp: %s", text.decode("utf-8", errors="replace").rstrip())

    llama_cpp.llama_log_set(_collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(llama_cpp_logger.llama_log_callback, ctypes.c_void_p(0))
