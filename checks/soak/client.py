"""The soak's clients: the valid requests they send (a random mix) and the hostile ones, and how each client
judges the answer it got: one outcome it saw, or one of FAILURES."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

from checks.soak.service import CLIENT_DEADLINE_S, KEYS, MODEL
from server_process import ServerProcess

QUESTIONS = ["Name three colors.", "What is the capital of France?", "Count to ten.", "Write a haiku about rain.",
             "Why is the sky blue?", "Give me a word that rhymes with cat."]
WORDS = "appliance firewall answer request model token cache stream priority worker engine policy".split()
# the failure outcomes; every other outcome is one the client saw and may act on
FAILURES = ("hang", "http 500", "server fault in stream", "no terminal outcome", "two outcomes",
            "connection dropped", "error body not OpenAI-style")
SERVER_FAULT_CODES = {"decode_failed", "prefill_failed", "internal_error"}  # what a non-stream client gets as 500


@dataclass(frozen=True)
class Spec:
    """One request to send, and how its client behaves."""
    label: str
    path: str
    content: bytes
    stream: bool = False
    method: str = "POST"
    key: str | None = KEYS["standard"]
    bad: bool = False  # a hostile body: must get a 4xx with an OpenAI-style error
    disconnect_after: int | None = None  # close the stream after this many chunks
    client_timeout_s: float | None = None  # give up on a non-stream answer after this long


@dataclass
class Result:
    label: str
    bad: bool
    at_s: float
    outcome: str  # completed | client disconnect | error | one of FAILURES
    status: int = 0  # 0: no HTTP status told it (a stream's error event, a transport failure)
    code: str = ""
    detail: str = ""

    @property
    def row(self) -> str:
        if self.outcome != "error":
            return self.outcome if self.outcome not in FAILURES else f"FAILED: {self.outcome}"
        return f"{self.status} {self.code}" if self.status else f"stream error event: {self.code}"


def send(client: httpx.Client, spec: Spec) -> tuple[str, int, str, str]:
    """(outcome, status, code, detail) of one request, as its client saw it."""
    headers = {"Content-Type": "application/json"}
    if spec.key:
        headers["Authorization"] = f"Bearer {spec.key}"
    deadline = time.monotonic() + CLIENT_DEADLINE_S
    try:
        with client.stream(spec.method, spec.path, content=spec.content or None, headers=headers,
                           timeout=spec.client_timeout_s or CLIENT_DEADLINE_S) as response:
            if response.status_code != 200 or not spec.stream:
                response.read()
                return judge_body(response)
            return judge_stream(response, spec.disconnect_after, deadline)
    except httpx.TimeoutException:
        if spec.client_timeout_s:
            return "client disconnect", 0, "", f"gave up after {spec.client_timeout_s:.1f} s"
        return "hang", 0, "", f"no answer within {CLIENT_DEADLINE_S} s"
    except httpx.TransportError as err:  # the gateway is never killed: it must not drop a connection
        return "connection dropped", 0, "", repr(err)[:160]


def judge_body(response: httpx.Response) -> tuple[str, int, str, str]:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    if status == 200:
        choices = body.get("choices") if isinstance(body, dict) else None
        finish = choices[0].get("finish_reason") if choices else None
        if finish in ("stop", "length"):
            return "completed", 200, "", ""
        return "no terminal outcome", 200, "", f"200 with finish_reason {finish!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= error.keys():
        return "error body not OpenAI-style", status, "", response.text[:160]
    return "http 500" if status == 500 else "error", status, str(error["code"]), str(error["message"])[:160]


def judge_stream(response: httpx.Response, disconnect_after: int | None, deadline: float):
    finishes, errors, chunks, done = 0, [], 0, 0
    for line in response.iter_lines():
        if time.monotonic() > deadline:
            return "hang", 200, "", f"stream still open after {CLIENT_DEADLINE_S} s"
        if not line.startswith("data: "):
            continue
        if done:
            return "two outcomes", 200, "", f"data after [DONE]: {line[:80]}"
        if line == "data: [DONE]":
            done = 1
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return "no terminal outcome", 200, "", f"unreadable event {line[:80]}"
        if "error" in event:
            errors.append(event["error"])
            continue
        chunks += 1
        finishes += sum(1 for c in event.get("choices", []) if c.get("finish_reason"))
        if disconnect_after and chunks >= disconnect_after and not finishes:
            return "client disconnect", 200, "", f"closed the stream after {chunks} chunks"
    return stream_outcome(done, finishes, errors)


def stream_outcome(done: int, finishes: int, errors: list[dict]) -> tuple[str, int, str, str]:
    if not done:
        return "no terminal outcome", 200, "", "the stream ended without data: [DONE]"
    if finishes + len(errors) != 1:
        return "two outcomes" if finishes + len(errors) else "no terminal outcome", 200, "", \
            f"{finishes} finish_reason chunks and {len(errors)} error events"
    if not errors:
        return "completed", 200, "", ""
    code = str(errors[0].get("code"))
    return "server fault in stream" if code in SERVER_FAULT_CODES else "error", 0, code, \
        str(errors[0].get("message"))[:160]


def good_spec(rng: random.Random) -> Spec:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body = {"model": MODEL, "max_tokens": rng.randint(8, 32), "temperature": rng.choice([0.0, 0.7]), "stream": stream}
    if rng.random() < 0.3:
        body["priority"] = rng.choice([-5, 0, 5, 10])  # an explicit priority over the key's class
    text = prompt_text(rng)
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    roll = rng.random()
    return Spec(("chat" if chat else "completion") + (" stream" if stream else ""),
                "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode(), stream,
                key=KEYS[rng.choice(list(KEYS))],
                disconnect_after=rng.randint(1, 4) if stream and roll < 0.2 else None,
                client_timeout_s=rng.uniform(0.3, 2.0) if not stream and roll < 0.15 else None)


def prompt_text(rng: random.Random) -> str:
    if rng.random() < 0.25:  # 400-850 fresh tokens: seconds of prefill, so faults meet prompts in flight
        tag = rng.randrange(10 ** 6)
        return " ".join(f"{rng.choice(WORDS)}{tag + i}" for i in range(rng.randint(60, 120)))
    return rng.choice(QUESTIONS)


def bad_specs() -> list[Spec]:
    deep = "[" * 100_000 + "]" * 100_000

    def chat(content_json: str) -> bytes:  # raw JSON text: it may hold what json.dumps would not write
        return f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {content_json}}}]}}'.encode()

    def completion(**fields) -> bytes:
        return json.dumps({"model": MODEL, "max_tokens": 8, **fields}).encode()
    c, p = "/v1/chat/completions", "/v1/completions"
    return [Spec("invalid JSON", c, b'{"model": "x", "messages": [', bad=True),
            Spec("100,000-deep arrays", c, deep.encode(), bad=True),
            Spec("100,000-deep arrays in a message", c, chat(deep), bad=True),
            Spec("lone surrogate \\ud800", c, chat('"hi \\ud800 there"'), bad=True),
            Spec("token id 2**40", p, completion(prompt=[2 ** 40]), bad=True),
            Spec("token id 49152 (= vocabulary size)", p, completion(prompt=[49152]), bad=True),
            Spec("max_tokens a string", p, completion(prompt="hi", max_tokens="ten"), bad=True),
            Spec("messages a string", c, json.dumps({"model": MODEL, "messages": "hello"}).encode(), bad=True),
            Spec("stream not a bool", p, completion(prompt="hi", stream="yes"), bad=True),
            Spec("blocked word", c, chat('"please say f o r b i d d e n"'), bad=True),
            Spec("wrong API key", p, completion(prompt="hi"), key="sk-wrong", bad=True),
            Spec("unknown route", "/v1/nope", completion(prompt="hi"), bad=True),
            Spec("wrong method", c, b"", method="GET", bad=True)]


def probe_classes(server: ServerProcess) -> dict[str, str]:
    """One small request per class after the soak: a leaked concurrency slot or a lost key shows here."""
    answers = {}
    with httpx.Client(base_url=server.base) as client:
        for name, key in KEYS.items():
            body = json.dumps({"model": MODEL, "prompt": "Say hello.", "max_tokens": 4}).encode()
            outcome, status, code, _ = send(client, Spec(f"probe {name}", "/v1/completions", body, key=key))
            answers[name] = outcome if outcome != "error" else f"{status} {code}"
    return answers
