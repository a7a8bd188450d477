"""The one internal request every client API's parser builds (edge.api.openai_request, responses_request,
messages_request; chat ones through edge.api.chat_request) and the gateway admits."""

from __future__ import annotations

from dataclasses import dataclass

from edge.api.sampling_request import SamplingRequest
from edge.chat.tool_formats import ChatFormat
from edge.chat.tools import ToolSpec


@dataclass(frozen=True)
class GenerateRequest:
    kind: str  # "chat" or "completion" ("embedding", "rerank": edge.http.embeddings)
    model: str
    sampling: SamplingRequest  # max_tokens None until the policy decides
    stream: bool
    include_usage: bool
    priority: int | None  # None: the API key's default
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    chat_logprobs: bool = False  # chat: logprobs as objects; completions: as parallel lists
    echo: bool = False  # completions: the answer starts with the prompt text
    structured_param: str | None = None  # the field a structured-output constraint came from (for errors)
    tools: ToolSpec | None = None  # chat: the tools and tool_choice
    user_text: str = ""  # every piece of client text, for content filters
    cache_salt: str = ""  # the client's own cache salt (vLLM's field); the gateway mixes it with the key's
    prompt_logprobs: int | None = None  # completions: every prompt token's logprob and this many top alternatives
    embed_texts: tuple[str, ...] = ()  # kind "embedding": the inputs as text, or
    embed_tokens: tuple[tuple[int, ...], ...] = ()  # ... as token ids
    chat: ChatFormat | None = None  # chat: the model's template (tool-call format, reasoning), edge.chat.tool_formats
    template_tools: str = ""  # chat: the tools as JSON text, for a template that renders them itself
    asked_logprobs: bool = False  # the client asked for logprobs (a degradation tier may have taken them away)
    history: tuple[dict, ...] = ()  # Responses: the conversation's input items (a stored one's, then the body's)
    store: bool = False  # Responses: the answer is kept for a later previous_response_id (edge.api.response_store)
    previous_response_id: str | None = None  # Responses: the stored response this request continues
