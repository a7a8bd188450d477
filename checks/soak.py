"""Chaos soak (issue 10): the real service for a bounded time under a modest mix of streaming and
non-streaming requests at several priorities, client disconnects, hostile bodies and scheduled faults
(SIGKILL and SIGSTOP of a prefill worker, SIGKILL of the decode engine, a bad policy file). Then it checks
what an operator relies on: every request ended in one outcome its client saw (never a 500, never a hang),
the service settles back to idle and still serves every class, no process's memory grew, and nothing
outlived the service. Prints markdown tables; exit status 1 when a check failed.

    python -m checks.soak --duration 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_process import ServerProcess, wait_for  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEYS = {"interactive": "soak-interactive", "standard": "soak-standard", "batch": "soak-batch"}
REQUEST_TIMEOUT_S = 60
CLIENT_DEADLINE_S = REQUEST_TIMEOUT_S + 10  # a request still unanswered by then hung
FREEZE_S = 8.0  # SIGSTOP this long: well past worker_heartbeat_timeout_s, so the gateway must act
RECOVERY_BOUND_S = 120.0  # an engine restart loads the model on 2 busy cores
SETTLE_BOUND_S = 60.0
RSS_GROWTH_LIMIT = 0.10
SAMPLE_PERIOD_S = 2.0
FAULT_CYCLE = ("kill_worker", "freeze_worker", "bad_policy", "kill_engine")  # Soak's methods
WARMUP_PROMPTS = 10  # long prompts before the soak: the workers' prompt caches overflow, every buffer size is met
VICTIM = "prefill-0"  # the worker that faults hit; prefill-1 serves meanwhile and lives through the whole soak
CONFIG = f"""
prefill_workers = 2
kv_cache_tokens = 8192
max_model_len = 1200
worker_heartbeat_timeout_s = 3
[limits]
prefill_queue_size = 16
request_timeout_s = {REQUEST_TIMEOUT_S}
shutdown_grace_s = 1
"""
POLICY = """
version = 1
default_class = "standard"
[filters]
max_prompt_tokens = 1024
max_output_tokens = 256
blocked_words = ["forbidden", "secret plan"]
[classes.interactive]
priority = 0
[classes.standard]
priority = 5
[classes.batch]
priority = 10
max_concurrent = 2
""" + "".join(f'[[keys]]\nkey = "{key}"\nclass = "{name}"\n' for name, key in KEYS.items())
BAD_POLICY = "version = 1\n[filters\nblocked_words = [\n"  # not TOML: the reload must be refused
QUESTIONS = ["Name three colors.", "What is the capital of France?", "Count to ten.", "Write a haiku about rain.",
             "Why is the sky blue?", "Give me a word that rhymes with cat."]
WORDS = "appliance firewall answer request model token cache stream priority worker engine policy".split()
# the failure outcomes; every other outcome is one the client saw and may act on
FAILURES = ("hang", "http 500", "server fault in stream", "no terminal outcome", "two outcomes",
            "connection dropped", "error body not OpenAI-style")
SERVER_FAULT_CODES = {"decode_failed", "prefill_failed", "internal_error"}  # what a non-stream client gets as 500
EXPECTED_REFUSALS = {429, 503, 504}  # what a valid request may get under faults and load


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


@dataclass
class Fault:
    name: str
    at_s: float
    target: str
    recovered_s: float | None = None  # None: not back within RECOVERY_BOUND_S
    note: str = ""
    broken: str = ""  # a promise the service broke during this fault


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


def fault_plan(duration_s: float) -> list[tuple[float, str]]:
    """(start time, fault): from 10 s on, at most every 30 s, none in the last 15 s (recovery needs time),
    cycling through the kinds. The engine is killed once, in its last slot (earlier ones kill the worker), so
    that the first engine lives long enough for its memory to be compared."""
    spacing = min(30.0, max(8.0, (duration_s - 20) / 4))
    times = [10 + i * spacing for i in range(int((duration_s - 25) // spacing) + 1)] if duration_s >= 25 else []
    kinds = [FAULT_CYCLE[i % len(FAULT_CYCLE)] for i in range(len(times))]
    engine = [i for i, kind in enumerate(kinds) if kind == "kill_engine"]
    kinds = [kind if kind != "kill_engine" or i == engine[-1] else "kill_worker" for i, kind in enumerate(kinds)]
    return list(zip(times, kinds))


class Soak:
    """Runs the load, the faults and the RSS sampler against one started service."""

    def __init__(self, server: ServerProcess, duration_s: float) -> None:
        self.server, self.duration_s = server, duration_s
        self.t0 = time.monotonic()
        self.load_over = threading.Event()
        self.results: list[Result] = []  # list.append is atomic: the client threads share it
        self.faults: list[Fault] = []
        self.samples: dict[tuple[str, int], list[tuple[float, int]]] = {}  # (name, pid) -> [(t, rss)]
        self.procs: dict[int, tuple[str, psutil.Process]] = {}  # every process ever seen
        self.stuck_threads = 0
        self.running_at_kill = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def warm_up(self, seed: int) -> None:
        """Long prompts on two threads (one per worker) before the clock starts, so that memory is compared
        after the first prompts of every size, not across them."""
        def one_thread(rng: random.Random) -> None:
            with httpx.Client(base_url=self.server.base) as client:
                for _ in range(WARMUP_PROMPTS // 2):
                    text = " ".join(f"{rng.choice(WORDS)}{rng.randrange(10 ** 6)}" for _ in range(120))
                    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 32}).encode()
                    self.record(client, Spec("warm-up completion", "/v1/completions", body))
        for thread in [_thread(one_thread, random.Random(seed - i)) for i in (1, 2)]:
            thread.join()
        self.t0 = time.monotonic()

    def run(self, clients: int, seed: int) -> None:
        self.warm_up(seed)
        load = [_thread(self.client_loop, seed + i) for i in range(clients)] + [_thread(self.bad_loop, seed)]
        faults, sampler = _thread(self.fault_loop), _thread(self.sample_loop)
        self.load_over.wait(self.duration_s)  # nobody sets it early: this is the soak's length
        self.load_over.set()
        for thread in load:
            thread.join(CLIENT_DEADLINE_S + 10)  # every request carries its own deadline
        faults.join(RECOVERY_BOUND_S + 30)
        self.stuck_threads = sum(t.is_alive() for t in (*load, faults))
        self.sampling_over = True
        sampler.join(10)

    def record(self, client: httpx.Client, spec: Spec) -> Result:
        at = self.now()
        result = Result(spec.label, spec.bad, at, *send(client, spec))
        self.results.append(result)
        return result

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.server.base) as client:
            while not self.load_over.is_set():
                result = self.record(client, good_spec(rng))
                # a refused client waits as Retry-After asks (capped), as a real one would
                self.load_over.wait(1.0 if result.status in (429, 503) else rng.uniform(0, 0.4))

    def bad_loop(self, seed: int) -> None:
        rng, specs = random.Random(seed + 1000), bad_specs()
        with httpx.Client(base_url=self.server.base) as client:
            for i in range(10 ** 9):
                if self.load_over.wait(rng.uniform(0.5, 2.0)):
                    return
                self.record(client, specs[i % len(specs)])

    def health(self) -> dict | None:
        try:
            return self.server.health()
        except (httpx.HTTPError, ValueError):
            return None

    def pid_of(self, name: str) -> int | None:
        health = self.health() or {}
        return health.get("processes", {}).get(name, {}).get("pid")

    # ---- faults

    def fault_loop(self) -> None:
        for at, kind in fault_plan(self.duration_s):
            if self.load_over.wait(max(0.0, at - self.now())):
                return
            self.faults.append(getattr(self, kind)(VICTIM))

    def kill_worker(self, name: str) -> Fault:
        return self._kill("SIGKILL prefill worker", name)

    def kill_engine(self, _: str) -> Fault:
        # a kill between requests proves little: wait (briefly) until the engine holds decoding requests
        wait_for(lambda: self.metric("vllm:num_requests_running") > 0, 10, 0.1)
        fault = self._kill("SIGKILL decode engine", "decode_engine")
        fault.target += f", {self.running_at_kill:.0f} decoding"
        return fault

    def metric(self, name: str) -> float:
        try:
            return self.server.metric(name)
        except (httpx.HTTPError, KeyError, ValueError):
            return 0.0

    def _kill(self, label: str, name: str) -> Fault:
        pid = self.pid_of(name)
        self.running_at_kill = self.metric("vllm:num_requests_running")
        fault = Fault(label, self.now(), f"{name} (pid {pid})")
        if pid is None:
            fault.note = "not running when the fault was due"
            return fault
        os.kill(pid, signal.SIGKILL)
        fault.recovered_s, _ = self.await_replaced(name, pid, fault.at_s)
        return fault

    def freeze_worker(self, name: str) -> Fault:
        pid = self.pid_of(name)
        fault = Fault(f"SIGSTOP prefill worker {FREEZE_S:.0f} s, then SIGCONT", self.now(), f"{name} (pid {pid})")
        if pid is None:  # psutil.Process(None) would be the soak itself
            fault.note = "not running when the fault was due"
            return fault
        process = psutil.Process(pid)  # psutil checks the pid was not reused before it signals
        process.suspend()
        resume = threading.Timer(FREEZE_S, self._resume, (process, fault))
        resume.start()
        fault.recovered_s, down_s = self.await_replaced(name, pid, fault.at_s)
        resume.join()
        declared = f"declared not ready after {down_s:.1f} s; " if down_s is not None else "never declared stuck; "
        fault.note = declared + fault.note
        return fault

    @staticmethod
    def _resume(process: psutil.Process, fault: Fault) -> None:
        try:
            process.resume()
            fault.note = "SIGCONT reached the frozen process: it had not been killed"
        except psutil.NoSuchProcess:
            fault.note = "killed and restarted; the late SIGCONT found it gone"

    def await_replaced(self, name: str, old_pid: int, since: float) -> tuple[float | None, float | None]:
        """(seconds until a new process serves as `name` and /health is ok, seconds until it showed not ready)."""
        down_s, deadline = None, time.monotonic() + RECOVERY_BOUND_S
        while time.monotonic() < deadline:
            health = self.health() or {}
            ready = health.get("components", {}).get(name) == "ready"
            if down_s is None and health and not ready:
                down_s = self.now() - since
            pid = health.get("processes", {}).get(name, {}).get("pid")
            if ready and pid not in (None, old_pid) and health.get("status") == "ok":
                return self.now() - since, down_s
            time.sleep(0.2)  # polling another process's state: there is no event to await
        return None, down_s

    def bad_policy(self, _: str) -> Fault:
        """Recovery is timed from writing the good file back; the refusal's own delay goes in the note."""
        fault = Fault("bad policy file (invalid TOML), then the good one", self.now(), "gateway (SIGHUP)")
        self.write_policy(BAD_POLICY)
        refused = wait_for(lambda: self._reload_error() is not None, 10, 0.1)
        refused_s, error = self.now() - fault.at_s, (self._reload_error() or "").split(": ", 1)[-1]
        served = probe_classes(self.server)  # the policy in force must keep serving every key meanwhile
        # the load is still running: a class at its concurrency limit answers 429, which proves its key and
        # class are still known; a lost policy would answer 401 (keys gone) or let everything through
        if any(outcome not in ("completed", "429 concurrency_limit") for outcome in served.values()):
            fault.broken = "with the bad file in place: " + ", ".join(f"{k}: {v}" for k, v in served.items())
        self.write_policy(POLICY)
        good_at = self.now()
        back = wait_for(lambda: self._reload_error() is None and (self.health() or {}).get("status") == "ok", 10, 0.1)
        fault.recovered_s = self.now() - good_at if back and refused else None
        fault.note = f"refused in {refused_s:.1f} s ({error[:80]})" if refused else "the bad file was NOT refused"
        fault.note += "" if fault.broken else "; every key was served meanwhile"
        return fault

    def write_policy(self, text: str) -> None:
        """Replace the file in one step (a half-written good file would be refused), then SIGHUP."""
        tmp = self.server.policy.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.server.policy)
        os.kill(self.server.process.pid, signal.SIGHUP)

    def _reload_error(self) -> str | None:
        return ((self.health() or {}).get("policy") or {}).get("last_reload_error")

    # ---- memory and processes

    sampling_over = False

    def sample_loop(self) -> None:
        while not self.sampling_over:
            self.sample()
            time.sleep(SAMPLE_PERIOD_S)  # a fixed sampling period, not a wait for an event

    def sample(self) -> None:
        health = self.health() or {}
        pids = {"gateway": self.server.process.pid}
        pids.update({name: p["pid"] for name, p in health.get("processes", {}).items() if p.get("pid")})
        try:  # anything else the service started (grandchildren included) must go when it stops, too
            kids = psutil.Process(self.server.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        named = set(pids.values())
        pids.update({f"descendant {k.pid}": k.pid for k in kids if k.pid not in named})
        for name, pid in pids.items():
            try:
                process = self.procs.setdefault(pid, (name, psutil.Process(pid)))[1]
                rss = process.memory_info().rss
            except psutil.NoSuchProcess:  # killed by a fault just now
                continue
            if not rss:  # a zombie, not reaped yet: it has exited
                continue
            self.samples.setdefault((name, pid), []).append((self.now(), rss))


def _thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


# ---- after the load: settle, probe, stop, check


def settle(server: ServerProcess) -> tuple[float | None, dict]:
    """Seconds until /health is ok and the engine is idle with no KV blocks held (None: not within the bound)."""
    names = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "kv_blocks_used": "edge:kv_cache_blocks_used"}
    seen: dict = {}

    def idle() -> bool:
        try:
            seen.update({k: server.metric(v) for k, v in names.items()}, status=server.health()["status"])
        except (httpx.HTTPError, KeyError, ValueError):
            return False
        return seen["status"] == "ok" and not any(seen[k] for k in names)
    started = time.monotonic()
    return (time.monotonic() - started if wait_for(idle, SETTLE_BOUND_S, 0.5) else None), seen


def probe_classes(server: ServerProcess) -> dict[str, str]:
    """One small request per class after the soak: a leaked concurrency slot or a lost key shows here."""
    answers = {}
    with httpx.Client(base_url=server.base) as client:
        for name, key in KEYS.items():
            body = json.dumps({"model": MODEL, "prompt": "Say hello.", "max_tokens": 4}).encode()
            outcome, status, code, _ = send(client, Spec(f"probe {name}", "/v1/completions", body, key=key))
            answers[name] = outcome if outcome != "error" else f"{status} {code}"
    return answers


def leftovers(procs: dict[int, tuple[str, psutil.Process]]) -> list[str]:
    """Processes seen during the soak that are still running (a zombie has exited: not counted)."""
    def alive(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    wait_for(lambda: not any(alive(p) for _, p in procs.values()), 15, 0.2)
    return [f"{name} (pid {p.pid})" for name, p in procs.values() if alive(p)]


@dataclass
class RssRow:
    name: str
    pid: int
    start_s: float | None
    start_mib: float | None
    end_s: float
    end_mib: float
    note: str = ""

    @property
    def growth(self) -> float | None:
        return None if self.start_mib is None else self.end_mib / self.start_mib - 1


def rss_rows(samples: dict, warmup_s: float, end_s: float) -> list[RssRow]:
    """Each process that ran from the start: from the highest RSS of its first `warmup_s` (the soak's first
    minute) to its last sample, the soak's end or just before a fault killed it. The high-water mark, not one
    sample: the allocator moves RSS in steps of tens of MiB as handoff buffers come and go, and a leak still
    shows as growth beyond it. A process a fault started is listed, not compared: it missed the warm-up, so
    its first prompts grow it; one killed before 1.5 windows is too short-lived to compare."""
    rows, first_t = [], min((series[0][0] for series in samples.values()), default=0.0)
    for (name, pid), series in sorted(samples.items(), key=lambda item: item[1][0][0]):
        born, (last_t, last_rss) = series[0][0], series[-1]
        base = max(((rss, t) for t, rss in series if t <= born + warmup_s), default=None)
        row = RssRow(name, pid, None, None, last_t, last_rss / 2 ** 20)
        if born > first_t + SAMPLE_PERIOD_S + 1:
            row.note = f"started by a fault at {born:.0f} s: not compared"
        elif last_t - born < 1.5 * warmup_s:
            row.note = f"lived {born:.0f}-{last_t:.0f} s: too short to compare"
        else:
            row.start_s, row.start_mib = base[1], base[0] / 2 ** 20
        if last_t < end_s - 5:
            row.note = (row.note + "; " if row.note else "") + "killed by a fault"
        rows.append(row)
    return rows


@dataclass
class Report:
    duration_s: float
    results: list[Result]
    faults: list[Fault]
    rss: list[RssRow]
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    log_path: Path | None = None

    @property
    def failures(self) -> list[str]:
        return [f"{name}: {detail}" for name, ok, detail in self.checks if not ok]

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, bool(ok), detail))

    def markdown(self) -> str:
        return "\n\n".join((self._outcomes(), self._faults(), self._rss(), self._checks()))

    def _outcomes(self) -> str:
        good = Counter(r.row for r in self.results if not r.bad)
        bad = Counter(r.row for r in self.results if r.bad)
        lines = [f"Requests by outcome ({len(self.results)} in {self.duration_s:.0f} s)", "",
                 "| outcome | valid requests | bad bodies |", "|---|---:|---:|"]
        for row in sorted(set(good) | set(bad), key=_outcome_order):
            lines.append(f"| {row} | {good.get(row, 0)} | {bad.get(row, 0)} |")
        return "\n".join(lines)

    def _faults(self) -> str:
        lines = ["Faults injected", "", "| at | fault | target | recovered after | note |", "|---:|---|---|---:|---|"]
        for f in self.faults:
            back = f"{f.recovered_s:.1f} s" if f.recovered_s is not None else "NOT RECOVERED"
            note = f"{f.note}; **BROKEN**: {f.broken}" if f.broken else f.note
            lines.append(f"| {f.at_s:.0f} s | {f.name} | {f.target} | {back} | {note} |")
        return "\n".join(lines)

    def _rss(self) -> str:
        lines = ["RSS per process (start: the peak of its first window; end: its last sample)", "",
                 "| process | pid | peak at | last sample | start MiB | end MiB | growth | note |",
                 "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in self.rss:
            start = f"{r.start_s:.0f} s" if r.start_s is not None else "-"
            then = f"{r.start_mib:.0f}" if r.start_mib is not None else "-"
            growth = f"{r.growth:+.1%}" if r.growth is not None else "-"
            lines.append(f"| {r.name} | {r.pid} | {start} | {r.end_s:.0f} s | {then} | {r.end_mib:.0f} | {growth} "
                         f"| {r.note} |")
        return "\n".join(lines)

    def _checks(self) -> str:
        lines = ["Checks", "", "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {name} | {'ok' if ok else '**FAILED**'} | {detail} |" for name, ok, detail in self.checks]
        return "\n".join(lines)


def _outcome_order(row: str) -> tuple:
    first = row.split()[0]
    rank = {"completed": 0, "client": 1}.get(first, 3 if first.isdigit() else 2 if first == "stream" else 4)
    return rank, row


def judge_requests(report: Report, stuck_threads: int) -> None:
    failed = [r for r in report.results if r.outcome in FAILURES]
    report.check("every request ended in one outcome its client saw", not failed and not stuck_threads,
                 _examples(failed) or f"{len(report.results)} requests; {stuck_threads} client threads stuck")
    hung = [r for r in failed if r.outcome == "hang"]
    report.check(f"no request hung past {CLIENT_DEADLINE_S} s", not hung, _examples(hung))
    fives = [r for r in failed if r.outcome in ("http 500", "server fault in stream")]
    report.check("no 500 (nor its equivalent error event in a stream)", not fives, _examples(fives))
    bad = [r for r in report.results if r.bad]
    unrefused = [r for r in bad if not (r.outcome == "error" and 400 <= r.status < 500)]
    report.check("every bad body got a 4xx with an OpenAI-style error", bad and not unrefused,
                 _examples(unrefused) or f"{len(bad)} bad bodies")
    valid = [r for r in report.results if not r.bad]
    odd = [r for r in valid if r.outcome == "error" and r.status and r.status not in EXPECTED_REFUSALS]
    report.check("valid requests were refused only for load or faults (429/503/504)", not odd, _examples(odd))
    completed = sum(r.outcome == "completed" for r in valid)
    report.check("the service did real work", completed > 0, f"{completed} of {len(valid)} valid requests completed")


def judge_faults(report: Report) -> None:
    lost = [f"{f.name} at {f.at_s:.0f} s: {f.broken or 'not recovered'}" for f in report.faults
            if f.recovered_s is None or f.broken]
    report.check("every fault was recovered from, with no promise broken meanwhile", report.faults and not lost,
                 "; ".join(lost) or f"{len(report.faults)} faults")
    frozen = [f for f in report.faults if f.name.startswith("SIGSTOP")]
    report.check("a frozen worker is declared stuck and replaced", all("killed and restarted" in f.note for f in frozen),
                 "; ".join(f.note for f in frozen) or "no freeze injected")


def judge_service(report: Report, settled: tuple, probes: dict, exit_code, left: list[str], seen: int) -> None:
    settle_s, metrics = settled
    report.check("the service settled: running = waiting = 0, no KV blocks used", settle_s is not None,
                 f"after {settle_s:.1f} s" if settle_s is not None else f"still {metrics} after {SETTLE_BOUND_S:.0f} s")
    report.check("every class is still served after the soak", all(v == "completed" for v in probes.values()),
                 ", ".join(f"{k}: {v}" for k, v in probes.items()))
    grown = [f"{r.name} {r.growth:+.1%}" for r in report.rss if r.growth is not None and r.growth >= RSS_GROWTH_LIMIT]
    report.check(f"no process's RSS grew by {RSS_GROWTH_LIMIT:.0%} or more", not grown, ", ".join(grown) or
                 f"{sum(r.growth is not None for r in report.rss)} processes compared")
    report.check("the gateway exited 0 on SIGTERM", exit_code == 0, f"exit code {exit_code}")
    report.check("no process outlived the service", not left, ", ".join(left) or f"{seen} processes seen")


def _examples(results: list[Result], n: int = 3) -> str:
    if not results:
        return ""
    shown = "; ".join(f"{r.label} sent at {r.at_s:.0f} s: {r.row} {r.detail}".strip() for r in results[:n])
    return f"{len(results)}: {shown}"


def run_soak(duration_s: float, workdir: Path, clients: int = 3, seed: int = 0,
             warmup_s: float | None = None) -> Report:
    """Start the service, soak it, stop it, and judge. warmup_s: RSS is compared from this long after each
    process is first seen (default: the first minute, or a third of a shorter soak)."""
    server = ServerProcess(CONFIG, workdir, POLICY).start()
    exit_code = None
    try:
        soak = Soak(server, duration_s)
        soak.run(clients, seed)
        settled = settle(server)
        probes = probe_classes(server)
        soak.sample()  # the end point of every RSS comparison: after the load, settled
        end_s = soak.now()
    finally:
        try:
            exit_code = server.stop()
        except Exception as err:  # noqa: BLE001  (a gateway that would not stop is a finding, not a crash)
            exit_code = f"did not stop: {err!r}"
    rss = rss_rows(soak.samples, warmup_s if warmup_s is not None else min(60.0, duration_s / 3), end_s)
    report = Report(duration_s, soak.results, soak.faults, rss, log_path=server.log_path)
    (workdir / "rss.json").write_text(json.dumps([{"name": name, "pid": pid, "samples": series}
                                                  for (name, pid), series in soak.samples.items()]))
    judge_requests(report, soak.stuck_threads)
    judge_faults(report)
    judge_service(report, settled, probes, exit_code, leftovers(soak.procs), len(soak.procs))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Chaos soak of the real service; prints markdown tables.")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--clients", type=int, default=3, help="client threads sending valid requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="", help="where the config, policy and service log go")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="edge-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = run_soak(args.duration, workdir, args.clients, args.seed)
    print(f"`python -m checks.soak --duration {args.duration:g}` (service log: {report.log_path})\n")
    print(report.markdown())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
