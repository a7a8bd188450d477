"""Tool calls (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`): the tools go into the prompt, the model's
calls come out of its text (edge.chat.tool_parser), in its family's format (edge.chat.tool_formats).

Prompt: a chat template that renders `tools` in a format we parse gets them (the prefill worker passes them to
it, with earlier calls as the messages' `tool_calls`); any other gets the Hermes system text from here (a system
message listing the function signatures in <tools></tools> and asking for <tool_call> blocks, Qwen2.5's wording),
with earlier calls written back as those blocks. Tool results are `tool` messages.

Output: every tool_choice but "none" constrains the answer by a grammar in the format (`answer_constraint`):
"auto" allows free text or, once a call starts, a well-formed call; "required" and a named function allow calls
only; each call names a tool and gives arguments that fit its parameters. A reasoning model's thinking comes
first, unconstrained (edge.chat.reasoning).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from contracts.grammar import GrammarError, check_schema_depth
from edge.chat.reasoning import reasoning_rules
from edge.chat.tool_formats import FORMATS, ChatFormat, ToolFormat, grammar, tools_grammar

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128


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
    format: str = "hermes"  # the call format (edge.chat.tool_formats.FORMATS)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parallel_calls(self) -> bool:
        """Several calls may come: parallel_tool_calls, but not when tool_choice names the function (one call)."""
        return self.parallel and self.choice != "named"

    @property
    def names(self) -> set[str]:
        return {t["name"] for t in self.tools}

    def rules(self, answer: str | None = None) -> str:
        """The Lark rules of the answer (ending in `answer_start`): calls in the format, and with "auto" free text
        too, or `answer` (a response_format's rule) where one is given."""
        tools = [t for t in self.tools if self.choice != "named" or t["name"] == self.named]
        return tools_grammar(tools, FORMATS[self.format], free=self.choice == "auto", parallel=self.parallel_calls,
                             answer=answer)


def parse_tools(body: dict, tool_format: str = "hermes") -> ToolSpec | None:
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
        return ToolSpec(specs, choice or "auto", None, parallel, tool_format)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    if not isinstance(name, str) or name not in names:
        raise ToolError("tool_choice must be none, auto, required, or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}} naming one of the tools", "tool_choice")
    return ToolSpec(specs, "named", name, parallel, tool_format)


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
    try:  # before anything recursive (json.dumps below, the call schema's rewriting) meets it
        check_schema_depth(parameters, f"{param}.function.parameters")
    except GrammarError as err:
        raise ToolError(str(err), f"{param}.function.parameters") from None
    try:  # the tool is rendered into the prompt, which travels as UTF-8: a lone surrogate cannot
        json.dumps([description, parameters], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError(f"{param}.function must be valid Unicode text: it holds a lone surrogate",
                        f"{param}.function") from None
    return {"name": name, "description": description, "parameters": parameters}


def system_preamble(spec: ToolSpec) -> str:
    """The tool prompt: Qwen2.5's Hermes wording, or for another format (the tool_call_parser option on a template
    without tool support) the same list of signatures and that format's call."""
    signatures = "\n".join(json.dumps({"type": "function", "function": t}) for t in spec.tools)
    head = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\n")
    if spec.format == "hermes":
        return head + ("For each function call, return a json object with function name and arguments within "
                       "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                       "<args-json-object>}\n</tool_call>")
    fmt = FORMATS[spec.format]
    return head + ("To call functions, answer with this and nothing else:\n" + fmt.begin + '{"name": <function-name>, "'
                   + fmt.arguments_key + '": <args-json-object>}' + fmt.end)


def with_tools(messages: list[dict], spec: ToolSpec | None, chat: ChatFormat | None = None) -> list[dict]:
    """Messages as the template sees them. A template that renders tools itself keeps earlier calls as
    `tool_calls_json` (ChatMessage.tool_calls) and results' `tool_call_id`; any other gets the Hermes preamble in
    the system message and earlier calls as Hermes text."""
    if chat is not None and chat.template_tools:
        return [_structured(m) for m in messages]
    fmt = FORMATS[spec.format if spec is not None else "hermes"]
    out = [{"role": m["role"], "content": _content(m, fmt)} for m in messages]
    if spec is None or spec.choice == "none":
        return out
    preamble = system_preamble(spec)
    if out and out[0]["role"] in ("system", "developer"):
        return [{"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + preamble}, *out[1:]]
    return [{"role": "system", "content": preamble}, *out]


def template_tools(spec: ToolSpec | None, chat: ChatFormat | None) -> str:
    """The tools as JSON text for a template that renders them (OpenAI's list shape); "" when it does not."""
    if spec is None or spec.choice == "none" or chat is None or not chat.template_tools:
        return ""
    return json.dumps([{"type": "function", "function": t} for t in spec.tools], ensure_ascii=False)


def _structured(message: dict) -> dict:
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls_json"] = json.dumps([{"id": c.get("id") or f"call{i}", "type": "function",
                                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                                        for i, c in enumerate(message["tool_calls"])], ensure_ascii=False)
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _content(message: dict, fmt: ToolFormat) -> str:
    """A message's text, and its earlier calls written back in the format."""
    calls = message.get("tool_calls") or ()
    text = message.get("content") or ""
    if not calls:
        return text
    rendered = fmt.begin + fmt.separator.join(json.dumps({"name": c["name"], fmt.arguments_key: c["arguments"]})
                                              for c in calls) + fmt.end
    return f"{text}\n{rendered}" if text else rendered


def answer_constraint(structured: tuple[str, str] | None, spec: ToolSpec | None,
                      chat: ChatFormat | None) -> tuple[str, str] | None:
    """The grammar the answer is held to: the request's structured output, its tool calls, or both (a
    response_format with tool_choice auto: that answer or calls), after a reasoning model's thinking. None when
    nothing constrains it. ToolError when a constraint cannot be put in such a grammar (a client's Lark or GBNF
    grammar beside tools or after thinking)."""
    tools_on = spec is not None and spec.choice != "none"
    thinking = chat is not None and bool(chat.reasoning)
    if not tools_on and (structured is None or not thinking):
        return structured
    answer, terminals = constraint_rule(*structured) if structured is not None else (None, "")
    rules = spec.rules(answer) if tools_on else f"answer_start: {answer}"
    rules = "\n".join(x for x in (rules, terminals) if x)
    return "grammar", grammar(rules, reasoning_rules(chat.think_in_prompt) if thinking else "")


def constraint_rule(kind: str, source: str) -> tuple[str, str]:
    """A structured-output constraint as one Lark rule body, to sit inside a larger grammar, and the terminals that
    body names ("" or their definitions, to add to the grammar)."""
    from contracts.grammar import JSON_OPTIONS, choice_terminal, choices_of
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(source) if kind == "json_schema" else {"type": "object"}
            check_schema_depth(schema, "the json_schema constraint")
        except GrammarError as err:
            raise ToolError(str(err), "response_format") from None
        except (ValueError, RecursionError):
            raise ToolError("the json_schema constraint is not valid JSON", "response_format") from None
        schema = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
        return "%json " + json.dumps(schema, ensure_ascii=False), ""
    if kind == "choice":  # one lexeme, however many strings (contracts.grammar.choice_terminal)
        return "ANSWER_CHOICE", choice_terminal("ANSWER_CHOICE", choices_of(source))
    if kind == "regex":
        return "/" + re.sub(r"(?<!\\)/", r"\\/", source) + "/", ""
    raise ToolError(f"a {kind} constraint cannot be combined with tool calls or a reasoning model's thinking; use a "
                    "json_schema, regex or choice", "structured_outputs")
