"""Tool-call formats (edge.chat.tool_formats): detection from each family's template, the template read from a GGUF's
header, and the grammars: with tool_choice auto an answer is free text or well-formed calls, with required or a
named function calls only; a reasoning model's thinking comes first. Grammars are run over a tiny GGUF's
vocabulary, byte by byte, as the prefill worker and the engine run them."""

import gguf
import pytest

from contracts.grammar import compile_matcher
from edge.api.openai_request import ApiError, parse_request
from edge.chat.tool_formats import FORMATS, ChatFormat, detect, model_chat_format, read_chat_template
from tests import chat_templates
from tests.tiny_gguf import write_tiny_gguf

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
NESTED = {"type": "function", "function": {"name": "book", "parameters": {  # pydantic's shape: $defs and $refs
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"]}}}
CALLS = {  # family -> a call to get_weather as the family writes it when constrained
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
    "phi4_mini": 'functools[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
}
_CALL = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
TWO = {"hermes": CALLS["hermes"] + "\n" + CALLS["hermes"], "llama3_json": CALLS["llama3_json"] + "; " + CALLS["llama3_json"],
       "mistral": f"[{_CALL}, {_CALL}]", "phi4_mini": f"functools[{_CALL}, {_CALL}]"}  # parallel calls


@pytest.mark.parametrize("template, parser, renders, reasoning, in_prompt", [
    (chat_templates.HERMES, "hermes", True, "", False),
    (chat_templates.QWEN3, "hermes", True, "think", False),
    (chat_templates.LLAMA3, "llama3_json", True, "", False),
    (chat_templates.MISTRAL, "mistral", True, "", False),
    (chat_templates.PHI4_MINI, "phi4_mini", True, "", False),
    (chat_templates.GEMMA, "hermes", False, "", False),  # no tools in the template: the gateway's Hermes text
    (chat_templates.SMOLLM2, "hermes", False, "", False),
    (chat_templates.R1, "hermes", False, "think", True),
    (None, "hermes", False, "", False),
])
def test_the_format_is_detected_from_the_template(template, parser, renders, reasoning, in_prompt):
    assert detect(template) == ChatFormat(parser, renders, reasoning, in_prompt)


def test_the_options_name_the_formats_there_are():
    from contracts.options import KNOBS
    assert set(KNOBS["tool_call_parser"].choices) == {"auto", *FORMATS}
    assert set(KNOBS["reasoning_parser"].choices) == {"auto", "none", "think"}


def test_the_options_override_what_the_template_says():
    assert detect(chat_templates.SMOLLM2, tool_call_parser="llama3_json").tool_parser == "llama3_json"
    assert detect(chat_templates.QWEN3, reasoning_parser="none").reasoning == ""
    assert detect(chat_templates.GEMMA, reasoning_parser="think").reasoning == "think"


def test_the_template_is_read_from_the_gguf_header(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "bb", "ccc"])  # arrays before the template are skipped by their lengths
    writer.add_token_scores([0.0, 1.0, 2.0])
    writer.add_chat_template(chat_templates.LLAMA3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert read_chat_template(str(path)) == chat_templates.LLAMA3
    assert model_chat_format(str(path)).tool_parser == "llama3_json"
    assert model_chat_format(str(tmp_path / "missing.gguf")) == ChatFormat()


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    from prefill_cpu.grammar import GGUFVocabulary
    return GGUFVocabulary(str(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "llama")))


def accepts(vocabulary, constraint: tuple[str, str], text: str) -> bool:
    """The grammar takes the text (as the tiny vocabulary's byte tokens, ids 3 to 258) and then the end token."""
    matcher = compile_matcher(vocabulary.tokenizer, *constraint, vocabulary.stop_token_ids)
    return all(matcher.accept_token(3 + b) for b in text.encode()) and matcher.accept_token(2)


def constraint(family: str, chat: ChatFormat | None = None, **fields) -> tuple[str, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER], **fields}
    return parse_request(body, "chat", chat=chat or ChatFormat(family)).sampling.structured


@pytest.mark.parametrize("family", sorted(CALLS))
def test_auto_allows_free_text_or_well_formed_calls(vocabulary, family):
    auto = constraint(family)
    assert accepts(vocabulary, auto, CALLS[family])
    assert accepts(vocabulary, auto, "It is sunny in Rome.")
    assert accepts(vocabulary, auto, TWO[family])
    assert not accepts(vocabulary, auto, CALLS[family].replace("get_weather", "get_time"))  # no such tool
    assert not accepts(vocabulary, auto, CALLS[family].replace('"city"', '"town"'))  # arguments off the schema
    if family in ("hermes", "phi4_mini"):  # calls after some text
        assert accepts(vocabulary, auto, "Let me check. " + CALLS[family])


@pytest.mark.parametrize("family", sorted(CALLS))
def test_required_and_named_allow_calls_only(vocabulary, family):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = constraint(family, tool_choice=choice)
        assert accepts(vocabulary, forced, CALLS[family])
        assert not accepts(vocabulary, forced, "It is sunny in Rome.")


def test_parallel_calls_follow_parallel_tool_calls(vocabulary):
    two = CALLS["hermes"] + "\n" + CALLS["hermes"]
    assert accepts(vocabulary, constraint("hermes", tool_choice="required"), two)
    assert not accepts(vocabulary, constraint("hermes", tool_choice="required", parallel_tool_calls=False), two)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert not accepts(vocabulary, constraint("hermes", tool_choice=named), two)  # a named function: one call


def test_nested_parameters_with_defs_are_enforced(vocabulary):
    body = {"model": "m", "messages": [{"role": "user", "content": "Book"}], "tools": [NESTED], "tool_choice": "required"}
    forced = parse_request(body, "chat", chat=ChatFormat()).sampling.structured
    assert accepts(vocabulary, forced, '<tool_call>\n{"name": "book", "arguments": {"to": {"city": "Oslo"}}}\n</tool_call>')
    assert not accepts(vocabulary, forced, '<tool_call>\n{"name": "book", "arguments": {"to": {"town": "Oslo"}}}\n'
                                           '</tool_call>')


def test_thinking_comes_before_the_constrained_answer(vocabulary):
    qwen3 = ChatFormat("hermes", True, "think")
    forced = constraint("hermes", qwen3, tool_choice="required")
    assert accepts(vocabulary, forced, "<think>\nRome, so get_weather.\n</think>\n\n" + CALLS["hermes"])
    assert accepts(vocabulary, forced, CALLS["hermes"])  # Qwen3 may skip it
    assert not accepts(vocabulary, forced, "<think>hmm</think> It is sunny.")
    r1 = ChatFormat("hermes", False, "think", True)
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "A number"}], "response_format": schema}
    structured = parse_request(body, "chat", chat=r1).sampling.structured
    assert accepts(vocabulary, structured, 'Say 4.\n</think>\n\n{"n": 4}')
    assert not accepts(vocabulary, structured, '{"n": 4}')  # the prompt opened the thinking: it must close
    assert not accepts(vocabulary, structured, 'Say 4.</think>{"n": "four"}')


def test_a_response_format_with_auto_tools_is_that_answer_or_calls(vocabulary):
    structured = constraint("hermes", response_format={"type": "json_object"})
    assert accepts(vocabulary, structured, '{"a": 1}') and accepts(vocabulary, structured, CALLS["hermes"])
    assert not accepts(vocabulary, structured, "plain text")


def test_a_client_grammar_beside_tools_or_thinking_is_a_400():
    with pytest.raises(ApiError) as info:
        constraint("hermes", guided_grammar='root ::= "yes"')
    assert (info.value.status, info.value.param) == (400, "guided_grammar")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "guided_grammar": 'root ::= "yes"'}
    with pytest.raises(ApiError):
        parse_request(body, "chat", chat=ChatFormat(reasoning="think"))
    assert parse_request(body, "chat", chat=ChatFormat()).sampling.structured == ("grammar", 'root ::= "yes"')
    assert constraint("hermes", tool_choice="none") is None  # no tools used: nothing to constrain
