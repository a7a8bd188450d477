"""End to end: OpenAI Responses and Anthropic Messages on the real service (embedded model), driven by the real
clients from PyPI (openai's responses.create, anthropic's messages.create and messages.stream), and their keys,
quotas, priorities, audit lines and route metrics. One server for the module (tests/e2e/conftest.py)."""

import json

import anthropic
import httpx
import openai
import pytest

from server_process import wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY, QUOTA_KEY = "api-key", "quota-key"
CONFIG = """
kv_cache_tokens = 8192
max_model_len = 1200
"""
POLICY = f"""
version = 1
default_class = "standard"
[filters]
max_prompt_tokens = 1024
max_output_tokens = 512
blocked_words = ["forbidden"]
[classes.standard]
priority = 0
[[keys]]
key = "{KEY}"
class = "standard"
[[keys]]
key = "{QUOTA_KEY}"
class = "standard"
tokens_per_day = 40
"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


def test_responses_plain_and_streamed(server, oai):
    response = oai.responses.create(model=MODEL, input="Name a color.", instructions="Answer in one word.",
                                    max_output_tokens=8, temperature=0)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens <= 8 and response.usage.input_tokens > 5
    events = list(oai.responses.create(model=MODEL, input=[{"role": "user", "content": "Count to five."}],
                                       max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # cut by max_output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output[0].content[0].text == text and final.usage.output_tokens == 10
    assert final.incomplete_details.reason == "max_output_tokens"


def test_responses_function_tool(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER}]
    response = oai.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                    tool_choice="required", max_output_tokens=40, temperature=0)
    call = next(item for item in response.output if item.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    follow = oai.responses.create(model=MODEL, tools=tools, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}], tool_choice="none")
    assert follow.output_text
    # the same turn as a continuation of the stored response: its input and its call, then the tool's output
    chained = oai.responses.create(model=MODEL, tools=tools, max_output_tokens=8, temperature=0, tool_choice="none",
                                   previous_response_id=response.id, input=[
                                       {"type": "function_call_output", "call_id": call.call_id,
                                        "output": "sunny, 21 C"}])
    assert chained.previous_response_id == response.id and chained.output_text
    assert chained.usage.input_tokens == follow.usage.input_tokens  # the same conversation, the same prompt
    for key, previous in ((KEY, "resp_123"), (QUOTA_KEY, response.id)):  # unknown, and another key's
        other = openai.OpenAI(base_url=oai.base_url, api_key=key, max_retries=0, timeout=120)
        with pytest.raises(openai.NotFoundError) as refused:
            other.responses.create(model=MODEL, input="hi", previous_response_id=previous)
        assert refused.value.body["param"] == "previous_response_id"
        assert refused.value.body["code"] == "previous_response_not_found"


def test_an_unknown_model_is_not_found_on_both_apis(oai, claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-nope", input="hi", max_output_tokens=4)


def test_anthropic_create_and_stream_with_a_tool(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
    message = claude.messages.create(model=MODEL, max_tokens=40, extra_body={"temperature": 0}, tools=tools,
                                     tool_choice={"type": "tool", "name": "get_weather"}, system="You are terse.",
                                     messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert message.stop_reason == "tool_use"
    use = next(block for block in message.content if block.type == "tool_use")
    assert use.name == "get_weather" and "city" in use.input
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                  "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]}]
    with claude.messages.stream(model=MODEL, max_tokens=12, extra_body={"temperature": 0}, tools=tools,
                                messages=history) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 20
    prompt_tokens = final.usage.input_tokens + final.usage.cache_read_input_tokens
    with claude.messages.stream(model=MODEL, max_tokens=60, extra_body={"temperature": 0}, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Weather in Rome?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert "city" in final.content[-1].input
    counted = claude.messages.count_tokens(model=MODEL, tools=tools, messages=history)
    assert counted.input_tokens == prompt_tokens  # the prompt the worker prefilled for the same messages


def test_keys_quotas_priority_metrics_and_audit(server, audit_lines):
    for route, shape in (("/v1/responses", "openai"), ("/v1/messages", "anthropic")):
        body = {"model": MODEL, "max_tokens": 4, "max_output_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
        if route == "/v1/responses":
            body.pop("messages"), body.pop("max_tokens")
        else:
            body.pop("input"), body.pop("max_output_tokens")
        wrong = httpx.post(server.base + route, json=body, headers={"x-api-key": "wrong"}, timeout=60)
        assert wrong.status_code == 401
        if shape == "anthropic":
            assert wrong.json()["type"] == "error" and wrong.json()["error"]["type"] == "authentication_error"
        else:
            assert wrong.json()["error"]["code"] == "invalid_api_key"
        big = {**body, "max_tokens": 100} if shape == "anthropic" else {**body, "max_output_tokens": 100}
        over = httpx.post(server.base + route, json=big, headers={"Authorization": f"Bearer {QUOTA_KEY}"},
                          timeout=60)
        assert over.status_code == 429
        assert (over.json()["error"]["type"] == "rate_limit_error") if shape == "anthropic" else over.json()["error"]
        ok = httpx.post(server.base + route, json={**body, "priority": -7}, headers={"x-api-key": KEY}, timeout=120)
        assert ok.status_code == 200, ok.text
        assert server.metric("edge:api_requests_total", route=route, status="finished") >= 1
        assert server.metric("edge:api_requests_total", route=route, status="rejected") >= 2
    def prioritized():
        return [e for e in audit_lines() if e["route"] == "/v1/messages" and e["priority"] == -7]
    assert wait_for(lambda: prioritized(), timeout_s=10)
    lines = prioritized()
    assert lines[0]["status"] == "finished" and lines[0]["http_status"] == 200
    refused = [e for e in audit_lines() if e["route"] == "/v1/responses" and e["http_status"] == 401]
    assert refused and refused[0]["status"] == "rejected"
