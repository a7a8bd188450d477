"""POST /v1/completions: OpenAI's (and vLLM's) completion request, its text_completion body and stream; a batch of
prompts checked whole (edge.http.completion_batch serves it as one request per prompt, collected or streamed)."""

from __future__ import annotations

from edge.api.client_api import ClientApi, StreamWriter
from edge.api.completion import Choice, ChoiceDelta, Completion
from edge.api.openai_bodies import completion_logprobs, degraded, error_chunk, sse, summed_usage, usage_chunk
from edge.api.openai_request import ApiError, GenerateRequest, parse_request
from edge.api.prompt_scores import echo_text, vllm_prompt_logprobs, with_prompt

OBJECT = "text_completion"


class CompletionsApi(ClientApi):
    route = "/v1/completions"
    chat = False

    def parse(self, body, vocab_size: int | None, chat=None, earlier: tuple[dict, ...] = ()) -> GenerateRequest:
        return parse_request(body, "completion", vocab_size=vocab_size)

    def batch(self, body, vocab_size: int | None, max_prompts: int) -> list[dict] | None:
        prompts = batch_prompts(body)
        if prompts is None:
            return None
        check_batch(body, prompts, vocab_size, max_prompts)
        return [{**body, "prompt": prompt} for prompt in prompts]

    def body(self, completion: Completion) -> dict:
        body = {"id": completion.request_id, "object": OBJECT, "created": completion.created,
                "model": completion.model, "choices": [_choice(completion, choice) for choice in completion.choices],
                "usage": completion.usage}
        return {**body, **degraded(completion)}

    def writer(self, completion: Completion) -> StreamWriter:
        return CompletionStream(completion)

    def batch_writer(self, completions: list[Completion]) -> CompletionBatchStream:
        return CompletionBatchStream(completions)


def _choice(completion: Completion, choice: Choice) -> dict:
    request = completion.request
    text = "".join(choice.text)
    text = echo_text(request.prompt, completion.prompt_scores) + text if request.echo else text
    body = {"index": choice.index, "text": text, "finish_reason": choice.finish_reason,
            "logprobs": _logprobs(completion, choice.logprobs, echoed=request.echo)}
    return _with_prompt_logprobs(completion, body)


def _logprobs(completion: Completion, entries, echoed: bool) -> dict | None:
    top_k = completion.request.sampling.logprobs
    if top_k is None:
        return None
    generated = completion_logprobs(entries)
    scores = completion.prompt_scores
    return with_prompt(scores, top_k, generated) if echoed and scores else generated


def _with_prompt_logprobs(completion: Completion, body: dict) -> dict:
    top_k = completion.request.prompt_logprobs
    if top_k is not None and completion.prompt_scores is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(completion.prompt_scores, top_k)
    return body


class CompletionStream(StreamWriter):
    """A text_completion chunk per delta (the first with the echo and the prompt's logprobs); with include_usage a
    usage chunk after the last; then [DONE]. In a batch's stream (CompletionBatchStream) its chunks carry the
    batch's id and its choices' indexes start at offset."""

    def __init__(self, completion: Completion, chunk_id: str | None = None, offset: int = 0) -> None:
        self.completion = completion
        self.chunk_id, self.offset = chunk_id or completion.request_id, offset

    def event(self, delta: ChoiceDelta | None) -> bytes:
        if delta is None:
            return b""
        completion = self.completion
        echoing = completion.request.echo and delta.first
        text = echo_text(completion.request.prompt, completion.prompt_scores) + delta.content if echoing \
            else delta.content
        body = {"index": self.offset + delta.index, "text": text, "finish_reason": delta.finish_reason,
                "logprobs": _logprobs(completion, delta.logprobs, echoed=echoing)}
        if delta.first:
            body = _with_prompt_logprobs(completion, body)
        return sse({"id": self.chunk_id, "object": OBJECT, "created": completion.created,
                    "model": completion.model, "choices": [body]})

    def close(self) -> bytes:
        usage = sse(usage_chunk(self.completion, OBJECT)) if self.completion.request.include_usage else b""
        return usage + sse("[DONE]")

    def error(self, err: ApiError) -> bytes:
        return sse(error_chunk(err)) + sse("[DONE]")


class CompletionBatchStream:
    """One stream for a batch of prompts (each its own Completion): the chunks of prompt i carry the first prompt's
    id and choice indexes i*n + j, as they come; with include_usage one usage chunk summed over the prompts after
    the last; then one [DONE]. An error ends the whole stream, as it ends a single prompt's."""

    def __init__(self, completions: list[Completion]) -> None:
        first = completions[0]
        self.completions = completions
        self.streams = [CompletionStream(c, first.request_id, i * c.request.sampling.n)
                        for i, c in enumerate(completions)]

    def event(self, prompt: int, delta: ChoiceDelta | None) -> bytes:
        return self.streams[prompt].event(delta)

    def close(self) -> bytes:
        first = self.completions[0]
        if not first.request.include_usage:
            return sse("[DONE]")
        chunk = {**usage_chunk(first, OBJECT), "usage": summed_usage([c.usage for c in self.completions])}
        return sse(chunk) + sse("[DONE]")

    def error(self, err: ApiError) -> bytes:
        return sse(error_chunk(err)) + sse("[DONE]")


def batch_prompts(body) -> list | None:
    """The prompts of a batch (two or more strings or token lists); None for a single prompt, which the one-request
    path takes (and types)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return None


def check_batch(body: dict, prompts: list, vocab_size: int | None, max_prompts: int) -> None:
    """Every prompt checked before any is queued, so that a bad one costs the others nothing."""
    if len(prompts) > max_prompts:
        raise ApiError(400, f"'prompt' holds {len(prompts)} prompts; a batch may hold at most {max_prompts} (the "
                            "prefill queue's size)", "prompt", "invalid_value")
    for i, prompt in enumerate(prompts):
        try:
            parse_request({**body, "prompt": prompt}, "completion", vocab_size=vocab_size)
        except ApiError as err:
            param = err.param or ""
            param = f"prompt[{i}]{param[len('prompt'):]}" if param.startswith("prompt") else param or None
            raise ApiError(err.status, f"prompt[{i}]: {err.message}", param, err.code, err.error_type,
                           err.headers) from None
