"""Structured outputs against the real server on the embedded model, through the official openai client: pydantic
models parse, json_object is JSON, regex and choice hold, a bad schema is a 400 naming the problem, and
unconstrained requests batched with constrained ones give the text they give alone."""

import enum
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from typing import Annotated

from pydantic import BaseModel, Field

from server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# The mixed-batch test compares greedy texts bit for bit, so nothing but the constraint may change them:
# float32 (on this CPU bfloat16 matrix products round differently at different batch sizes) and no prompt cache
# (a prompt whose prefix comes from the cache gets its last position computed in another llama.cpp batch shape)
CONFIG = """
max_num_seqs = 32
dtype = "float32"
prefix_cache_tokens = 0
[limits]
shutdown_grace_s = 1.0
"""


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


# Bounded lengths and ranges, as a schema for a small model should have them: unbounded, the 135M model's greedy
# output repeats an array item or a digit until max_tokens (the grammar holds; the JSON never closes).
Name = Annotated[str, Field(max_length=30)]


class City(BaseModel):
    name: Name
    population: int = Field(ge=0, le=100_000_000)


class Pet(BaseModel):
    name: Name
    color: Color
    age: int = Field(ge=0, le=99)


class Trip(BaseModel):
    destination: City
    days: int = Field(ge=1, le=30)
    items: list[Name] = Field(max_length=4)


class Person(BaseModel):
    name: Name
    pets: list[Pet] = Field(max_length=3)
    favourite: Color


PROMPTS = [  # (prompt, pydantic model): nested objects, enums, arrays
    ("Describe Paris as a city.", City),
    ("Describe a small dog.", Pet),
    ("Describe a black cat named Tom.", Pet),
    ("Plan a trip to Rome.", Trip),
    ("Plan a weekend at the sea.", Trip),
    ("Describe a person who has two pets.", Person),
    ("Describe Alice and her favourite colour.", Person),
    ("Describe Tokyo.", City),
    ("Describe an old parrot.", Pet),
    ("Plan a trip to the mountains with a list of things to pack.", Trip),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(CONFIG, tmp_path_factory.mktemp("structured")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _parse(client, prompt: str, model: type[BaseModel]):
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": prompt + " Answer in JSON."}], response_format=model,
        max_tokens=300, temperature=0)
    return completion.choices[0]


def test_pydantic_models_parse_for_varied_prompts(client):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        choices = list(pool.map(lambda p: _parse(client, *p), PROMPTS))
    for (prompt, model), choice in zip(PROMPTS, choices):
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        assert isinstance(choice.message.parsed, model), (prompt, choice.message.content)


def test_json_object_regex_and_choice(client):
    def chat(content: str, **kw):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=200, temperature=0, **kw).choices[0]
    obj = chat("Describe a book as a JSON object with a title and an author.", response_format={"type": "json_object"})
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)
    digits = chat("How many legs does a spider have?", extra_body={"guided_regex": "[0-9]{1,3}"})
    assert re.fullmatch("[0-9]{1,3}", digits.message.content)
    pick = chat("Is the sky blue? Answer yes or no.", extra_body={"guided_choice": ["yes", "no"]})
    assert pick.message.content in ("yes", "no")
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=20,
                                           temperature=0.7, seed=3, extra_body={"guided_choice": ["Paris", "Rome"]})
    assert completion.choices[0].text in ("Paris", "Rome")


def test_a_schema_that_does_not_compile_is_a_400_naming_the_problem(server):
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}
    response = httpx.post(server.base + "/v1/chat/completions", json=bad, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "response_format"
    assert error["code"] == "invalid_structured_output" and "Type should be a string" in error["message"]
    regex = httpx.post(server.base + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "x", "guided_regex": "a(b"})
    assert regex.status_code == 400 and regex.json()["error"]["param"] == "guided_regex"


def test_unconstrained_requests_in_a_mixed_batch_give_their_text_alone(client):
    plain_prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def plain(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text

    alone = [plain(p) for p in plain_prompts]
    with ThreadPoolExecutor(16) as pool:
        constrained = [pool.submit(_parse, client, *PROMPTS[i % len(PROMPTS)]) for i in range(8)]
        mixed = list(pool.map(plain, plain_prompts))
        assert all(isinstance(f.result().message.parsed, BaseModel) for f in constrained)
    assert mixed == alone


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


class WeatherArgs(BaseModel):
    city: str
    unit: str


def test_a_named_tool_choice_returns_a_call_whose_arguments_fit_the_schema(client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   max_tokens=100, temperature=0)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = WeatherArgs.model_validate_json(call.function.arguments)
    assert args.unit in ("celsius", "fahrenheit")
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # the call's JSON is not streamed as text
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert WeatherArgs.model_validate_json(calls[0].function.arguments) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
