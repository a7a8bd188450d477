"""End to end: the real service (gateway, llama.cpp prefill worker, decode engine) on the embedded model,
driven by the official openai client and by raw HTTP for every bad input. One server for the module
(tests/e2e/conftest.py)."""

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess, pid_alive, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY, LIMITED_KEY, OTHER_KEY = "test-key", "limited-key", "other-key"
# one weight precision, pinned: the reproducibility tests compare texts between calls, and auto's live weight switch
# may move its batch-size cut-off between two of them on a busy machine (docs/decode.md)
CONFIG = """
weight_dtype = "float32"
kv_cache_tokens = 8192
max_model_len = 1200
worker_heartbeat_timeout_s = 3
[limits]
max_body_bytes = 65536
prefill_queue_size = 4
shutdown_grace_s = 1.0
header_timeout_s = 2.0
body_timeout_s = 2.0
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
[classes.limited]
priority = 5
[[keys]]
key = "{KEY}"
class = "standard"
[[keys]]
key = "{LIMITED_KEY}"
class = "limited"
requests_per_minute = 2
[[keys]]
key = "{OTHER_KEY}"
class = "standard"
"""
LONG_TEXT = "The appliance serves many users behind a firewall, and every one of them expects answers. " * 12


def prefilling(server) -> bool:
    """Whether prefill-0 holds a prompt now (/health shows each worker's current request)."""
    return server.health()["prefill"]["prefill-0"]["request"] is not None


def fresh_text(tag: str, n_words: int) -> str:
    """About 3 tokens per word, starting with a tag no other prompt shares, so the prompt cache cannot help."""
    return " ".join(f"{tag}{i}" for i in range(n_words))


def post(server, path, body=None, key=KEY, raw=None, headers=None):
    headers = {"Content-Type": "application/json", **(headers or {})}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.base + path, json=body if raw is None else None, content=raw, headers=headers,
                      timeout=120)


def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    health = server.health()
    assert health["status"] == "ok" and health["components"]["decode_engine"] == "ready"


def test_chat_and_completions_with_the_openai_client(oai):
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                       max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 5
    completion = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                        temperature=0, logprobs=2)
    assert completion.choices[0].text.strip() and completion.usage.completion_tokens == 6
    assert len(completion.choices[0].logprobs.token_logprobs) == 6
    assert all(len(top) == 2 for top in completion.choices[0].logprobs.top_logprobs)


def test_streaming_with_the_openai_client(oai):
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = list(oai.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0,
                                           stream=True))
    assert text and "".join(c.choices[0].text for c in streamed)


def test_greedy_output_is_reproducible_and_seeded_sampling_too(oai):
    """Between calls in the same prompt-cache state. A miss and a hit do not always agree: with the f16 prefill
    copy on an AVX2 CPU, llama.cpp computes the last prompt token alone (hit) with other rounding than inside
    the whole prompt (miss), and greedy text can part after a few tokens. So the first call warms the cache."""
    def ask(**kw):
        return oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, **kw).choices[0].text
    ask(temperature=0)
    assert ask(temperature=0) == ask(temperature=0)
    assert ask(temperature=0.9, seed=7) == ask(temperature=0.9, seed=7)


def test_output_controls_reach_both_the_first_token_and_the_decode_steps(oai):
    """logit_bias forces one token from the first (prefill worker) to the last (decode engine); ignore_eos and
    min_tokens keep a short answer going; a penalty changes a greedy answer."""
    def complete(**kw):
        return oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                      temperature=0, logprobs=0, **kw).choices[0]
    plain, forced = complete(), complete(extra_body={"logit_bias": {"1000": 100}})
    assert len(set(forced.logprobs.tokens)) == 1 and forced.logprobs.tokens != plain.logprobs.tokens
    assert complete(frequency_penalty=2.0, presence_penalty=2.0).text != plain.text
    echoed = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                    echo=True).choices[0]
    assert echoed.text == "The capital of France is" + plain.text
    streamed = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                      temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.text

    def chat(**kw):
        return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=60, temperature=0, **kw)
    short = chat()
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    assert chat(extra_body={"ignore_eos": True}).usage.completion_tokens == 60
    assert chat(extra_body={"min_tokens": 45}).usage.completion_tokens >= 45


def test_stop_strings_end_the_answer(oai):
    text = oai.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                  stop=[" 7"]).choices[0]
    assert " 7" not in text.text and text.finish_reason == "stop"


BAD_INPUTS = [
    ("malformed json", dict(raw=b"{not json"), 400, "invalid_json"),
    ("body not an object", dict(body=[1, 2]), 400, None),
    ("unknown model", dict(body={"model": "gpt-9", "prompt": "hi"}), 404, "model_not_found"),
    ("missing prompt", dict(body={"model": MODEL}), 400, "missing_required_parameter"),
    ("wrong type max_tokens", dict(body={"model": MODEL, "prompt": "hi", "max_tokens": "ten"}), 400, "invalid_type"),
    ("max_tokens too big", dict(body={"model": MODEL, "prompt": "hi", "max_tokens": 100000}), 400, "invalid_value"),
    ("temperature out of range", dict(body={"model": MODEL, "prompt": "hi", "temperature": 3}), 400, "invalid_value"),
    ("top_p zero", dict(body={"model": MODEL, "prompt": "hi", "top_p": 0}), 400, "invalid_value"),
    ("best_of above n", dict(body={"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3}), 400,
     "unsupported_parameter"),
    ("n above OpenAI's limit", dict(body={"model": MODEL, "prompt": "hi", "n": 129}), 400, "invalid_value"),
    ("stream not bool", dict(body={"model": MODEL, "prompt": "hi", "stream": "yes"}), 400, "invalid_type"),
    ("body too large", dict(body={"model": MODEL, "prompt": "x" * 70000}), 413, "body_too_large"),
    ("prompt over token limit", dict(body={"model": MODEL, "prompt": LONG_TEXT * 6}), 400, "context_length_exceeded"),
    ("prompt plus max_tokens over the context", dict(body={"model": MODEL, "prompt": LONG_TEXT * 4, "max_tokens": 512}),
     400, "context_length_exceeded"),
    ("blocked content", dict(body={"model": MODEL, "prompt": "say F O R\u200bB I D D E N"}), 403, "content_blocked"),
    ("blocked full-width", dict(body={"model": MODEL, "prompt": "ｆｏｒｂｉｄｄｅｎ words"}), 403, "content_blocked"),
    ("missing key", dict(body={"model": MODEL, "prompt": "hi"}, key=None), 401, "invalid_api_key"),
    ("wrong key", dict(body={"model": MODEL, "prompt": "hi"}, key="nope"), 401, "invalid_api_key"),
    ("token id past the vocabulary", dict(body={"model": MODEL, "prompt": [1, 49152]}), 400, "invalid_value"),
    ("token id of 2**40", dict(body={"model": MODEL, "prompt": [2**40]}), 400, "invalid_value"),
    ("lone surrogate", dict(raw=b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode()), 400, "invalid_value"),
    ("deep nesting", dict(raw=b"[" * 30_000 + b"]" * 30_000), 400, "invalid_json"),  # under the 64 KiB body limit
]


@pytest.mark.parametrize("name,kwargs,status,code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_status_and_an_openai_error(server, name, kwargs, status, code):
    response = post(server, "/v1/completions", **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and "param" in error
    if code:
        assert error["code"] == code
    if name == "prompt over token limit":  # OpenAI's 400: the model's context named, and the policy's limit
        assert "maximum context length is" in error["message"] and "limited to 1024 tokens" in error["message"]
        assert error["param"] == "prompt"


def test_a_lone_surrogate_in_chat_is_refused_and_the_worker_keeps_serving(server, oai):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode()
    response = post(server, "/v1/chat/completions", raw=raw)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content"
    assert oai.completions.create(model=MODEL, prompt="Still here", max_tokens=2,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_unknown_routes_and_methods_get_openai_errors(server):
    missing = httpx.get(server.base + "/v1/nothing", timeout=10)
    wrong = httpx.get(server.base + "/v1/completions", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"]
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] and "POST" in wrong.headers["Allow"]


def test_chat_with_bad_messages(server):
    response = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0]"


def test_rate_limit_answers_429_with_retry_after(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    statuses = [post(server, "/v1/completions", body, key=LIMITED_KEY) for _ in range(3)]
    assert [r.status_code for r in statuses[:2]] == [200, 200]
    assert statuses[2].status_code == 429 and int(statuses[2].headers["Retry-After"]) >= 1


def test_full_prefill_queue_answers_429(server):
    body = {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 1}
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(server, "/v1/completions", body)))
               for _ in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
    assert all(int(r.headers["Retry-After"]) >= 1 for r in results if r.status_code == 429)


def test_closing_a_stream_frees_its_kv_blocks(server, oai):
    with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 400, "temperature": 0, "stream": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert wait_for(lambda: server.metric("edge:kv_cache_blocks_used") > 0, 30)
    closed = time.monotonic()
    assert wait_for(lambda: server.metric("edge:kv_cache_blocks_used") == 0, 30)
    # freed within about a second quiet (metrics refresh every 0.5 s); 10 s allows a loaded box, and still fails if
    # the blocks were freed only when the stream ran out: ~394 more tokens, tens of seconds on this CPU
    assert time.monotonic() - closed < 10.0
    assert oai.completions.create(model=MODEL, prompt="Next request", max_tokens=3).choices[0].text is not None


def test_a_high_priority_prompt_preempts_a_low_priority_prefill(server):
    finished = {}

    def ask(name, priority, prompt):
        response = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                    "priority": priority})
        finished[name] = (time.monotonic(), response.status_code)
    low = threading.Thread(target=ask, args=("low", 10, fresh_text("low", 260)))  # seconds of prefill
    low.start()
    assert wait_for(lambda: prefilling(server), 30)  # the low-priority prompt holds the worker
    high = threading.Thread(target=ask, args=("high", 0, "Quick: name a fruit."))
    high.start()
    high.join(60)
    low.join(60)
    assert finished["high"][1] == 200 and finished["low"][1] == 200  # the preempted one is redone, not failed
    assert finished["high"][0] < finished["low"][0]


def test_low_priority_decode_yields_while_a_high_priority_prompt_is_prefilled(server):
    """On the CPU, decode of a priority-10 stream pauses while a priority-0 prompt is in prefill."""
    before = server.metric("edge:decode_yielded_seconds")
    with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "Once upon a time, in a small village by the sea,",
                            "max_tokens": 300, "temperature": 0, "stream": True, "priority": 10}, timeout=60) as response:
        lines = response.iter_lines()
        assert any(next(lines).startswith("data: {") for _ in range(4))  # the background stream is decoding
        high = post(server, "/v1/completions", {"model": MODEL, "prompt": fresh_text("high", 130), "max_tokens": 1,
                                                "priority": 0})
        assert high.status_code == 200
    assert wait_for(lambda: server.metric("edge:decode_yielded_seconds") - before > 0.2, 3)


def test_a_shared_prompt_prefix_comes_from_the_prompt_cache(server, oai):
    """...of the worker (its prefill is skipped) and of the decode pool (its import is skipped)."""
    def hits():
        found = {}
        for where in ("worker", "pool"):
            try:
                found[where] = server.metric("vllm:prefix_cache_hits_total", where=where)
            except KeyError:  # no sample yet
                found[where] = 0.0
        return found

    before = hits()
    for question in ("What is the first point?", "What is the second point?"):
        # ignore_eos: this prompt's first token is an end of text, and only a request that decodes reaches the pool
        oai.completions.create(model=MODEL, prompt=LONG_TEXT + question, max_tokens=2, temperature=0,
                               extra_body={"ignore_eos": True})
    # the worker's report may come after the answer (the engine's first token can overtake it), and the engine's
    # stats every half second
    assert wait_for(lambda: hits()["worker"] - before["worker"] > 150, 5)  # LONG_TEXT is ~200 tokens
    assert wait_for(lambda: hits()["pool"] - before["pool"] >= 160, 5)  # its full 16-token blocks, but the last


def test_one_keys_cached_prompt_is_never_reused_for_another_key(server, oai):
    """The prompt caches are per API key: a prompt another key sent first is prefilled in full (so its timing
    tells nothing), while the same key's own prompt still hits. prefill-0 takes prompts one at a time, so once
    the third prompt's hits are counted, the second's are too."""
    def worker_hits():
        try:
            return server.metric("vllm:prefix_cache_hits_total", where="worker")
        except KeyError:
            return 0.0

    text = fresh_text("tenant", 120)  # ~360 tokens no other test sends
    oai.completions.create(model=MODEL, prompt=text + " First?", max_tokens=1, temperature=0)
    assert wait_for(lambda: worker_hits() is not None, 5)
    before = worker_hits()
    other = post(server, "/v1/completions", {"model": MODEL, "prompt": text + " Second?", "max_tokens": 1,
                                             "temperature": 0}, key=OTHER_KEY)
    assert other.status_code == 200, other.text
    oai.completions.create(model=MODEL, prompt=text + " Third?", max_tokens=1, temperature=0)
    # the third found the first's prompt (the worker's counters reach /metrics with its status reports: seconds on a
    # loaded machine)
    assert wait_for(lambda: worker_hits() - before >= 300, 30), f"{worker_hits() - before} hits since the first"
    assert worker_hits() - before < 600  # and the other key's prompt found nothing


def prompt_in_prefill(server, tag: str) -> tuple[int, list, threading.Thread]:
    """Start a ~800-token prompt (seconds of prefill on two cores) and return once prefill-0 holds it:
    the worker's pid, the list its response will land in, and the thread to join."""
    worker_pid = server.health()["processes"]["prefill-0"]["pid"]
    results = []
    thread = threading.Thread(target=lambda: results.append(post(server, "/v1/completions", {
        "model": MODEL, "prompt": fresh_text(tag, 260), "max_tokens": 4})))
    thread.start()
    assert wait_for(lambda: prefilling(server), 30)
    return worker_pid, results, thread


def test_killing_a_prefill_worker_fails_its_request_and_it_comes_back(server, oai):
    worker_pid, results, thread = prompt_in_prefill(server, "killed")
    os.kill(worker_pid, signal.SIGKILL)
    thread.join(60)
    assert results[0].status_code == 503 and results[0].json()["error"]["code"] == "prefill_worker_died"
    assert wait_for(lambda: server.health()["components"]["prefill-0"] == "ready", 60, 0.5)
    assert server.health()["processes"]["prefill-0"]["restarts"] >= 1
    # ignore_eos: a sampled answer may end early (an end of text among its first tokens)
    assert oai.completions.create(model=MODEL, prompt="Back again", max_tokens=3,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 3


def test_a_frozen_prefill_worker_is_declared_stuck_and_its_prompt_is_redone(server, oai):
    worker_pid, results, thread = prompt_in_prefill(server, "frozen")
    os.kill(worker_pid, signal.SIGSTOP)  # alive but silent: no heartbeats
    try:
        thread.join(120)
    finally:
        if pid_alive(worker_pid):
            os.kill(worker_pid, signal.SIGCONT)
    assert results and results[0].status_code == 200, results and results[0].text  # redone on the restarted worker
    assert not pid_alive(worker_pid)  # killed, not left frozen
    health = server.health()
    assert health["prefill"]["prefill-0"]["stuck_count"] >= 1 and health["processes"]["prefill-0"]["pid"] != worker_pid
    assert wait_for(lambda: server.health()["components"]["prefill-0"] == "ready", 60, 0.5)


def _run_dir(server: ServerProcess) -> Path:
    """The private socket dir of this launch, as its log names it."""
    match = re.search(r"unix:(/\S+?)/prefill-0\.sock", server.log_path.read_text())
    return Path(match.group(1))


def test_sigterm_ends_streams_explicitly_and_leaves_no_process(tmp_path):
    with ServerProcess(CONFIG, tmp_path, POLICY).start() as server:  # stopped whatever fails inside
        run_dir = _run_dir(server)
        assert run_dir.stat().st_mode & 0o777 == 0o700
        children = server.child_pids()
        assert len(children) == 2
        lines: list[str] = []

        def read_stream():
            with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": MODEL, "prompt": "Once upon a time, in a small village,", "max_tokens": 500,
                                    "temperature": 0, "stream": True},
                              timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
        reader = threading.Thread(target=read_stream)
        reader.start()
        assert wait_for(lambda: len(lines) > 4, 30)
        with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as keep_alive:
            assert keep_alive.get("/v1/models").status_code == 200  # the connection is now idle, kept alive
            server.process.send_signal(signal.SIGTERM)
            late = keep_alive.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert server.stop() == 0
        reader.join(30)
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert '"code": "aborted"' in data[-2]  # 500 tokens take far longer than the 1 s grace period
    assert wait_for(lambda: not any(pid_alive(pid) for pid in children), 10)
    assert not run_dir.exists()  # the socket dir went with the service


def _closed_within(sock, seconds: float) -> float | None:
    """Seconds until the server closed the connection (reading EOF), or None if it stayed open."""
    sock.settimeout(seconds)
    started = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except (TimeoutError, OSError):
        return None
    return time.monotonic() - started


def test_slow_headers_and_slow_body_are_cut_off(server):
    import socket
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        assert _closed_within(sock, 6) is not None
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        sock.settimeout(6)
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply
