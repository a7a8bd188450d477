"""Turn a completion prompt or chat messages into tokens, with the chat template from the GGUF's metadata.

Tools: a job's tools (the gateway sends them only for a template that renders them, edge.chat.tool_formats) go to the
template as its `tools` variable, the way transformers' apply_chat_template passes them; Phi-4-mini's template
reads them from the system message instead (`message.tools`, JSON text), so there they go on the system message.
Earlier calls travel as JSON text (ChatMessage.tool_calls) and reach the template as each assistant message's
`tool_calls`, with `function.arguments` as an object (what the templates write with `tojson`).
"""

from __future__ import annotations

import json
import re

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from prefill_cpu.prefiller import Prefiller

_MESSAGE_TOOLS = re.compile(r"message\s*(\[\s*['\"]tools['\"]\s*\]|\.tools\b)")


class BadPromptError(ValueError):
    """Messages the chat template cannot render."""


class PromptRenderer:
    def __init__(self, prefiller: Prefiller) -> None:
        self.prefiller = prefiller
        llm = prefiller.llm
        template = llm.metadata.get("tokenizer.chat_template")
        self.formatter = None
        self.tools_on_system_message = bool(template and _MESSAGE_TOOLS.search(template))
        if template:
            eos = llm.detokenize([llm.token_eos()], special=True).decode("utf-8", errors="replace")
            bos = llm.detokenize([llm.token_bos()], special=True).decode("utf-8", errors="replace")
            self.formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        self.add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") != "false"

    def chat_tokens(self, messages: list[dict], tools: str = "") -> list[int]:
        """messages: {"role", "content"}, and optionally "tool_calls" (JSON text) and "tool_call_id"; tools: the
        tools as JSON text ("" = none)."""
        return self.prefiller.llm.tokenize(self.chat_text(messages, tools).encode("utf-8"), add_bos=False,
                                           special=True)  # the template writes the special tokens (BOS too)

    def chat_text(self, messages: list[dict], tools: str = "") -> str:
        if self.formatter is None:
            raise BadPromptError("this model's GGUF has no chat template; use /v1/completions")
        return render(self.formatter, messages, tools, self.tools_on_system_message)

    def completion_tokens(self, prompt: str) -> list[int]:
        return self.prefiller.llm.tokenize(prompt.encode("utf-8"), add_bos=self.add_bos, special=False)


def render(formatter: Jinja2ChatFormatter, messages: list[dict], tools: str = "",
           tools_on_system_message: bool = False) -> str:
    """The prompt text of the messages (BadPromptError when the template refuses them)."""
    try:
        listed = json.loads(tools) if tools else None
        shaped = [_message(m) for m in messages]
    except (ValueError, KeyError, TypeError) as err:
        raise BadPromptError(f"the tools or tool calls of these messages are not valid JSON: {err}") from None
    if listed and tools_on_system_message:
        if not shaped or shaped[0]["role"] != "system":
            shaped.insert(0, {"role": "system", "content": ""})
        shaped[0]["tools"] = json.dumps([t.get("function", t) for t in listed], ensure_ascii=False)
    try:
        return formatter(messages=shaped, tools=listed).prompt
    except Exception as err:  # jinja2 errors are the template's way of refusing the messages
        raise BadPromptError(f"the chat template could not render these messages: {err}") from None


def _message(message: dict) -> dict:
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        calls = json.loads(message["tool_calls"])
        for call in calls:
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):  # the client's text, when it was not JSON
                try:
                    call["function"]["arguments"] = json.loads(arguments)
                except ValueError:
                    pass
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out
