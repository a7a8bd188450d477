"""What a choice outputs: the tokens it takes, the rules that end it, the text it releases and the token events
that carry them (with logprobs) to the gateway.

Admission reports the prefill worker's first token and the step every token after it by these same rules, so a
first token ends a request exactly as any later one would. Sampled rows arrive from sample/ as host values; no
torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from contracts.events import FinishReason, Logprob, TokenEvent, TopLogprob
from decode_gpu.core.detokenizer import IncrementalText
from decode_gpu.core.sequence import Sequence

if TYPE_CHECKING:
    from sampling.sampler import SampledRow


@dataclass(frozen=True)
class StopRules:
    """When a choice ends: a stop or end token, a complete grammar, its length, or a stop string in its text."""
    eos_token_ids: frozenset[int]
    max_model_len: int  # prompt + output tokens of one request

    def finish_reason_and_text(self, seq: Sequence) -> tuple[str | None, str]:
        """Whether the newest token ends the request, and the text it releases."""
        token = seq.tokens[-1]
        params = seq.sampling
        text_state: IncrementalText = seq.meta["text"]
        reason = None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif seq.meta.get("matcher") is not None and seq.meta["matcher"].is_terminated():
            reason = "stop"  # the grammar is complete (its end token was taken)
        elif len(seq.output_tokens) >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        eos = reason == "stop"
        text = text_state.update(seq.output_tokens[:-1] if eos else seq.output_tokens, final=reason is not None)
        if text_state.stopped:
            reason = "stop"
        return reason, text


def take_tokens(seq: Sequence, rows: list[SampledRow], stops: StopRules) -> tuple[tuple, str, str | None, tuple]:
    """Append the rows' tokens in order until one ends the request (draft tokens past a stop are dropped). Returns
    the tokens taken, the text they release, why the request ends (None: it goes on) and their logprobs. A bad
    row or a token outside the grammar raises: the caller fails this sequence only."""
    start, texts, logprobs, reason = len(seq.tokens), [], [], None
    for row in rows:
        seq.num_cached += 1  # the token before this one is now in the pool
        if row.problem is not None:
            raise FloatingPointError(row.problem)
        seq.tokens.append(row.token)
        matcher = seq.meta.get("matcher")
        if matcher is not None and not matcher.accept_token(row.token):
            raise ValueError(f"token {row.token} is outside the structured output's grammar")
        logprobs.extend(logprobs_of(row.token, row.logprob, row.top))
        reason, text = stops.finish_reason_and_text(seq)
        texts.append(text)
        if reason is not None:
            break
    return tuple(seq.tokens[start:]), "".join(texts), reason, tuple(logprobs)


def logprobs_of(token: int, logprob: float | None, top: tuple[tuple[int, float], ...]) -> tuple[Logprob, ...]:
    """A token's logprob entry with its (token, logprob) alternatives; none when logprobs were not asked for."""
    if logprob is None:
        return ()
    return (Logprob(token, logprob, top=tuple(TopLogprob(token_id, value) for token_id, value in top)),)


def token_event(seq: Sequence, tokens: tuple, text: str, reason: str | None, logprobs: tuple = (),
                error: str | None = None) -> TokenEvent:
    """The event of one choice's new tokens; a reason ends the whole request (see choice_finish for one choice)."""
    finish = FinishReason(reason) if reason is not None else None
    return TokenEvent(seq.request_id, tokens, text, finish, error, logprobs, seq.prompt_len,
                      len(seq.output_tokens), index=seq.index)
