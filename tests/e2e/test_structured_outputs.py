"""Structured outputs against the real server on the embedded model, through the official openai client: pydantic
models parse, json_object is JSON, regex and choice hold, a bad schema is a 400 naming the problem, unconstrained
requests batched with constrained ones give the text they give alone, a sample of JSONSchemaBench's public schemas
gets only answers that validate (or a clear 400), and a schema built to explode compilation is a 400 within the
time limit while another client's request keeps its latency."""

import enum
import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from public_schemas import schemas_dir
from server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# The mixed-batch test compares greedy texts bit for bit, so nothing but the constraint may change them:
# float32 activations and weights (on this CPU bfloat16 matrix products round differently at different batch sizes,
# and auto's weight plan may hold q8_0 weights up to a batch size and float32 ones above it) and no prompt cache
# (a prompt whose prefix comes from the cache gets its last position computed in another llama.cpp batch shape)
COMPILE_LIMIT_S = 1.0  # grammar_compile_timeout_s of this server (the default is 5)
CONFIG = f"""
max_num_seqs = 32
dtype = "float32"
weight_dtype = "float32"
prefix_cache_tokens = 0
grammar_compile_timeout_s = {COMPILE_LIMIT_S}
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
    assert error["code"] == "invalid_structured_output" and "type must be a string" in error["message"]
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
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert {t.index for t in deltas} == {0} and deltas[0].function.name == "get_weather" and deltas[0].id
    arguments = "".join(t.function.arguments or "" for t in deltas)  # the name first, then argument fragments
    assert WeatherArgs.model_validate_json(arguments) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_an_unsupported_keyword_is_a_400_naming_it(server):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    response = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_structured_output"
    assert "uniqueItems" in error["message"] and "not enforce" in error["message"]


BENCH = schemas_dir()
BENCH_EVERY = 10  # every 10th public schema by name: 103 (tests/contracts/test_jsonschemabench.py's sample)
BENCH_REFUSED = 4  # of them the engine refuses, as tests/contracts/test_jsonschemabench.py pins
REFUSAL_CODES = ("invalid_structured_output", "structured_output_too_complex")


def _answer(server, name: str, schema: dict) -> tuple[int, dict]:
    """One schema's answer. The senders share one client address, which may compile one constraint at a time
    (a 429 structured_output_compiles_per_key past that): such a 429 is retried, as a client would."""
    for attempt in range(400):
        response = httpx.post(server.base + "/v1/chat/completions", timeout=300, json={
            "model": MODEL, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": f"Reply with one JSON example of {name}."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
        if response.status_code != 429 or response.json()["error"]["code"] != "structured_output_compiles_per_key":
            break
        time.sleep(0.05 * (1 + attempt % 4))  # a client's retry backoff: the other sender's compile takes ms
    return response.status_code, response.json()


def _violations(schema: dict, text: str) -> list[str]:
    try:
        instance = json.loads(text)
    except ValueError as err:
        return [f"not JSON: {err}"]
    validator = jsonschema.validators.validator_for(schema)
    checker = validator(schema, format_checker=validator.FORMAT_CHECKER)
    return [error.message for error in checker.iter_errors(instance)]


@pytest.mark.skipif(not BENCH.is_dir(), reason=f"JSONSchemaBench is not at {BENCH}")
def test_public_schemas_get_answers_that_validate_or_a_clear_400(server):
    """An answer the grammar completed (finish_reason stop) must validate against its schema; one cut by max_tokens
    (length) is incomplete JSON, as with OpenAI, and counted, not validated. No 5xx, whatever the schema."""
    cases = [(p.stem, json.loads(p.read_text())["schema"]) for p in sorted(BENCH.glob("*.json"))[::BENCH_EVERY]]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: _answer(server, *case), cases))
    refused, finished, cut, violations = 0, 0, 0, []
    for (name, schema), (status, body) in zip(cases, results):
        assert status in (200, 400), (name, status, body)
        if status == 400:
            refused += 1
            assert body["error"]["code"] in REFUSAL_CODES and body["error"]["message"], (name, body)
            continue
        choice = body["choices"][0]
        if choice["finish_reason"] == "length":
            cut += 1
            continue
        assert choice["finish_reason"] == "stop", (name, choice)
        finished += 1
        violations += [(name, v) for v in _violations(schema, choice["message"]["content"])]
    print(f"{len(cases)} schemas: {finished} answers finished and validated, {cut} cut by max_tokens, "
          f"{refused} refused")
    assert violations == []
    assert refused == BENCH_REFUSED
    assert finished >= 10  # enough complete answers for the check to mean something (17 of 99 on the dev box)


def _explosive(k: int = 4, n: int = 9) -> dict:
    """allOf over k anyOfs of n objects, each with a backtracking pattern: the compiler multiplies the unions out
    (n**k alternatives) before its size limit stops it, seconds of CPU on the dev machine."""
    return {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {
        "type": "string", "pattern": f"^(x+x+)+y{{{i},{i + 30}}}$"}}} for i in range(n)]} for j in range(k)]}


def test_a_schema_built_to_explode_compilation_is_a_400_in_time_and_others_keep_their_latency(server):
    def plain() -> float:
        started = time.perf_counter()
        response = httpx.post(server.base + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Write one sentence about the sea.", "max_tokens": 16, "temperature": 0})
        assert response.status_code == 200
        return time.perf_counter() - started

    def explode() -> tuple[float, httpx.Response]:
        started = time.perf_counter()
        response = httpx.post(server.base + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _explosive()}}})
        return time.perf_counter() - started, response

    alone = statistics.median(plain() for _ in range(3))
    with ThreadPoolExecutor(2) as pool:
        exploding = pool.submit(explode)
        during = pool.submit(plain).result()
        elapsed, response = exploding.result()
    print(f"explosive schema answered in {elapsed:.2f} s; a plain request took {during:.2f} s during it, "
          f"{alone:.2f} s alone")
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "structured_output_too_complex", error
    assert elapsed < COMPILE_LIMIT_S + 1.0
    # not queued behind the compile (it goes on for seconds after its 400), only sharing the CPU with it
    assert during < 2 * alone + 1.0
