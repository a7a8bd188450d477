"""The control frames between the gateway, the prefill workers and the decode engine.

Every connection opens with the handshake (contracts.framing): the listener sends `Challenge`, the
connecting side answers `Hello` with an HMAC proof of the shared secret, the listener ends it with
`Welcome` (its own proof) or `Refused` (why). After that, frames flow as below.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.events import EngineStats, Logprob, TokenEvent
from contracts.handoff import SamplingParams


# --- handshake -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Challenge:  # listener -> connecting peer, first frame on every connection
    protocol_version: int
    nonce: bytes


@dataclass(frozen=True)
class Hello:  # connecting peer -> listener: who is speaking, and proof that it holds the secret
    role: str  # "gateway" or "prefill"
    name: str
    protocol_version: int
    nonce: bytes  # the listener proves itself over this one
    proof: bytes  # HMAC(secret, challenge nonce, role, name, nonce)


@dataclass(frozen=True)
class Welcome:  # listener -> peer: accepted
    proof: bytes  # HMAC(secret, the peer's nonce, the challenge nonce): the listener holds the secret too


@dataclass(frozen=True)
class Refused:  # listener -> peer, then the connection closes
    reason: str


# --- gateway <-> prefill worker ---------------------------------------------------------------------
@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    # for a template that renders tools itself: an assistant message's earlier calls as JSON text
    # ([{"id", "type", "function": {"name", "arguments"}}]), and a tool result's call id; "": none
    tool_calls: str = ""
    tool_call_id: str = ""


@dataclass(frozen=True)
class PrefillJob:  # gateway -> prefill worker
    request_id: str
    sampling: SamplingParams
    priority: int = 0
    prompt: str | None = None  # plain completion text
    messages: tuple[ChatMessage, ...] | None = None  # rendered with the GGUF's chat template
    prompt_tokens: tuple[int, ...] | None = None  # already tokenized prompt
    max_prompt_tokens: int = 2048
    kv_type: str = ""  # "" -> the worker's configured KV type; a degradation tier may ask for "q4_0"
    max_total_tokens: int = 0  # prompt + max_tokens must fit this (the decode side's context); 0: unchecked
    engine: str = ""  # the decode engine's address to hand off to, chosen per request; "": the worker's own (--engine)
    # >= 0: a recompute of choice `resume_index` of a request that is decoding (the engine preempted it): the
    # handoff carries it back (KVHandoff.resume_index), and the gateway's request does not start again
    resume_index: int = -1
    # which cached prompts this one may reuse: the prompt caches (the worker's and the engine's) share KV only
    # between requests of one salt, which the gateway derives from the API key (edge.core.cache_salt); "": unsalted
    cache_salt: str = ""
    # the request's TTFT deadline (epoch seconds, the gateway's clock; 0: no objective) and its class's TPOT objective
    # (ms; 0: none): within one priority the queues run the earliest deadline first (edge/core/slo.py), and the engine's
    # batch does not grow past what the tightest TPOT objective allows; the handoff carries both (KVHandoff)
    deadline: float = 0.0
    tpot_slo_ms: int = 0
    # >= 0: also report every prompt token's logprob and its top `prompt_logprobs` alternatives (PromptLogprobs,
    # before the handoff); the worker then asks llama.cpp for the logits of every prompt position
    prompt_logprobs: int = -1
    # "embed": no prefill; the worker answers with EmbedDone for embed_texts (or embed_tokens), one vector each
    task: str = "generate"
    embed_texts: tuple[str, ...] = ()
    embed_tokens: tuple[tuple[int, ...], ...] = ()
    # the request's tools as JSON text (OpenAI's list), for a chat template that renders them; "": none (the gateway
    # then wrote them into the messages itself, edge.chat.tools)
    tools: str = ""


@dataclass(frozen=True)
class PromptLogprobs:  # prefill worker -> gateway, before the handoff, for a job with prompt_logprobs >= 0
    request_id: str
    tokens: tuple[int, ...]  # the prompt as prefilled
    pieces: tuple[str, ...]  # each prompt token's text
    entries: tuple[Logprob, ...]  # tokens[1:]: each one's logprob given the tokens before it, and the top alternatives
    ranks: tuple[int, ...] = ()  # tokens[1:]: each one's rank in its distribution (1: the likeliest)


@dataclass(frozen=True)
class EmbedDone:  # prefill worker -> gateway: the answer to a job with task "embed"
    request_id: str
    dim: int
    vectors: bytes  # float32 little-endian, one row of `dim` per input, in the inputs' order, L2-normalized
    num_tokens: tuple[int, ...]  # each input's tokens
    embed_ms: float = 0.0


@dataclass(frozen=True)
class PrefillDone:  # prefill worker -> gateway, after the handoff went to the engine
    request_id: str
    num_prompt_tokens: int
    prefill_ms: float
    handoff_bytes: int
    handoff_ms: float  # export + encode + send
    cached_tokens: int = 0  # prompt tokens whose KV came from the worker's prompt cache
    resumed: bool = False  # the job was a recompute (PrefillJob.resume_index >= 0)
    handed_off: bool = True  # False: max_tokens was 0, so nothing went to an engine and the request is done


@dataclass(frozen=True)
class PrefillFailed:  # prefill worker -> gateway (or made by the gateway for a lost worker)
    request_id: str
    kind: str  # "prompt_too_long", "context_exceeded", "bad_prompt", "cancelled", "worker_died", "internal", ...
    message: str
    num_prompt_tokens: int = 0
    limit: int = 0


@dataclass(frozen=True)
class CancelPrefill:  # gateway -> prefill worker
    request_id: str


@dataclass(frozen=True)
class WorkerStatus:  # prefill worker -> gateway, right after the handshake
    name: str
    model_fingerprint: str
    n_ctx: int
    kv_type: str
    vocab_size: int  # the gateway checks token ids against it
    engine_connected: bool = True
    n_embd: int = 0  # the size of an embedding (0: unknown)
    pooling: str = ""  # how embeddings are pooled: "mean", "cls", "last", "rank" (a reranker's head)
    prefill_weights: str = ""  # the setting and what llama.cpp loaded: "auto: prefill-f16.gguf", "given: the GGUF"


@dataclass(frozen=True)
class ForgetSalt:  # gateway -> prefill worker: an operator deletes a tenant's cached prompts (RAM and disk tier)
    salt: str


@dataclass(frozen=True)
class SaltForgotten:  # prefill worker -> gateway: the answer to ForgetSalt
    salt: str
    entries: int  # prompt cache entries (llama.cpp sequences) dropped
    files: int  # disk tier files deleted


@dataclass(frozen=True)
class CacheTier:  # one tier of a worker's prompt cache, counts since the worker started
    name: str  # "ram" (llama.cpp cells), "disk" (kv_disk_bytes), "returned" (answers' KV from the engine)
    hits: int = 0  # prompts that reused KV of this tier (returned: answers' KV kept)
    misses: int = 0  # lookups that found nothing here (returned: answers' KV dropped: no room, a limit, a mismatch)
    entries: int = 0
    bytes: int = 0  # held now
    max_bytes: int = 0  # its limit (0: counted in tokens, or none)
    evictions: int = 0


@dataclass(frozen=True)
class Heartbeat:  # prefill worker -> gateway, every HEARTBEAT_INTERVAL_S: a silent worker is stuck
    busy_request_id: str | None = None
    engine_connected: bool = True
    cache_tiers: tuple[CacheTier, ...] = ()  # its prompt cache's tiers (/health, the status page)


# --- prefill worker -> decode engine -----------------------------------------------------------------
@dataclass(frozen=True)
class Handoff:
    request_id: str  # outside the payload, so a payload that fails to decode still fails its own request
    data: bytes  # contracts.handoff.encode_handoff(...)


@dataclass(frozen=True)
class ReturnedKV:  # decode engine -> the prefill worker that handed the request off, on that worker's connection
    request_id: str
    # encode_handoff(KVHandoff) of a finished sequence: prompt_tokens are every token whose KV it holds (prompt and
    # answer but the last token, which was never fed), in the handoff's own KV type; the worker keeps it as a prefix
    data: bytes


# --- gateway <-> decode engine -------------------------------------------------------------------------
@dataclass(frozen=True)
class Abort:  # gateway -> decode engine
    request_id: str


@dataclass(frozen=True)
class DecodeYield:  # gateway -> decode engine: best priority among prompts queued or prefilling (None: none)
    priority: int | None
    backlog: bool = False  # prompts wait in the gateway's queue for a free prefill worker (every ready one is busy)


@dataclass(frozen=True)
class Speculate:  # gateway -> decode engine: speculative decoding allowed now (a policy tier may turn it off)
    enabled: bool


@dataclass(frozen=True)
class Recompute:  # decode engine -> gateway: prefill these tokens of a preempted choice again, at this priority
    request_id: str
    index: int  # the choice
    tokens: tuple[int, ...]  # its prompt and output but the newest token (which it feeds next)
    sampling: SamplingParams
    priority: int


@dataclass(frozen=True)
class Token:  # decode engine -> gateway
    event: TokenEvent


@dataclass(frozen=True)
class Stats:  # decode engine -> gateway, periodically
    stats: EngineStats


MESSAGES = (Challenge, Hello, Welcome, Refused, ForgetSalt, SaltForgotten, PrefillJob, PrefillDone, PrefillFailed,
            CancelPrefill, WorkerStatus, Heartbeat, PromptLogprobs, EmbedDone, Handoff, ReturnedKV, Abort,
            DecodeYield, Speculate, Recompute, Token, Stats)
HEARTBEAT_INTERVAL_S = 1.0
