"""Engine -> gateway: token events (one per request per step) and periodic engine stats."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a request ended; a str enum, so it compares equal to its wire value ("stop" == FinishReason.STOP)."""
    STOP = "stop"  # a stop token, stop string or EOS
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"  # the client went away, or the server is shutting down
    ERROR = "error"  # this request failed; `error` says why


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str = ""  # the token's text, filled by the engine server (only it holds the tokenizer)


@dataclass(frozen=True)
class Logprob:
    token_id: int  # the sampled token
    logprob: float
    token: str = ""
    top: tuple[TopLogprob, ...] = ()  # alternatives, best first


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_ids: tuple[int, ...]  # tokens generated since the last event of this request
    text: str  # final text since the last event (held back while it may become a stop string)
    finish_reason: FinishReason | None = None  # None while running
    error: str | None = None
    logprobs: tuple[Logprob, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error_code: str = ""  # with ERROR: "engine_busy", "kv_cache_full", "engine_unavailable" (retry later: 503),
    # "" for a failure of the request itself (500)
    # n > 1: the choice these tokens belong to. finish_reason ends the whole request (its last choice, or all of
    # them: ERROR and ABORT end every choice); choice_finish ends choice `index` while others still run
    index: int = 0
    choice_finish: FinishReason | None = None

    @classmethod
    def ending(cls, request_id: str, reason: FinishReason, error: str | None = None,
               num_prompt_tokens: int = 0, error_code: str = "") -> TokenEvent:
        """A terminal event with no tokens (abort, failure)."""
        return cls(request_id, (), "", reason, error, num_prompt_tokens=num_prompt_tokens, error_code=error_code)


@dataclass(frozen=True)
class EngineMemory:
    """Where the decode engine process's memory goes, in bytes (decode_gpu/service/memory.py). The parts held in
    tensors are counted by their bytes; `libraries` and `rss` are measured; `other` is what is left of the RSS."""
    rss: int  # the process's resident memory now
    libraries: int  # resident before the model loaded: Python, torch, transformers, our code
    weights: dict[str, int]  # the model's tensors by the precision held: q8_0, int4, int8, float32, bfloat16, ...
    kv_pool: int  # the paged KV pool's size
    kv_pool_resident: int  # ... of which in memory now: on the CPU its pages become resident as blocks are first used
    swap: int  # host copies of preempted sequences' KV
    buffers: int  # the rotary tables and the step's persistent inputs
    device: str  # where weights, pool and buffers live: "cpu" (inside the RSS) or a GPU (outside it)
    other: int  # rss less the above that live in it: tokenizer, grammar tables, activations, allocator slack


@dataclass(frozen=True)
class EngineDecisions:
    """The decisions the engine takes while serving, as they stand (docs/decode.md, "Decisions measured while
    serving")."""
    weights: str  # what the linear layers hold, e.g. "q8_0" or "int4 (lm_head int8) up to batch 4, bfloat16 above"
    float_above: int = -1  # the start-up plan's cut-off: quantized weights up to this batch; -1: no weight switch
    # batch sizes the switch moved off that cut-off while serving, "rows/mode" -> precision ("quantized" | "float")
    weight_moved: dict[str, str] = field(default_factory=dict)
    weight_step_ms: dict[str, float] = field(default_factory=dict)  # its estimates, "rows/precision/mode" -> ms
    speculation: str = "off"  # off (not configured) | paused (turned off under load) | drafting | not drafting
    spec_plain_level: float = 0.0  # live cost model: observed / start-up modelled ms of plain steps (0: none)
    spec_verify_level: float = 0.0  # ... of verify steps (0: none seen yet; they follow the plain level)
    spec_steps_since_verify: int = 0  # steps with drafts proposed but none verified (a probe verifies at 64)


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_used: int
    kv_blocks_total: int
    kv_capacity_tokens: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_preemptions: int
    last_step_ms: float
    tokens_per_s: float  # generated tokens per second, smoothed over recent steps
    generated_tokens: int
    decode_yielded_s: float = 0.0  # time decode waited for more important prefills (decode_gpu.core.priority_gate)
    backlog_bytes: int = 0  # handoff bytes accepted but not yet imported into the pool (admission control)
    backlog_limit_bytes: int = 0  # beyond this the engine refuses handoffs
    weight_dtype: str = ""  # what the decode model's linear layers hold: int8, int4, bfloat16, ...
    weight_bytes: dict[str, int] = field(default_factory=dict)  # the model's parameters and buffers, by dtype
    # speculative decoding (vLLM's vllm:spec_decode_* counters), cumulative: sequence-steps that verified a draft,
    # draft tokens proposed, draft tokens accepted, and accepted tokens by draft position
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    prefix_cache_queries: int = 0  # prompt tokens of imports looked up in the pool's prefix cache (full blocks)
    prefix_cache_hits: int = 0  # ... and found there, so not imported again
    # decode step ms by batch size, as measured while serving (decode_gpu/core/step_times.py; sizes run in the
    # last 30 s), and the sequences running or waiting with a TPOT objective of their own: the gateway's TPOT check
    step_ms: dict[int, float] = field(default_factory=dict)
    tpot_sequences: int = 0
    memory: EngineMemory | None = None  # by component, refreshed with the stats (engine process only)
    decisions: EngineDecisions | None = None  # the weight plan and speculation as they stand (engine process only)
