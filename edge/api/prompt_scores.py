"""A completion's prompt logprobs in the two shapes clients read them: OpenAI's echo (the prompt's tokens lead the
choice's `logprobs` lists, the first with null), and vLLM's `prompt_logprobs` (one entry per prompt token, the first
null, each a map of token id to its logprob, rank and text: the prompt's own token and the top alternatives)."""

from __future__ import annotations

from contracts.messages import PromptLogprobs


def echo_text(prompt: str | None, scores: PromptLogprobs | None) -> str:
    """The prompt as echoed: its text as sent, or (a prompt of token ids) its tokens' text."""
    if prompt is not None:
        return prompt
    return "".join(scores.pieces) if scores is not None else ""


def with_prompt(scores: PromptLogprobs, top_k: int, generated: dict) -> dict:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset) with the prompt's before
    the generated tokens'. generated: the same lists for the output (edge.api.openai_bodies.completion_logprobs)."""
    tokens = list(scores.pieces)
    token_logprobs = [None] + [e.logprob for e in scores.entries]
    top = [None] + [_top(e, top_k) for e in scores.entries]
    offsets, offset = [], 0
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens + generated["tokens"],
            "token_logprobs": token_logprobs + generated["token_logprobs"],
            "top_logprobs": top + generated["top_logprobs"],
            "text_offset": offsets + [offset + o for o in generated["text_offset"]]}


def _top(entry, top_k: int) -> dict:
    """A prompt position's top_logprobs: the top k and the prompt's own token always (as vLLM; at k 0 the token
    alone), as a generated token's are (edge.api.openai_bodies)."""
    top = {t.token: t.logprob for t in entry.top[:top_k]}
    top.setdefault(entry.token, entry.logprob)
    return top


def vllm_prompt_logprobs(scores: PromptLogprobs, top_k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: [null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]."""
    out: list[dict | None] = [None]
    for i, entry in enumerate(scores.entries):
        position = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
                    for rank, t in enumerate(entry.top[:top_k], start=1)}
        rank = scores.ranks[i] if i < len(scores.ranks) else None
        position[str(entry.token_id)] = {"logprob": entry.logprob, "rank": rank, "decoded_token": entry.token}
        out.append(position)
    return out
