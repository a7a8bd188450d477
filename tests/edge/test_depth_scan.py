"""Issue 48: a JSON schema nested deep, in every field that carries one, is accepted or a 400 naming the field, never
another exception (a 500). Each schema is sent from depth 1 to one past contracts.grammar.MAX_SCHEMA_DEPTH through
the parser the route calls, and what passes is compiled as the gateway's check compiles it; then bodies nested up to
Python's recursion limit are parsed at several depths of the caller's stack (the real server's handler runs deeper
than a test's), where a recursive walk below the body's own JSON parse used to fail."""

from __future__ import annotations

import json
import sys

import pytest

from contracts.grammar import MAX_SCHEMA_DEPTH, GrammarError, build_grammar
from edge.api.fields import ApiError
from edge.api.messages import MessagesApi, parse_count
from edge.api.openai_request import parse_request
from edge.api.responses import ResponsesApi


def schema_text(depth: int) -> str:
    """A JSON schema nesting arrays and objects exactly `depth` deep: arrays of arrays ... of strings."""
    return '{"type": "array", "items": ' * (depth - 1) + '{"type": "string"}' + "}" * (depth - 1)


def tools_chat(schema: str) -> tuple:
    body = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", ' \
           '"function": {"name": "f", "parameters": SCHEMA}}], "tool_choice": "required"}'.replace("SCHEMA", schema)
    return body, lambda b: parse_request(b, "chat"), "tools[0].function.parameters"


def tools_responses(schema: str) -> tuple:
    body = '{"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}], ' \
           '"tool_choice": "required"}'.replace("SCHEMA", schema)
    return body, lambda b: ResponsesApi().parse(b, None), "tools[0]"


def tools_messages(schema: str) -> tuple:
    body = '{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], ' \
           '"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "any"}}'.replace("SCHEMA", schema)
    return body, lambda b: MessagesApi().parse(b, None), "tools[0]"


def tools_count_tokens(schema: str) -> tuple:
    body = '{"model": "m", "messages": [{"role": "user", "content": "x"}], ' \
           '"tools": [{"name": "f", "input_schema": SCHEMA}]}'.replace("SCHEMA", schema)
    return body, parse_count, "tools[0]"


def response_format(schema: str) -> tuple:
    body = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": ' \
           '{"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}'.replace("SCHEMA", schema)
    return body, lambda b: parse_request(b, "chat"), "response_format"


def guided_json(schema: str) -> tuple:
    return '{"model": "m", "prompt": "x", "guided_json": SCHEMA}'.replace("SCHEMA", schema), lambda b: parse_request(b, "completion"), \
        "guided_json"


def guided_json_text(schema: str) -> tuple:
    return json.dumps({"model": "m", "prompt": "x", "guided_json": schema}), \
        lambda b: parse_request(b, "completion"), "guided_json"


def structured_outputs(schema: str) -> tuple:
    return '{"model": "m", "prompt": "x", "structured_outputs": {"json": SCHEMA}}'.replace("SCHEMA", schema), \
        lambda b: parse_request(b, "completion"), "structured_outputs.json"


FIELDS = [tools_chat, tools_responses, tools_messages, tools_count_tokens, response_format, guided_json,
          guided_json_text, structured_outputs]
TOOLS = [tools_chat, tools_responses, tools_messages, tools_count_tokens]


def names(field: str, err: ApiError) -> bool:
    """The 400 names the field: as its param, or in its message (Anthropic's errors have no param)."""
    return err.status == 400 and (field in (err.param or "") or field in err.message)


def constraint(request) -> tuple[str, str] | None:
    sampling = request.sampling
    return sampling.structured


def outcome(field_of, depth: int) -> str:
    """'accepted', or 'refused' (a 400 naming the field, at parsing or at the gateway's compile)."""
    body, parse, field = field_of(schema_text(depth))
    try:
        request = parse(json.loads(body))
    except ApiError as err:
        assert names(field, err), (depth, err.status, err.param, err.message)
        return "refused"
    try:  # the gateway's check (contracts.grammar_compile.GatewayCheck) compiles this, in a child process
        build_grammar(*constraint(request))
    except GrammarError as err:  # answered 400 with the request's structured_param (tools: "tools")
        assert request.structured_param in ("tools", field), (depth, request.structured_param, str(err))
        return "refused"
    return "accepted"


@pytest.mark.parametrize("field_of", FIELDS, ids=lambda f: f.__name__)
def test_every_depth_to_one_past_the_limit_is_accepted_or_a_400_naming_the_field(field_of):
    outcomes = [outcome(field_of, depth) for depth in range(1, MAX_SCHEMA_DEPTH + 2)]
    accepted = outcomes.count("accepted")
    assert accepted >= 100 and outcomes[-1] == "refused"  # llguidance compiles schemas ~124 deep
    assert outcomes == ["accepted"] * accepted + ["refused"] * (len(outcomes) - accepted)  # one threshold


@pytest.mark.parametrize("field_of", TOOLS, ids=lambda f: f.__name__)
def test_tool_parameters_past_the_limit_are_refused_before_the_grammar(field_of):
    body, parse, field = field_of(schema_text(MAX_SCHEMA_DEPTH + 1))
    with pytest.raises(ApiError, match=f"more than {MAX_SCHEMA_DEPTH} levels deep") as refused:
        parse(json.loads(body))
    assert names(field, refused.value)


def at_stack_depth(frames: int, fn, *args):
    """fn(*args) called `frames` Python frames deeper than here: where a server's handler runs."""
    return fn(*args) if frames <= 0 else at_stack_depth(frames - 1, fn, *args)


def parsed_or_refused(gap: int, body: str, parse, field: str) -> None:
    """What the route does: the body read by json.loads (a RecursionError there is its own 400), then parsed `gap`
    frames deeper (the handler's own calls down to the parser)."""
    try:
        value = json.loads(body)
    except RecursionError:
        return
    try:
        at_stack_depth(gap, parse, value)
    except ApiError as err:
        assert names(field, err) or err.param is None and "nest" in err.message, (err.param, err.message)


@pytest.mark.parametrize("field_of", FIELDS, ids=lambda f: f.__name__)
def test_no_depth_up_to_the_recursion_limit_fails_below_the_bodys_own_parse(field_of):
    limit = sys.getrecursionlimit()
    for frames, gap in ((0, 0), (0, 40), (100, 200)):
        for depth in range(MAX_SCHEMA_DEPTH + 1, limit + 5):
            at_stack_depth(frames, parsed_or_refused, gap, *field_of(schema_text(depth)))


def text_format(schema: str) -> tuple:
    body = '{"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}}}'
    return body.replace("SCHEMA", schema), lambda b: ResponsesApi().parse(b, None), "text.format"


def output_config(schema: str) -> tuple:
    body = '{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], ' \
           '"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}'
    return body.replace("SCHEMA", schema), lambda b: MessagesApi().parse(b, None), "output_config.format"


@pytest.mark.parametrize("field_of", [text_format, output_config], ids=lambda f: f.__name__)
def test_the_other_apis_schemas_are_checked_before_json_dumps(field_of):
    test_every_depth_to_one_past_the_limit_is_accepted_or_a_400_naming_the_field(field_of)
    test_no_depth_up_to_the_recursion_limit_fails_below_the_bodys_own_parse(field_of)


def nested_arguments(depth: int) -> str:
    """JSON arguments nesting arrays `depth` deep inside an object: {"a": [[...[1]...]]}."""
    return '{"a": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


def chat_arguments(arguments: str) -> tuple:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]}
    return json.dumps(body), lambda b: parse_request(b, "chat"), "messages[1].tool_calls[0].function.arguments"


def responses_arguments(arguments: str) -> tuple:
    body = {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments}]}
    return json.dumps(body), lambda b: ResponsesApi().parse(b, None), "input[0].arguments"


def messages_input(arguments: str) -> tuple:
    body = '{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", ' \
           '"content": [{"type": "tool_use", "id": "t", "name": "f", "input": ARGS}]}]}'
    return body.replace("ARGS", arguments), lambda b: MessagesApi().parse(b, None), "messages[1].content[0].input"


@pytest.mark.parametrize("field_of", [chat_arguments, responses_arguments, messages_input],
                         ids=lambda f: f.__name__)
def test_earlier_call_arguments_nested_past_the_limit_are_a_400_naming_them(field_of):
    """Arguments ~950 deep pass json.loads (the body's, or the arguments text's) but not the json.dumps that writes
    them into the prompt: refused at parsing, never a RecursionError later (a 500)."""
    body, parse, field = field_of(nested_arguments(3))
    assert parse(json.loads(body)).messages  # shallow arguments pass
    body, parse, field = field_of(nested_arguments(MAX_SCHEMA_DEPTH))
    parse(json.loads(body))  # at the limit (the object counts one level)
    for depth in (MAX_SCHEMA_DEPTH + 1, 950):
        body, parse, field = field_of(nested_arguments(depth))
        with pytest.raises(ApiError) as refused:
            parse(json.loads(body))
        assert refused.value.status == 400 and refused.value.param == field and "nested too deeply" in \
            refused.value.message
    for frames, gap in ((0, 0), (100, 200)):
        for depth in range(MAX_SCHEMA_DEPTH + 1, sys.getrecursionlimit() + 5, 7):
            at_stack_depth(frames, parsed_or_refused, gap, *field_of(nested_arguments(depth)))
