"""Where this server used to differ from OpenAI, end to end on the embedded model with the default policy: the chat
stream's first and last chunks, cached prompt tokens in usage, chat logprobs that join into the content, a forced
tool call cut by max_tokens, logprobs 0, an over-long prompt, a batch of prompts, and the requests OpenAI refuses."""

import json

import httpx
import openai
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
CONFIG = """
kv_cache_tokens = 8192
max_model_len = 1200
"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": WEATHER}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(CONFIG, tmp_path_factory.mktemp("serve")).start()  # the default policy
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json={"model": MODEL, **body}, timeout=120)


def test_a_chat_stream_has_openais_first_and_last_chunks_and_cached_tokens(server):
    body = {"messages": [{"role": "user", "content": "Count from one to ten in words, please."}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    usages = []
    for _ in range(2):  # the second time the worker's prompt cache holds the prompt
        with httpx.stream("POST", server.base + "/v1/chat/completions", json={"model": MODEL, **body},
                          timeout=120) as response:
            assert response.status_code == 200 and response.headers["X-Edge-Tier"] == "normal"
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        assert choices[0]["delta"] == {"role": "assistant", "content": None}
        assert all("role" not in c["delta"] for c in choices[1:])
        assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None and c["delta"]["content"] for c in choices[1:-1])
        usages.append(chunks[-1]["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < usages[1]["prompt_tokens_details"]["cached_tokens"] <= usages[1]["prompt_tokens"]


def test_chat_logprobs_join_into_the_content(client):
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=60, temperature=0, logprobs=True, top_logprobs=2)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"  # ended by the end-of-turn token, which is left out
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_logprobs_zero_gives_the_sampled_tokens_logprob(client):
    choice = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0,
                                       logprobs=0).choices[0]
    assert len(choice.logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text


def test_a_forced_tool_call_cut_by_max_tokens_is_a_partial_call(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert call.function.arguments == "" or call.function.arguments.startswith("{")  # the arguments written so far


def test_an_over_long_prompt_is_a_400_context_length_exceeded(server):
    response = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "words and more words " * 700}], "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", "messages",
                                                              "invalid_request_error")
    assert "maximum context length is" in error["message"]


def test_a_batch_of_prompts_gets_its_choices_prompt_major(client):
    answer = client.completions.create(model=MODEL, prompt=["The sky is", "One, two,"], n=2, max_tokens=3,
                                       temperature=0, echo=True)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text.split(" ")[0] for c in answer.choices] == ["The", "The", "One,", "One,"]  # each echoes its prompt
    assert answer.usage.completion_tokens == 12
    tokens = client.completions.create(model=MODEL, prompt=[[504, 3094, 314], [2365, 28]], max_tokens=2,
                                       temperature=0)
    assert len(tokens.choices) == 2 and tokens.usage.prompt_tokens == 5 and tokens.usage.completion_tokens == 4


def test_a_streamed_batch_of_prompts_is_one_stream_with_prompt_major_indexes(client):
    """Issue 48.8: the openai SDK's stream of a list of prompts: chunks of both prompts, each choice index i*n + j
    ended with its finish_reason (each echoing its own prompt), the usage summed at the end."""
    chunks = list(client.completions.create(model=MODEL, prompt=["The sky is", "One, two,"], n=2, max_tokens=3,
                                            temperature=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            ends[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2, 3] and ends == {i: "length" for i in range(4)}
    assert [texts[i].split(" ")[0] for i in range(4)] == ["The", "The", "One,", "One,"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({chunk.id for chunk in chunks}) == 1


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["one", [5, 10**9]]}, "prompt[1][1]"),
])
def test_what_openai_refuses_is_refused(server, body, param):
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
