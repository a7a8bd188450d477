"""Several models on one `edge serve` (issue 45), end to end with real processes: the embedded GGUF as "a", a Q8_0
copy of it made by llama.cpp's quantizer as "b", and a broken GGUF, within a memory budget that holds one model.
Each answers its own `model` once loaded on demand; the broken one fails alone (503 model_failed, the others serve);
a request for b evicts the idle a (its processes exit: the RSS it held is freed); b's keep_alive 0 unloads it once
its answer is out; /metrics labels each model's series by model_name. One server for all of it: a load takes 10-60 s
on the shared development box."""

import time

import httpx
import psutil
import pytest

from bench.models_bench import q8_copy
from contracts.memory_plan import GATEWAY_RUNTIME
from edge.check_model.memory import machine, serve_plan
from edge.config import ServeConfig, model_config
from edge.models.spec import ModelSpec
from server_process import ServerProcess

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
MIB = 2**20


def planned(path: str, budget: int) -> int:
    """What the registry counts for the model (its plan, less the gateway's own runtime)."""
    server = ServeConfig(prefill_workers=1, memory_budget=budget, models=(ModelSpec("x", path),))
    return serve_plan(model_config(server, ModelSpec("x", path)), path, machine("cpu")).used("host") - GATEWAY_RUNTIME


def budget_for_one(a: str, b: str) -> int:
    big = max(planned(a, 0), planned(b, 0))
    budget = GATEWAY_RUNTIME + big + big // 2
    costs = [planned(a, budget), planned(b, budget)]
    assert max(costs) <= budget - GATEWAY_RUNTIME < sum(costs), (costs, budget)  # one fits, not two
    return budget


def chat(server: ServerProcess, model: str, **extra) -> httpx.Response:
    return httpx.post(server.base + "/v1/chat/completions", json={"model": model, **CHAT, **extra}, timeout=600)


def states(server: ServerProcess) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(server.base + "/v1/models", timeout=30).json()["data"]}


def pids(server: ServerProcess, name: str) -> list[int]:
    processes = server.health()["models"][name].get("processes", {})
    return [p["pid"] for p in processes.values() if p["pid"]]


def test_two_models_load_on_demand_evict_within_the_budget_and_a_broken_one_fails_alone(tmp_path,
                                                                                           embedded_model_path):
    copy = q8_copy(embedded_model_path, str(tmp_path / "smollm2-q8_0.gguf"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    budget = budget_for_one(embedded_model_path, copy)
    config = (f"prefill_workers = 1\nmemory_budget = {budget}\nmodel_load_timeout_s = 1200\n"
              f'[[models]]\nname = "a"\nmodel = "{embedded_model_path}"\nkeep_alive = -1\n'
              f'[[models]]\nname = "b"\nmodel = "{copy}"\nkeep_alive = "0"\n'
              f'[[models]]\nname = "broken"\nmodel = "{broken}"\n')
    with ServerProcess(config, tmp_path).start() as server:
        assert {name: m["state"] for name, m in states(server).items()} == \
            {"a": "unloaded", "b": "unloaded", "broken": "unloaded"}
        first = chat(server, "a")
        assert first.status_code == 200 and first.json()["model"] == "a", first.text
        loaded_a = states(server)["a"]
        a_pids = pids(server, "a")
        assert loaded_a["state"] == "loaded" and loaded_a["memory"]["measured"]["rss"] > 100 * MIB and a_pids
        assert 'model_name="a"' in httpx.get(server.base + "/metrics", timeout=30).text  # its series, merged

        failed = chat(server, "broken")
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_failed", failed.text
        assert "broken" in failed.json()["error"]["message"]
        assert states(server)["a"]["state"] == "loaded" and chat(server, "a").status_code == 200  # a serves on

        second = chat(server, "b")  # the budget holds one: the idle a goes first
        assert second.status_code == 200 and second.json()["model"] == "b", second.text
        now = states(server)
        assert now["a"]["state"] == "unloaded" and now["broken"]["state"] == "failed"
        assert not any(psutil.pid_exists(pid) for pid in a_pids)  # its processes exited: their memory is back

        deadline = time.monotonic() + 120  # keep_alive 0: unloaded once its answer is out
        while states(server)["b"]["state"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert states(server)["b"]["state"] == "unloaded"
        log = server.log_path.read_text()
        assert "evicted (least recently used) for b" in log and "unloaded after its answer (keep_alive 0)" in log
        assert "; model load " in log  # a first request's wait for its model is in its TTFT breakdown
