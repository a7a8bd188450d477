"""The worker's prefill rate, measured on the real prefills it serves, held against the rate `prefill_weights = auto`
recorded for the file it loaded.

Every llama.cpp chunk of a prompt (llama_decode of up to n_batch tokens) is timed. Chunks of at least MIN_CHUNK tokens
run on all the worker's threads feed a moving estimate of tokens a second (each weighs WEIGHT; one chunk counts
at most 4x or a quarter of the estimate, so a stall does not swing it); chunks on fewer threads (the decode engine
decoding on the same cores) are counted apart, as the load they show.

Why the worker's weights do not switch while serving, and what this does instead: the choice between the given
GGUF and its converted copy is a ratio of llama.cpp's kernels for two weight types on this CPU. A busy neighbour
slows both files alike, and the start-up measurement takes turns between them (best of three), so what load moves
is the level of both rates, not their ratio; the decision stays right under load. Switching at run time would also
hold both files' weights, or stop prefilling while the other file loads and the contexts, the prompt cache and the
embedder's context are built again on it. The decision is wrong only if the load changed between the two files'
turns at the one start that measured; then the live rate of the file in use sits well above what was recorded for
it (that turn ran slowed). When it does for MIN_SAMPLES chunks (FASTER, with hysteresis: back to normal below
FASTER - BAND), the record is marked stale, logged, and the next start measures again; a live rate far below the
record (SLOWER) is logged as load. The estimate and its verdict are logged at each change (`prefill rate: ...`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from contracts.cache import write_record

log = logging.getLogger(__name__)
MIN_CHUNK = 64  # shorter chunks cost more a token (per-call overhead); the start-up measurement fed 256 at once
WEIGHT = 0.2  # each chunk's weight in the moving estimate
MIN_SAMPLES = 8  # chunks at all threads before the estimate is held against the record
FASTER = 1.3  # the live rate this many times the recorded one: the start-up measurement ran slowed (stale record)
SLOWER = 0.7  # ... this fraction of it, or less: the cores are shared now (load, not a wrong choice)
BAND = 0.1  # hysteresis: a verdict ends only once the level is back this far inside its threshold


@dataclass(frozen=True)
class Recorded:
    """What the start-up measurement found for the file the worker loaded."""
    tok_s: float  # prefill tokens a second of that file, at the worker's threads and n_batch
    record: Path  # the decision file (prefill_weights.DECISION_FILE)


class PrefillRate:
    def __init__(self, threads: int, recorded: Recorded | None = None) -> None:
        self.threads = threads  # the worker's full thread count: only chunks run on all of them are compared
        self.recorded = recorded
        self.tok_s: float | None = None  # moving estimate of tokens a second at all threads
        self.shared_tok_s: float | None = None  # the same for chunks on fewer threads (cores shared with decode)
        self.num_chunks = 0  # chunks counted into tok_s
        self.verdict = "as recorded"  # | "faster than recorded" | "slower than recorded"
        self.marked_stale = False

    def observe(self, tokens: int, seconds: float, threads: int) -> None:
        """One llama.cpp chunk of `tokens` prompt tokens took `seconds` on `threads` threads."""
        if tokens < MIN_CHUNK or seconds <= 0:
            return
        rate = tokens / seconds
        if threads < self.threads:
            self.shared_tok_s = _moved(self.shared_tok_s, rate)
            return
        self.tok_s = _moved(self.tok_s, rate)
        self.num_chunks += 1
        if self.num_chunks == MIN_SAMPLES:
            log.info("prefill rate: %s", self.describe())
        self._judge()

    @property
    def level(self) -> float | None:
        """The live rate over the recorded one (None until MIN_SAMPLES chunks, or without a record)."""
        if self.recorded is None or self.tok_s is None or self.num_chunks < MIN_SAMPLES:
            return None
        return self.tok_s / self.recorded.tok_s

    def describe(self) -> str:
        live = f"{self.tok_s:.0f} tok/s" if self.tok_s is not None else "not measured yet"
        text = f"{live} at {self.threads} threads over {self.num_chunks} chunks"
        if self.shared_tok_s is not None:
            text += f", {self.shared_tok_s:.0f} tok/s on fewer threads (decode on the same cores)"
        if self.recorded is not None:
            text += f"; recorded at start-up {self.recorded.tok_s:.0f} tok/s ({self.verdict})"
        return text

    def _judge(self) -> None:
        level = self.level
        if level is None:
            return
        verdict = self.verdict
        if verdict == "as recorded":
            verdict = ("faster than recorded" if level >= FASTER else "slower than recorded" if level <= SLOWER
                       else verdict)
        elif verdict == "faster than recorded" and level < FASTER - BAND or \
                verdict == "slower than recorded" and level > SLOWER + BAND:
            verdict = "as recorded"
        if verdict == self.verdict:
            return
        self.verdict = verdict
        if verdict == "slower than recorded":
            log.info("prefill rate: %s; the cores are busier than at the measurement, which slows the given file "
                     "and its copy alike: the choice stands", self.describe())
        elif verdict == "faster than recorded":
            log.warning("prefill rate: %s; the start-up measurement ran slowed, so its choice may be wrong: the "
                        "next start measures again", self.describe())
            self._mark_stale()
        else:
            log.info("prefill rate: %s", self.describe())

    def _mark_stale(self) -> None:
        """Note in the decision file why it is no longer trusted; prefill_weights measures again at the next start."""
        if self.marked_stale or self.recorded is None:
            return
        self.marked_stale = True
        record = self.recorded.record
        try:
            decision = json.loads(record.read_text())
            decision["stale"] = {"live_tok_s": round(self.tok_s or 0.0, 1), "threads": self.threads,
                                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            write_record(record, json.dumps(decision, indent=1))  # a worker starting now reads old or new, whole
        except (OSError, ValueError) as err:
            log.warning("prefill rate: could not mark %s stale (%s)", record, err)


def _moved(estimate: float | None, sample: float) -> float:
    if estimate is None:
        return sample
    sample = min(4 * estimate, max(estimate / 4, sample))
    return estimate + WEIGHT * (sample - estimate)
