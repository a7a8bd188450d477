"""Client libraries as a new user drives them, against the real server on the embedded model: the openai client's
models.retrieve, instructor (TOOLS, JSON, JSON_SCHEMA modes) and langchain's with_structured_output (json_schema
and function_calling) with bounded pydantic models; and a schema built to explode compilation refused within the
time limit while a streaming client keeps its pace. A library that is not installed skips its tests."""

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
COMPILE_LIMIT_S = 1.0  # grammar_compile_timeout_s of this server (the default is 5)
# weights pinned: auto picks them by a start-up measurement, and the model's greedy answers differ between them
# (with q8_0, langchain's function-calling schema, whose objects allow extra properties, sends it into a loop of
# invented keys until max_tokens)
CONFIG = f"""
kv_cache_tokens = 8192
max_model_len = 1200
weight_dtype = "float32"
grammar_compile_timeout_s = {COMPILE_LIMIT_S}
[limits]
shutdown_grace_s = 1.0
"""
PROMPT = "Invent a person: a name, an age, and an address (a city and a street number)."


# bounded, as a schema for a small model should be: unbounded, a 135M model's greedy JSON can run past max_tokens
class Address(BaseModel):
    city: Literal["Paris", "Rome", "Oslo", "Lima"]
    street_number: int = Field(ge=1, le=999)


class Person(BaseModel):
    """A person and where they live."""
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address  # a nested model: the schema carries $defs and a $ref


class Pet(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(CONFIG, tmp_path_factory.mktemp("clients")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_retrieve_and_an_unknown_id_is_a_404_in_openais_shape(server, client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "edge")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    error = caught.value.body
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"] and MODEL in error["message"]
    raw = httpx.get(server.base + "/v1/models/org/some-model", timeout=30)  # an id with a slash reaches the route
    assert raw.status_code == 404 and raw.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as caught:  # a generation with an unknown model: 404 too
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(client, mode):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    person = patched.chat.completions.create(model=MODEL, response_model=Person, max_retries=0, max_tokens=200,
                                             temperature=0, messages=[{"role": "user", "content": PROMPT}])
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_instructor_json_mode(client):
    """JSON mode asks for json_object and shows the schema in a system message only, as OpenAI's API has it: the
    server holds the answer to JSON, the model alone to the schema, so a flat model that a 135M model follows."""
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON)
    pet = patched.chat.completions.create(model=MODEL, response_model=Pet, max_retries=0, max_tokens=100,
                                          temperature=0, messages=[{"role": "user", "content": "Invent a pet: "
                                                                    "its name and its age."}])
    assert isinstance(pet, Pet)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=server.base + "/v1", api_key="unused", temperature=0,
                                       max_tokens=200, max_retries=0, timeout=120)
    person = chat.with_structured_output(Person, method=method).invoke(PROMPT)
    assert isinstance(person, Person) and isinstance(person.address, Address)


def _nested_any_of(depth: int = 3, width: int = 6) -> dict:
    """anyOf nested `depth` deep, `width` objects each, every string with a backtracking pattern, twice under an
    allOf: the compiler multiplies the alternatives out until its size limit stops it, over a second of CPU here.
    (oneOf itself is refused at once: the engine cannot enforce that exactly one branch matches.)"""
    def level(d: int) -> dict:
        if d == depth:
            return {"type": "string", "pattern": f"^(a+a+)+b{{{d},{d + 40}}}$"}
        return {"anyOf": [{"type": "object", "required": [f"k{d}_{i}"], "properties": {
            f"k{d}_{i}": level(d + 1), f"p{d}_{i}": {"type": "string", "pattern": f"^(x+x+)+y{{{i},{i + 30}}}$"}}}
            for i in range(width)]}
    return {"allOf": [level(0), level(0)]}


def test_an_explosive_schema_is_refused_in_time_while_a_stream_keeps_its_pace(server):
    """The 400 comes within the compile limit (plus the round trip), and a plain streaming client's worst gap
    between two tokens, while the compile runs, stays near what it is alone."""
    def worst_gap(first_token: threading.Event | None = None) -> float:
        gaps, last = [], None
        with httpx.stream("POST", server.base + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Write about the sea.", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    elif first_token is not None:
                        first_token.set()
                    last = now
        return max(gaps)

    def explode() -> tuple[float, httpx.Response]:
        started = time.perf_counter()
        response = httpx.post(server.base + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_any_of()}}})
        return time.perf_counter() - started, response

    alone = statistics.median(worst_gap() for _ in range(3))
    first_token = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(worst_gap, first_token)
        assert first_token.wait(60)
        elapsed, response = explode()  # while the stream runs
        during = stream.result()
    print(f"explosive schema: {response.status_code} in {elapsed:.2f} s; a stream's worst token gap "
          f"{during * 1000:.0f} ms during it, {alone * 1000:.0f} ms alone")
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "structured_output_too_complex", error
    assert elapsed < COMPILE_LIMIT_S + 1.0
    assert during < 2 * alone + 0.25
