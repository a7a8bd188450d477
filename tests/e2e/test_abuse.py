"""Tried as an attacker would, against the real service on the embedded model (one server for the module):
explosive structured-output schemas whose clients leave do not stall another client's stream or a later
structured request; another key's cached prompts cannot be timed, nor its compiled schemas found;
a non-admin key reads neither the status page nor its JSON, and no operator surface
(/metrics, /health, the status page) carries a prompt, a key or a tenant's text; a frozen decode engine shows in
/health within seconds and its requests end with a 503; SIGTERM still exits within the drain time (the last
test: it stops the server)."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
COMPILE_LIMIT_S = 5.0
GRACE_S = 2.0
ATTACKERS = [f"attacker-{i}" for i in range(6)]
VICTIM, OTHER, ADMIN = "victim-key", "other-key", "admin-key"
ENGINE_HEARTBEAT_S = 2.0
CONFIG = f"""
kv_cache_tokens = 8192
max_model_len = 1200
grammar_compile_timeout_s = {COMPILE_LIMIT_S}
grammar_compile_queue_per_key = 1
engine_heartbeat_timeout_s = {ENGINE_HEARTBEAT_S}
[limits]
shutdown_grace_s = {GRACE_S}
"""
TENANT_HEADER, TENANT = "X-Tenant", "tenant-name-4f1d"
POLICY = "version = 1\ndefault_class = \"standard\"\n[classes.standard]\npriority = 0\n" + \
    f'[tenants]\nheader = "{TENANT_HEADER}"\n' + "".join(
    f'[[keys]]\nkey = "{key}"\nclass = "standard"\n' for key in [*ATTACKERS, VICTIM, OTHER]) + \
    f'[[keys]]\nkey = "{ADMIN}"\nclass = "standard"\nadmin = true\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(CONFIG, tmp_path_factory.mktemp("abuse"), POLICY).start()
    yield server
    server.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def explosive(variant: int) -> dict:
    """allOf over anyOfs with backtracking patterns: llguidance multiplies the unions out until its size limit,
    about a second of CPU each on the dev machine (variant makes each schema a new one, never a cached outcome)."""
    return {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {
        "type": "string", "pattern": f"^(x+x+)+y{{{i},{i + 30 + variant}}}$"}}} for i in range(9)]}
        for j in range(4)]}


def send_and_leave(base: str, key: str, schema: dict, leave_after_s: float) -> None:
    """A structured request whose client hangs up before its answer (the compile is then stopped)."""
    try:
        httpx.post(base + "/v1/chat/completions", headers=auth(key), timeout=leave_after_s, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    except httpx.TimeoutException:
        pass


def stream_gaps(base: str, tokens: int = 48) -> list[float]:
    """A plain streamed completion; the time between its chunks, from the first."""
    gaps, last = [], None
    with httpx.stream("POST", base + "/v1/completions", headers=auth(VICTIM), timeout=60, json={
            "model": MODEL, "prompt": "Write a long story about the sea.", "max_tokens": tokens,
            "min_tokens": tokens, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


def compiles(server) -> dict:
    """The gateway's compile processes: running, waiting, stopped so far (/health)."""
    return server.health()["structured_outputs"]


def stopped_for(server, reason: str) -> int:
    """How many compile processes the gateway has stopped for `reason` (its log)."""
    return server.log_path.read_text().count(f"a compile process was stopped ({reason}")


def structured(base: str, schema: dict, key: str = VICTIM) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", headers=auth(key), timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 64,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})


def test_explosive_schemas_whose_clients_leave_stall_nobody(server):
    assert wait_for(lambda: compiles(server)["idle"] == 2, 60)  # started with the server
    # the structured path once before (a worker and the engine start their compile processes on first use)
    warm = structured(server.base, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert warm.status_code == 200, warm.text
    baseline = max(stream_gaps(server.base))
    # a one-field request like the victim's below (a schema of its own: not a cached outcome), with nobody attacking:
    # how long such a request takes on this machine as loaded as it is now
    started = time.perf_counter()
    alone = structured(server.base, {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
                                     "required": ["colour"]})
    alone_s = time.perf_counter() - started
    assert alone.status_code == 200, alone.text
    left_before, limit_before = stopped_for(server, "its requester went away"), stopped_for(server, "past the limit")
    gaps: list[float] = []
    streamer = threading.Thread(target=lambda: gaps.extend(stream_gaps(server.base, 96)))
    streamer.start()
    attackers = [threading.Thread(target=send_and_leave, args=(server.base, key, explosive(i), 0.5))
                 for i, key in enumerate(ATTACKERS)]
    for thread in attackers:
        thread.start()
    for thread in attackers:
        thread.join()
    started = time.perf_counter()
    answer = structured(server.base, {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                                      "required": ["name"]})
    answered_s = time.perf_counter() - started
    streamer.join()
    print(f"worst token gap {max(gaps):.3f} s (alone {baseline:.3f} s); one-field request answered in "
          f"{answered_s:.2f} s (alone {alone_s:.2f} s); compile processes: {compiles(server)}")
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"])["name"], str)
    # The attack compiles were stopped as their clients left, none held its process to its limit (what would stall
    # the victim for seconds): told by the gateway's log, not by time
    assert stopped_for(server, "its requester went away") > left_before, compiles(server)
    assert stopped_for(server, "past the limit") == limit_before, compiles(server)
    # Not stalled: the same request alone, slowed alike by a busy machine, plus the replacement of the processes
    # stopped (imports and the vocabulary: seconds on a busy machine). An absolute 5 s was missed at 4.2 s (1.2 s
    # alone) with other tests beside it.
    assert answered_s < alone_s + 8.0, (answered_s, alone_s)
    # compiles run niced: a stream's worst gap stays near its own alone (measured as loaded as now); 1 s quiet
    assert max(gaps) < max(1.0, 3 * baseline), (max(gaps), baseline)


def test_one_key_gets_one_compile_at_a_time(server):
    """One compiling, one waiting its turn (grammar_compile_queue_per_key = 1), the third refused at once."""
    results: list[tuple[float, httpx.Response]] = []

    def send(variant: int) -> None:
        started = time.perf_counter()
        response = httpx.post(server.base + "/v1/chat/completions", headers=auth(ATTACKERS[0]), timeout=30,
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "x", "schema": explosive(100 + variant)}}})
        results.append((time.perf_counter() - started, response))
    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = sorted((r.status_code, r.json()["error"]["code"]) for _, r in results)
    assert codes.count((429, "structured_output_compiles_per_key")) == 1, codes
    assert codes.count((400, "structured_output_too_complex")) == 2, codes  # the waiting one had its turn
    refused_s = [s for s, r in results if r.status_code == 429]
    assert refused_s[0] < 2.5, refused_s  # at once: waiting for a turn would take the 5 s compile limit


def ttft(base: str, key: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens the worker took from its prompt cache). 8 tokens: the
    worker's report of its cache hits comes before the last one (the first may overtake it)."""
    started, first, cached = time.perf_counter(), None, None
    with httpx.stream("POST", base + "/v1/completions", headers=auth(key), timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def test_another_keys_cached_prompts_cannot_be_timed(server):
    """Rounds of: the victim sends a prompt; the attacker (another key) probes that very prompt and a fresh one
    of the same length; the victim sends its prompt again. The attacker's probes find nothing in the caches
    (cached_tokens 0: the deterministic guarantee), so its best threshold on the time to first token tells them
    apart no better than chance, while the victim's own repeat is a hit.
    The bar on the attacker's ROC AUC is 0.75, not 0.6: with 12 probes a class, a perfectly private server's AUC
    is above 0.6 one time in five by chance alone (its spread is 0.12); a leak shows as an AUC near 1."""
    hits, misses, victim_hits, victim_misses, attacker_cached, victim_cached = [], [], [], [], [], []
    for i in range(12):
        secret, fresh = " ".join(f"sec{i}w{j}" for j in range(100)), " ".join(f"new{i}w{j}" for j in range(100))
        first, _ = ttft(server.base, VICTIM, secret)
        victim_misses.append(first)
        for probe, times in ((secret, hits), (fresh, misses)) if i % 2 else ((fresh, misses), (secret, hits)):
            first, cached = ttft(server.base, OTHER, probe)
            times.append(first)
            attacker_cached.append(cached)
        first, cached = ttft(server.base, VICTIM, secret)
        victim_hits.append(first)
        victim_cached.append(cached)
    auc = sum((h < m) + 0.5 * (h == m) for h in hits for m in misses) / (len(hits) * len(misses))
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    print(f"attacker: AUC {auc:.2f}, median TTFT {median(hits):.3f} s on the victim's prompts, "
          f"{median(misses):.3f} s on fresh ones; victim: {median(victim_hits):.3f} s on its repeats, "
          f"{median(victim_misses):.3f} s the first time; cached tokens: attacker {attacker_cached}, "
          f"victim {victim_cached}")
    # the per-key hit counts agree: the other key's probes of the victim's prompts found nothing of them (a few
    # leading tokens its own earlier probes share are its own hits), the victim's repeats found nearly all
    assert max(attacker_cached) < 16
    # the victim's repeats hit (the prompts are ~490 tokens); in one run the last 2 of 12 reported 0 cached tokens
    # (the worker's prompt cache had let them go, or its report came after the last token): most, not all
    assert sum(cached > 200 for cached in victim_cached) >= 9, victim_cached
    assert median(victim_hits) <= 0.5 * median(misses)
    assert auc <= 0.75


def test_another_keys_compiled_schema_is_compiled_again(server):
    """The victim's schema sent by another key is compiled again (a miss), never answered from the victim's outcome;
    each key's repeat is a hit. Told by /health's count of the gateway's compiles, not by time."""
    schema = {"type": "object", "properties": {"payroll_7f3a": {"type": "integer"}}, "required": ["payroll_7f3a"]}
    counts = [compiles(server)["compiles"]]
    for key in (VICTIM, OTHER, VICTIM, OTHER):
        answer = structured(server.base, schema, key)
        assert answer.status_code == 200, answer.text
        counts.append(compiles(server)["compiles"])
    assert [count - counts[0] for count in counts] == [0, 1, 2, 2, 2]


def test_a_non_admin_key_reads_no_status_and_no_surface_carries_a_prompt_key_or_tenant(server):
    secret_prompt = "zebra-quokka-7731 is the password of the payroll system"
    answer = httpx.post(server.base + "/v1/completions", timeout=60,
                        headers={**auth(OTHER), TENANT_HEADER: TENANT},
                        json={"model": MODEL, "prompt": secret_prompt, "max_tokens": 4, "user": "user-name-9c2e"})
    assert answer.status_code == 200
    for path in ("/status", "/status.json"):
        refused = httpx.get(server.base + path, headers=auth(OTHER), timeout=5)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_admin"
        assert httpx.get(server.base + path, timeout=5).status_code == 401
        assert httpx.get(server.base + path, cookies={"edge_status_session": OTHER}, timeout=5).status_code == 401
    with httpx.Client(base_url=server.base, timeout=5) as admin:  # the admin's view, through a session
        assert admin.post("/status/login", data={"key": ADMIN}).status_code in (200, 303)
        page = admin.get("/status").text
        status = admin.get("/status.json").text
    surfaces = {"metrics": httpx.get(server.base + "/metrics", timeout=5).text,
                "health": httpx.get(server.base + "/health", timeout=5).text, "page": page, "status.json": status}
    secrets = ["zebra-quokka", "payroll", TENANT, "user-name-9c2e", *ATTACKERS, VICTIM, OTHER, ADMIN]
    found = {(name, secret) for name, text in surfaces.items() for secret in secrets if secret in text}
    assert found == set()
    assert json.loads(status)["processes"]  # the admin's JSON is there and has content


def test_a_frozen_engine_shows_in_health_within_seconds_and_its_requests_end_with_a_503(server):
    engine = server.health()["processes"]["decode_engine"]["pid"]
    result: list[httpx.Response] = []
    long = threading.Thread(target=lambda: result.append(httpx.post(
        server.base + "/v1/completions", headers=auth(VICTIM), timeout=60, json={
            "model": MODEL, "prompt": "Tell a very long story.", "max_tokens": 400, "min_tokens": 400})))
    long.start()
    assert wait_for(lambda: (server.health().get("engine") or {}).get("num_running", 0) >= 1, 30)
    os.kill(engine, signal.SIGSTOP)
    try:
        stopped = time.perf_counter()
        assert wait_for(lambda: server.health()["components"]["decode_engine"] == "unresponsive", 10)
        shown_s = time.perf_counter() - stopped
        long.join(10)
        ended_s = time.perf_counter() - stopped
        refused = httpx.post(server.base + "/v1/completions", headers=auth(VICTIM), timeout=10,
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    finally:
        os.kill(engine, signal.SIGCONT)
    print(f"frozen engine: unresponsive in /health after {shown_s:.2f} s, its request ended after {ended_s:.2f} s")
    assert shown_s < ENGINE_HEARTBEAT_S + 2.0 and ended_s < ENGINE_HEARTBEAT_S + 2.0
    assert result and result[0].status_code == 503, result and result[0].text
    assert result[0].json()["error"]["code"] == "engine_unresponsive"
    assert refused.status_code == 503  # not ready while the engine is frozen
    assert wait_for(lambda: server.health()["status"] == "ok", 60)  # it comes back when it runs again
    again = httpx.post(server.base + "/v1/completions", headers=auth(VICTIM), timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert again.status_code == 200, again.text


def test_sigterm_exits_within_the_drain_time_whatever_is_compiling(server):
    """Last: it stops the server."""
    attackers = [threading.Thread(target=send_and_leave, args=(server.base, key, explosive(200 + i), 30))
                 for i, key in enumerate(ATTACKERS)]
    for thread in attackers:
        thread.start()
    assert wait_for(lambda: compiles(server)["compiling"] >= 1, 10)
    started = time.perf_counter()
    code = server.stop(timeout_s=30)
    exit_s = time.perf_counter() - started
    for thread in attackers:
        thread.join()
    print(f"exited {code} in {exit_s:.2f} s after SIGTERM with compiles running (drain time {GRACE_S} s)")
    assert code == 0
    # the drain, the 1 s of 503s before it, and stopping the children (4 s on a loaded box); a compile holding the
    # exit would take its 5 s limit on top
    assert exit_s < GRACE_S + 1.0 + 4.0
