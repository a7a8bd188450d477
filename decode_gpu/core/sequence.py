"""One request as the decode engine tracks it (engine-internal; no torch)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from contracts.handoff import KVHandoff, SamplingParams

PEER_YIELD = 0.5  # decode_priority's half level: below its own priority's prompts, above the next level's


class SeqState(enum.Enum):
    WAITING = "waiting"  # handed off, KV not yet in the pool
    RUNNING = "running"  # KV in the pool, decoding each step
    SWAPPED = "swapped"  # preempted: KV copied to host memory, waiting to resume
    RECOMPUTING = "recomputing"  # preempted: KV freed, waiting for a prefill worker's handoff of its tokens
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    priority: int  # lower runs earlier
    arrival: int  # engine-wide arrival counter: ties in priority go to the earlier arrival
    prompt_len: int
    tokens: list[int]  # prompt tokens, then generated tokens (the first came from the prefill worker)
    sampling: SamplingParams
    handoff: KVHandoff | None = None  # dropped once imported
    handoff_bytes: int = 0  # KV bytes of `handoff` counted in the engine's backlog; 0 once released
    num_cached: int = 0  # tokens whose K/V are in the pool (or in host swap space while SWAPPED)
    state: SeqState = SeqState.WAITING
    num_preemptions: int = 0
    num_swapped_blocks: int = 0  # blocks held in host swap space while SWAPPED
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    seed: int = 0  # int64 the sampler keys its noise with: the request's seed, or one drawn at admission
    # the engine's parts keep their per-sequence state here: "text" (IncrementalText, admission), "matcher" (the
    # grammar matcher of a structured request, admission), "draft" (speculator), "prefix_hashes" (scheduler)
    meta: dict = field(default_factory=dict)
    request_id: str = ""  # the request this sequence is a choice of ("": seq_id)
    index: int = 0  # which choice (n > 1)
    forks: list[Sequence] = field(default_factory=list)  # choices that share this one's prompt KV once imported
    deadline: float = 0.0  # its request's TTFT deadline (KVHandoff.deadline): earlier first within a priority
    tpot_slo_ms: int = 0  # its class's time-per-output-token objective; 0: none (the scheduler's batch limit)
    cache_salt: str = ""  # its handoff's (KVHandoff.cache_salt): whose compiled grammars its matcher may reuse

    def __post_init__(self) -> None:
        self.request_id = self.request_id or self.seq_id

    @property
    def rank(self) -> tuple[int, float, int]:
        """Priority first; within one, the earliest deadline (none: after those with one), then arrival."""
        return (self.priority, self.deadline or math.inf, self.arrival)

    @property
    def decode_priority(self) -> float:
        """The level its decode yields by (core/priority_gate.py): its priority, or half a level below it, yielding to
        the prompts of its own priority waiting for their first token (peer holds, bounded by the gate), for a choice
        of a request without a TPOT objective that either has a TTFT objective (its class promises first tokens, and
        its first has gone out) or has several choices (n > 1: its many rows slow a plain prompt's prefill beside
        them; measured, a plain 8-token answer took 0.73 s beside one n = 32 request against 0.15 s alone)."""
        peer = not self.tpot_slo_ms and (self.deadline or self.sampling.n > 1)
        return self.priority + PEER_YIELD if peer else float(self.priority)

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def next_position(self) -> int:
        """Position of the token fed next: the newest token, not yet cached."""
        return self.num_cached
