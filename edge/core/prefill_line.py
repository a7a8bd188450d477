"""The TTFT predictor's prefill cost, recorded while serving and read back by later starts (issue 47).

Until a first prefill ended, the predictor knew nothing, so a burst sent right after start was all admitted (1 of 64
met a 1.5 s objective). A start now begins from the line an earlier run of the same model file, prefill weights,
CPU, thread count and number of workers measured on its real prefills: a fixed part and a part per token, alone and
beside decoding (on a CPU-only box decode takes half a worker's threads), with the handoff's time, the prompt-cache
hit and the tokens per byte of text. Real prefills refine it from the first one on (PrefillTime's moving fit, where
the record weighs as one prefill); the record is written again at most every RECORD_EVERY_S once MIN_RECORDED
prefills were measured alone, the same way as the weight plan and the prefill rate keep theirs
(contracts/cache.py write_record: a start reading it meanwhile finds the old record or the new one, whole).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from contracts.cache import cache_root, write_record

log = logging.getLogger(__name__)
FOLDER = "slo"  # under the cache root: one record per settings
MIN_RECORDED = 6  # prefills measured alone before the line is worth recording
RECORD_EVERY_S = 30.0  # while serving, the record follows the moving fit at most this often


@dataclass(frozen=True)
class Line:
    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True)
class Recorded:
    alone: Line
    beside: Line | None  # None: no prefill was measured beside decoding
    handoff_s: float
    cached_tokens: float
    tokens_per_byte: float
    num_prefills: int
    recorded_at: str = ""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for row in info:
                if row.startswith("model name"):
                    return row.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def settings(fingerprint: str, prefill_weights: str, threads: int | None, workers: int) -> dict:
    """What a record must match: the model file and what the workers loaded of it, the CPU and its cores, the
    workers' threads (None: the default, cores / workers) and their number."""
    return {"model": fingerprint, "prefill_weights": prefill_weights, "cpu": cpu_name(), "cores": os.cpu_count(),
            "threads": threads or max(1, (os.cpu_count() or 1) // max(1, workers)), "workers": workers}


def record_path(settings_: dict, root: Path | None = None) -> Path:
    key = hashlib.sha256(json.dumps(settings_, sort_keys=True).encode()).hexdigest()[:20]
    return (root or cache_root()) / FOLDER / f"prefill-line-{key}.json"


def read(path: Path, settings_: dict) -> Recorded | None:
    """The record at `path` if it was made with these settings; None (a warning for a bad one) otherwise."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw["settings"] != settings_:
            raise ValueError(f"recorded for {raw['settings']}")
        beside = raw["beside"]
        found = Recorded(Line(*map(float, raw["alone"])), Line(*map(float, beside)) if beside else None,
                         float(raw["handoff_s"]), float(raw["cached_tokens"]), float(raw["tokens_per_byte"]),
                         int(raw["num_prefills"]), str(raw.get("recorded_at", "")))
        if min(found.alone.fixed_s, found.alone.per_token_s, found.tokens_per_byte) < 0:
            raise ValueError("a negative figure")
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the recorded prefill line %s: %s", path, err)
        return None
    log.info("TTFT prediction starts from the prefill line recorded at %s over %d prefills: %.0f ms + %.2f ms a "
             "token alone%s", found.recorded_at, found.num_prefills, found.alone.fixed_s * 1e3,
             found.alone.per_token_s * 1e3, "" if found.beside is None else
             f", {found.beside.fixed_s * 1e3:.0f} ms + {found.beside.per_token_s * 1e3:.2f} ms beside decoding")
    return found


def write(path: Path, settings_: dict, found: Recorded) -> None:
    body = asdict(found)
    body["alone"] = [found.alone.fixed_s, found.alone.per_token_s]
    body["beside"] = [found.beside.fixed_s, found.beside.per_token_s] if found.beside else None
    body["settings"] = settings_
    body["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        write_record(path, json.dumps(body, indent=1))
    except OSError as err:  # a read-only cache costs the next start its head start, nothing else
        log.warning("could not record the prefill line in %s: %s", path, err)
