"""End to end: decisions measured while serving, and the start-up they no longer hold up.

Two servers, one after the other:
- `speculative = "ngram"`, started while a CPU hog spins on every core and the hog stopped once it is ready: the
  start-up probe of speculation's cost model runs on a busy machine and keeps to its budget, and within the first
  minute of serving speculation drafts and accepts on a prompt the model quotes (the live cost model corrects the
  probe);
- `deterministic = true` (the default's weight plan may change precision with the batch size, so only it promises
  this), started on the machine as it is: a seeded n=3 request gives the same three choices alone and while other
  streams decode beside it; and, on a quiet machine, it is ready within READY_S with the model cached.
Each start's time from process start to /health ready is printed (run with -s to see it).
"""

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import openai
import pytest

from decode_gpu.runner.model_runner import PROBE_BUDGET_S
from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
CONFIG = "kv_cache_tokens = 8192\nmax_model_len = 1200\n[limits]\nshutdown_grace_s = 1.0\n"
READY_S = 10.0  # edge serve with the model cached, process start to /health ready
FIRST_MINUTE_S = 60.0
CODE = ("def normalize(scores):\n    lowest = min(scores)\n    highest = max(scores)\n    span = highest - lowest\n"
        "    if span == 0:\n        return [0.0 for score in scores]\n"
        "    return [(score - lowest) / span for score in scores]\n")
QUOTE = [{"role": "user", "content": f"Here is a Python function:\n```python\n{CODE}```\nReturn the whole function "
          "again with the variable `span` renamed to `width`. Reply with the code only."}]


def cpu_hog() -> list[subprocess.Popen]:
    """One process spinning on each core."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def started(config: str, workdir) -> ServerProcess:
    """A server, with the seconds from its process start to /health ready (ready_s) and the machine's 1-minute load
    average just before (load)."""
    server = ServerProcess(config, workdir)
    server.load = os.getloadavg()[0]
    began = time.monotonic()
    server.start()
    server.ready_s = time.monotonic() - began
    return server


def spec_counters(server: ServerProcess) -> tuple[int, int]:
    engine = server.health()["engine"] or {}
    return engine.get("num_spec_drafts", 0), engine.get("num_spec_accepted_tokens", 0)


def forget_cost_models() -> None:
    """The embedded model's recorded cost models go: the probe under test runs only where no quiet start recorded one,
    and a quiet start earlier in the same test run may have (contracts/cpu_window.py)."""
    from contracts.cache import converted_dir
    from contracts.identity import read_gguf_identity
    from prefill_cpu.embedded_model import embedded_model_path
    shutil.rmtree(converted_dir(read_gguf_identity(embedded_model_path())) / "step_costs", ignore_errors=True)


@pytest.fixture(scope="class")
def hogged(tmp_path_factory):
    forget_cost_models()
    hog = cpu_hog()
    try:
        server = started('speculative = "ngram"\n' + CONFIG, tmp_path_factory.mktemp("hogged"))
    finally:
        for process in hog:
            process.kill()
            process.wait()
    print(f"\nedge serve --speculative ngram under a hog on {len(hog)} cores (load {server.load:.1f} before): "
          f"ready in {server.ready_s:.1f} s")
    yield server
    server.stop()


@pytest.fixture(scope="class")
def deterministic(tmp_path_factory):
    server = started("deterministic = true\n" + CONFIG, tmp_path_factory.mktemp("deterministic"))
    print(f"\nedge serve (deterministic, no speculation; load {server.load:.1f} before): ready in "
          f"{server.ready_s:.1f} s")
    yield server
    server.stop()


class TestSpeculationStartedUnderAHog:
    def test_the_start_up_probe_keeps_to_its_budget_under_the_hog(self, hogged):
        probe = re.search(r"speculative decoding's cost model, ms by rows fed .* measured in ([0-9.]+) s",
                          hogged.log_path.read_text())
        assert probe is not None  # a hogged start is not quiet: it probes rather than reuse a record
        print(f"the probe took {probe.group(1)} s")
        # the budget, and the forwards it had started when it ran out (the fewest rows of each kind, each warmed up)
        assert float(probe.group(1)) <= 3 * PROBE_BUDGET_S

    def test_speculation_drafts_and_accepts_within_the_first_minute(self, hogged):
        client = openai.OpenAI(base_url=hogged.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        serving = time.monotonic()
        answers = []
        while time.monotonic() - serving < FIRST_MINUTE_S:
            chat = client.chat.completions.create(model=MODEL, messages=QUOTE, max_tokens=96, temperature=0)
            answers.append(chat.choices[0].message.content)
            drafts, accepted = spec_counters(hogged)
            if drafts and accepted:
                break
        print(f"drafts {drafts}, accepted tokens {accepted} after {time.monotonic() - serving:.1f} s of serving "
              f"({len(answers)} answers)")
        assert "def normalize(scores):" in answers[0]  # the model quotes the function
        assert drafts > 0 and accepted > 0, f"no draft accepted in the first minute:\n{hogged.log_path.read_text()}"


class TestDeterministicUnderLoad:
    def test_ready_within_ten_seconds_on_a_quiet_machine(self, deterministic):
        if deterministic.load >= (os.cpu_count() or 1) / 2:  # as the engine judges a quiet start
            pytest.skip(f"the machine was busy (load {deterministic.load:.1f} on {os.cpu_count()} cores): ready in "
                        f"{deterministic.ready_s:.1f} s")
        assert deterministic.ready_s <= READY_S

    def test_seeded_choices_are_the_same_alone_and_under_load(self, deterministic):
        server = deterministic
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def seeded() -> list[str]:
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a short story about a lighthouse."}],
                n=3, max_tokens=32, temperature=1.0, seed=1234)
            return [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]

        alone = seeded()
        assert len(set(alone)) == 3  # three streams of their own, not one answer thrice
        ended: list[float] = []

        def stream(i: int) -> None:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Describe city number {i} in detail."}],
                max_tokens=160, temperature=0.8, extra_body={"min_tokens": 160})
            ended.append(time.monotonic())

        others = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in others:
            thread.start()
        assert wait_for(lambda: (server.health()["engine"] or {}).get("num_running", 0) >= 4, 60.0, 0.1)
        loaded = seeded()
        finished = time.monotonic()
        for thread in others:
            thread.join()
        assert sum(t > finished for t in ended) >= 2, "the other streams must still decode beside the seeded call"
        assert loaded == alone
