"""The KV handoff message: the one wire format between a prefill worker and the decode engine.

Versioned msgpack. The K and V payloads are the bytes llama.cpp stored (f16 or q8_0/q4_0 blocks),
never floats; the metadata says how to read them (dtype, rotation, RoPE layout, V transposition).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from contracts.kv_dtypes import kv_dtype

HANDOFF_VERSION = 7  # 2: num_kv_heads (was n_kv_heads); 3: sampling output controls (penalties, logit_bias,
# min_p, ...); 4: n choices (SamplingParams.n, KVHandoff.other_choices); 5: sliding-window layers
# (KVLayout.swa_layers/swa_start); 6: KVHandoff.resume_index (recompute preemption); 7: KVHandoff.cache_salt
# (prompt caches per tenant)


class HandoffFormatError(ValueError):
    """Bytes that do not decode to a well-formed handoff of this version."""


# a temperature below this is greedy, in the prefill worker and the decode engine alike: dividing logits by it
# can overflow float32 (vLLM's cut-off)
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # number of top alternatives to report, None for none
    # output controls, applied in this order to the raw logits (docs/sampling.md): min_tokens bans the end
    # tokens, logit_bias adds, the penalties, then temperature, min_p, top-k, top-p. Logprobs stay those of
    # the raw distribution.
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from each token already generated (OpenAI)
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per time a token was generated (OpenAI)
    repetition_penalty: float = 1.0  # > 0, 1 off: tokens in the prompt or output, logit / r if > 0 else * r (vLLM)
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the likeliest (after temperature)
    min_tokens: int = 0  # the end-of-sequence and stop_token_ids are banned until this many tokens are out
    ignore_eos: bool = False  # generation does not end at the end-of-sequence token (stop_token_ids still end it)
    # structured output: (kind, source) from contracts.grammar.KINDS, masking every token from the first on
    structured: tuple[str, str] | None = None
    n: int = 1  # choices: the prompt is prefilled once, each choice samples with its own seed (choice_seed)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request samples with. Choice 0 keeps the request's own, so n = 1 samples as
    it always did; the others get distinct, reproducible ones (a golden-ratio stride through the uint64 space).
    None stays None: each choice then draws its own."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


@dataclass(frozen=True)
class KVLayout:
    n_layer: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    k_dtype: str  # "f16", "q8_0", "q4_0"
    v_dtype: str
    v_transposed: bool  # V stored [n_embd_v, n_tokens] (llama.cpp without flash attention)
    k_rotation: int  # 0: none; n: each run of n head elements multiplied by the n x n Walsh-Hadamard matrix
    v_rotation: int
    rope_layout: str  # "interleaved": llama.cpp index 2i is HF index i, 2i+1 is i + d/2; "neox": same as HF
    # Sliding-window layers (Gemma 2/3) carry only the cells llama.cpp keeps for the window: positions swa_start
    # to the end. The importer fills the positions before with zeros, which no query attends to.
    swa_layers: tuple[int, ...] = ()
    swa_start: int = 0

    def rows(self, layer: int, n_tokens: int) -> int:
        """How many tokens' K/V the handoff carries for this layer."""
        return n_tokens - self.swa_start if layer in self.swa_layers else n_tokens


@dataclass(frozen=True)
class FirstToken:
    """A choice's first token, sampled by the prefill worker, with its log-probabilities when asked for."""
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token, logprob) alternatives, best first


@dataclass(frozen=True)
class KVHandoff:
    request_id: str
    model_fingerprint: str
    layout: KVLayout
    positions: tuple[int, ...]  # position of each cached token
    prompt_tokens: tuple[int, ...]
    first_token: int  # sampled by the prefill worker from the prompt's last logits
    k_layers: tuple[bytes, ...]  # per layer, n_tokens rows as llama.cpp stored them
    v_layers: tuple[bytes, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs earlier
    first_logprob: float | None = None  # log-probability of first_token, when sampling.logprobs is set
    first_top_logprobs: tuple[tuple[int, float], ...] = ()  # (token, logprob) alternatives, best first
    other_choices: tuple[FirstToken, ...] = ()  # choices 1 .. n-1: first tokens drawn from the same logits
    # >= 0: not a new request but the recomputed KV of choice `resume_index` of one that is decoding, preempted by
    # recompute: its prompt and output but the newest token (decode_gpu.core.scheduler, preemption_mode "recompute")
    resume_index: int = -1
    cache_salt: str = ""  # the engine's prefix cache shares blocks only between handoffs of one salt (PrefillJob)
    deadline: float = 0.0  # the request's TTFT deadline, epoch seconds (PrefillJob.deadline); 0: no objective
    tpot_slo_ms: int = 0  # its class's time-per-output-token objective; 0: none

    @property
    def first_tokens(self) -> tuple[FirstToken, ...]:
        """Every choice's first token, choice 0 first."""
        return (FirstToken(self.first_token, self.first_logprob, self.first_top_logprobs), *self.other_choices)

    @property
    def n_tokens(self) -> int:
        return len(self.positions)

    @property
    def payload_bytes(self) -> int:
        return sum(map(len, self.k_layers)) + sum(map(len, self.v_layers))


def encode_handoff(handoff: KVHandoff) -> bytes:
    return _ENCODER.encode(_Envelope(HANDOFF_VERSION, handoff))


def decode_handoff(data: bytes) -> KVHandoff:
    """Typed decode: every field is checked against its declared type, then the payload sizes."""
    try:
        version = msgspec.msgpack.decode(data, type=_VersionOnly).version
    except msgspec.DecodeError as err:
        raise HandoffFormatError(f"handoff is not a valid versioned msgpack map: {err}") from None
    if version != HANDOFF_VERSION:
        raise HandoffFormatError(f"handoff version {version!r}, this build reads version {HANDOFF_VERSION}")
    try:
        handoff = _DECODER.decode(data).handoff
    except msgspec.DecodeError as err:  # ValidationError included: a field of the wrong type or missing
        raise HandoffFormatError(f"handoff fields do not match version {HANDOFF_VERSION}: {err}") from None
    check_payload_sizes(handoff)
    return handoff


def max_handoff_bytes(num_layers: int, num_kv_heads: int, head_dim_k: int, head_dim_v: int, max_tokens: int) -> int:
    """The largest handoff a model can produce: every position in f16 (the widest KV type), the token ids and
    positions (msgpack: at most 9 bytes each), plus room for sampling params and stop strings."""
    per_token = num_layers * kv_dtype("f16").row_bytes(num_kv_heads * (head_dim_k + head_dim_v)) + 2 * 9
    return max_tokens * per_token + (1 << 20)


@dataclass(frozen=True)
class _Envelope:
    version: int
    handoff: KVHandoff


@dataclass(frozen=True)
class _VersionOnly:  # read the version first, so a skewed peer gets a version error, not a field error
    version: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Envelope)


def check_payload_sizes(handoff: KVHandoff) -> None:
    """Each layer's bytes must be exactly its rows (n_tokens, or a sliding window's tail) of the declared dtype."""
    lay = handoff.layout
    if not (len(handoff.k_layers) == len(handoff.v_layers) == lay.n_layer):
        raise HandoffFormatError(f"handoff has {len(handoff.k_layers)} K and {len(handoff.v_layers)} V layers, "
                                 f"layout says {lay.n_layer}")
    if not 0 <= lay.swa_start < max(1, handoff.n_tokens) or not all(0 <= il < lay.n_layer for il in lay.swa_layers):
        raise HandoffFormatError(f"sliding-window layers {lay.swa_layers} from position {lay.swa_start} do not fit "
                                 f"{lay.n_layer} layers of {handoff.n_tokens} tokens")
    try:
        k_row = kv_dtype(lay.k_dtype).row_bytes(lay.num_kv_heads * lay.head_dim_k)
        v_row = kv_dtype(lay.v_dtype).row_bytes(lay.num_kv_heads * lay.head_dim_v)
    except ValueError as err:
        raise HandoffFormatError(str(err)) from None
    for il, (k, v) in enumerate(zip(handoff.k_layers, handoff.v_layers)):
        rows = lay.rows(il, handoff.n_tokens)
        if len(k) != k_row * rows or len(v) != v_row * rows:
            raise HandoffFormatError(f"layer {il}: K {len(k)} / V {len(v)} bytes, expected {k_row * rows} / "
                                     f"{v_row * rows} for {rows} tokens")
    if len(handoff.other_choices) != handoff.sampling.n - 1:
        raise HandoffFormatError(f"sampling asks for {handoff.sampling.n} choices, the handoff carries "
                                 f"{len(handoff.other_choices) + 1} first tokens")
    if len(handoff.prompt_tokens) != handoff.n_tokens:
        raise HandoffFormatError(f"{len(handoff.prompt_tokens)} prompt tokens but {handoff.n_tokens} cached positions")
