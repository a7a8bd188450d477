"""Tool calls (OpenAI `tools`, `tool_choice`): the tools go into the prompt, the model's calls come out of its text.

Prompt: the tools are described in the Hermes format (a system message listing the function signatures in
<tools></tools> and asking for calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, what Qwen2.5's
own template writes), for every model: the gateway renders them, so a template without tool support (the
embedded SmolLM2's) still gets them. Earlier calls in the history become that text again, and tool results
are `tool` messages.

Output: with tool_choice "required" or a named function, the answer is constrained to one call's JSON by a
structured-output grammar (contracts/grammar.py), so even a small model returns a call that parses. With
"auto", the text is searched for Hermes <tool_call> blocks, or a bare Llama 3.x style JSON call ({"name": ...,
"parameters" or "arguments": ...}); text that holds none is an ordinary answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ToolError(ValueError):
    """A bad tools field; (message, param) for a 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict, ...]  # each {"name", "description", "parameters"}
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def constraint(self) -> tuple[str, str]:
        """The structured-output constraint of a required or named call: one JSON object naming a function and
        giving arguments that fit its parameters."""
        tools = [t for t in self.tools if self.choice == "required" or t["name"] == self.named]
        calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        return "json_schema", json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})


def parse_tools(body: dict) -> ToolSpec | None:
    """The request's tools and tool_choice; None when it has no tools (tool_choice alone must then be none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise ToolError(f"tools must be a list of 1 to {MAX_TOOLS} tools", "tools")
    specs = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [t["name"] for t in specs]
    if len(set(names)) != len(names):
        raise ToolError("tools must have distinct function names", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolSpec(specs, choice or "auto", None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    if not isinstance(name, str) or name not in names:
        raise ToolError("tool_choice must be none, auto, required, or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}} naming one of the tools", "tool_choice")
    return ToolSpec(specs, "named", name, parallel)


def _tool(tool, param: str) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise ToolError(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(f"{param}.function.name must be 1-64 letters, digits, _ or -", f"{param}.function.name")
    description = function.get("description", "")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(description, str) or not isinstance(parameters, dict):
        raise ToolError(f"{param}.function: description must be a string and parameters a JSON schema object",
                        f"{param}.function")
    try:  # the tool is rendered into the prompt, which travels as UTF-8: a lone surrogate cannot
        json.dumps([description, parameters], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError(f"{param}.function must be valid Unicode text: it holds a lone surrogate",
                        f"{param}.function") from None
    return {"name": name, "description": description, "parameters": parameters}


def system_preamble(spec: ToolSpec) -> str:
    """The Hermes tool prompt (Qwen2.5's wording)."""
    signatures = "\n".join(json.dumps({"type": "function", "function": t}) for t in spec.tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\nFor each "
            "function call, return a json object with function name and arguments within <tool_call></tool_call> "
            "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def with_tools(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    """Messages as the template sees them: the tool preamble in the system message, earlier calls as Hermes text."""
    out = [{"role": m["role"], "content": _content(m)} for m in messages]
    if spec is None or spec.choice == "none":
        return out
    preamble = system_preamble(spec)
    if out and out[0]["role"] in ("system", "developer"):
        return [{"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + preamble}, *out[1:]]
    return [{"role": "system", "content": preamble}, *out]


def _content(message: dict) -> str:
    calls = message.get("tool_calls") or ()
    text = message.get("content") or ""
    rendered = [f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']})}\n</tool_call>"
                for c in calls]
    return "\n".join([text, *rendered] if text else rendered)


def parse_calls(text: str, spec: ToolSpec) -> tuple[list[dict], str]:
    """(calls as OpenAI tool_calls, the text left) from a finished answer."""
    names = {t["name"] for t in spec.tools}
    if spec.constrained:
        found = [_call(text, names)]
    elif "<tool_call>" in text:
        found = [_call(block, names) for block in HERMES_CALL.findall(text)]
    elif text.lstrip().startswith("{"):
        found = [_call(text, names)]
    else:
        return [], text
    calls = [c for c in found if c is not None]
    if not calls:
        return [], text
    if not spec.parallel:
        calls = calls[:1]
    rest = HERMES_CALL.sub("", text).strip() if "<tool_call>" in text else ""
    return calls, rest


def _call(text: str, names: set[str]) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}


def may_be_a_call(text: str) -> bool:
    """Whether a streamed answer that starts like this may turn out to be a call (so it is held back)."""
    head = text.lstrip()
    return head.startswith("{") or "<tool_call>".startswith(head[:11])  # a prefix of the tag, or the tag itself
