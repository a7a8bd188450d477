"""The prefill worker's chat rendering (prefill_cpu.prompt_renderer.render) with tools: a family's template gets the
tools as its `tools` variable (Phi-4-mini's on the system message), and earlier calls as the messages' tool_calls
with their arguments as objects; a template's refusal is a BadPromptError."""

import json

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from prefill_cpu.prompt_renderer import BadPromptError, render
from tests import chat_templates

TOOLS = json.dumps([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                      "parameters": {"type": "object", "properties": {
                                                          "city": {"type": "string"}}}}}])
HISTORY = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": json.dumps([{"id": "abcDEF123", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Rome"}}}])},
    {"role": "tool", "content": "sunny", "tool_call_id": "abcDEF123"},
    {"role": "user", "content": "And now?"},
]


def _render(template: str, messages: list[dict], tools: str = "", on_system: bool = False) -> str:
    formatter = Jinja2ChatFormatter(template=template, eos_token="</s>", bos_token="<s>")
    return render(formatter, messages, tools, on_system)


def test_hermes_template_writes_the_tools_and_the_earlier_call():
    prompt = _render(chat_templates.HERMES, HISTORY, TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools\n<tools>\n{\"type\": \"function\"")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in _render(chat_templates.HERMES, HISTORY[:1])  # no tools, no tool section


def test_llama3_template_writes_tools_in_the_last_user_turn_and_calls_after_the_python_tag():
    prompt = _render(chat_templates.LLAMA3, HISTORY, TOOLS)
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}<|eom_id|>' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in prompt
    assert prompt.index('"name": "get_weather"', prompt.index("And now?") - 400) < prompt.index("And now?")


def test_mistral_template_gets_the_call_ids_it_checks():
    prompt = _render(chat_templates.MISTRAL, HISTORY, TOOLS)
    assert prompt.index("[AVAILABLE_TOOLS]") > prompt.index("[TOOL_RESULTS]")  # before the last user turn
    assert '"id": "abcDEF123"' in prompt and '"call_id": "abcDEF123"' in prompt
    bad = [HISTORY[0], {**HISTORY[1], "tool_calls": HISTORY[1]["tool_calls"].replace("abcDEF123", "c1")}]
    with pytest.raises(BadPromptError, match="length 9"):
        _render(chat_templates.MISTRAL, bad, TOOLS)


def test_phi4_mini_gets_the_tools_on_its_system_message():
    prompt = _render(chat_templates.PHI4_MINI, [{"role": "user", "content": "hi"}], TOOLS, on_system=True)
    assert prompt.startswith('<|system|><|tool|>[{"name": "get_weather"') and prompt.endswith("<|assistant|>")
    with_system = _render(chat_templates.PHI4_MINI, [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "hi"}], TOOLS, on_system=True)
    assert with_system.startswith("<|system|>Be brief.<|tool|>[")


def test_arguments_that_were_not_json_stay_text_and_bad_tools_are_refused():
    messages = [{"role": "assistant", "content": "", "tool_calls": json.dumps([{"id": "c", "type": "function",
                                                                               "function": {"name": "f",
                                                                                            "arguments": "not json"}}])}]
    assert '"arguments": "not json"' in _render(chat_templates.HERMES, messages)
    with pytest.raises(BadPromptError):
        _render(chat_templates.HERMES, HISTORY, "[not json")


def test_the_worker_s_renderer_reads_the_template_and_tokenizes_the_prompt_with_the_tools():
    import types

    from prefill_cpu.prompt_renderer import PromptRenderer
    seen = []

    class Llm:  # what PromptRenderer asks of llama_cpp.Llama
        metadata = {"tokenizer.chat_template": chat_templates.PHI4_MINI}

        def token_eos(self):
            return 2

        def token_bos(self):
            return 1

        def detokenize(self, tokens, special=False):
            return {1: b"<s>", 2: b"</s>"}[tokens[0]]

        def tokenize(self, text, add_bos=False, special=False):
            seen.append(text.decode())
            return list(text)

    renderer = PromptRenderer(types.SimpleNamespace(llm=Llm()))
    assert renderer.tools_on_system_message
    tokens = renderer.chat_tokens([{"role": "user", "content": "hi", "tool_calls": "", "tool_call_id": ""}], TOOLS)
    assert seen[-1].startswith("<|system|><|tool|>[") and len(tokens) == len(seen[-1].encode())
