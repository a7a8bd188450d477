"""A request's sampling as its body asked for it: typed from the moment the body is parsed until the gateway builds
the contracts.handoff.SamplingParams a prefill worker takes (the policy decides max_tokens and logprobs between)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from contracts.handoff import SamplingParams


@dataclass(frozen=True)
class SamplingRequest:
    """SamplingParams' fields, each as parsed (edge.api.fields checked its type and range)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None  # None: the policy's default applies
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    structured: tuple[str, str] | None = None  # (kind, source) of contracts.grammar.KINDS
    n: int = 1

    def decided(self, max_tokens: int, logprobs: int | None) -> SamplingRequest:
        """With the policy's decision (policies.enforcer.Decision) applied."""
        return dataclasses.replace(self, max_tokens=max_tokens, logprobs=logprobs)

    def params(self) -> SamplingParams:
        """What a prefill worker and the engine sample with; only once the policy has decided max_tokens."""
        if self.max_tokens is None:
            raise ValueError("max_tokens is decided by the policy before the request is sampled")
        return SamplingParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
