"""One configured model (a `[[models]]` table, or the single-model keys as a one-entry table) and the keep_alive
durations it and a request may carry, with Ollama's meaning."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# the settings a [[models]] table may give for its own model; every other key is the server's and shared
PER_MODEL_KEYS = ("weight_dtype", "dtype", "kv_type", "kv_storage", "kv_cache_tokens", "prefill_workers",
                  "threads_per_worker", "n_ctx", "max_num_seqs", "max_model_len", "speculative",
                  "num_speculative_tokens", "prefill_weights", "tool_call_parser", "reasoning_parser")
FOREVER = math.inf  # keep_alive -1 (any negative): never unloaded for idleness
DEFAULT_KEEP_ALIVE = "5m"  # Ollama's default
_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive_seconds(value) -> float:
    """Ollama's keep_alive: a number of seconds or a duration ("30s", "5m", "1h", "1.5h", "250ms"); 0 unloads the
    model once its answer is out, a negative one keeps it loaded (FOREVER). ValueError names what is accepted."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration (\"5m\", \"30s\", seconds as a number, 0 or -1), "
                         f"got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ValueError(f"expected a duration (\"5m\", \"30s\", \"1h\", seconds as a number, 0 to "
                         f"unload after the answer, -1 to keep loaded), got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {value!r}")
    return FOREVER if seconds < 0 else seconds


@dataclass(frozen=True)
class ModelSpec:
    """A model clients name by `name`, served from the GGUF at `model` (None: the embedded one) with the server's
    settings but for `settings` (PER_MODEL_KEYS), unloaded after `keep_alive_s` idle (FOREVER: never), never
    evicted when `pinned` (and loaded at start)."""
    name: str
    model: str | None
    settings: tuple[tuple[str, object], ...] = ()
    keep_alive_s: float = 300.0
    pinned: bool = False
    source_keep_alive: str = field(default=DEFAULT_KEEP_ALIVE, compare=False)  # as written, for /api/ps and docs
