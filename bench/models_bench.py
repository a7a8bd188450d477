"""Several models on one `edge serve` (issue 45): what a load costs, what an unload gives back, and whether priority
holds across models. One server, three models (the embedded GGUF as "a", a Q8_0 copy of it made by llama.cpp's
quantizer as "b", and the size ladder's generated `tiny` rung in Q4_K_M as "c"), all with keep_alive -1 (nothing
unloads by itself during the run), under a memory_budget that holds any two of them and not all three (from their
memory plans, as the registry counts them):

1. cold-load TTFT of a and b: each one's first streamed request, the load included, against the same request once
   it is loaded (the baseline, same run);
2. the third model: c's first request evicts the least recently used idle model (a), whose processes exit; c's
   cold-load and loaded TTFT;
3. the RSS (and PSS) an operator's unload frees: b's processes as /v1/models measured them, its pids gone after
   POST /v1/models/b/unload, and the box's available memory before and after (noisy on a shared box);
4. priority across models: b's high-priority (0) request alone (its idle TTFT), then while a serves a burst of
   `--burst` low-priority (10) chats, then the same request at the burst's low priority (the first-come baseline),
   each `--repeats` times. The acceptance asks for high-during-burst within 2x idle. Every prompt starts with its
   own number (no prompt cache answers it: each TTFT is a whole prefill of about 120 tokens).

    python -m bench.models_bench [--burst 16] [--max-tokens 48] [--repeats 3]

Priority's phase loads a and b again (a evicts nothing: b was unloaded; b then evicts c, the idle one).

Prints one table; the load average is printed with it (the box is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import psutil

from bench.loadgen import RequestSpec, send
from bench.systems import System

MIB = 2**20
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The keeper has lived alone "
          "on the rock for eleven winters, keeps a logbook of every ship that passes, mends the lamp by hand, and "
          "talks to the gulls. One grey morning after a storm a green bottle lies among the kelp below the stairs. "
          "Tell how the keeper opens it, what the letter inside says, who wrote it and when, and what the keeper "
          "decides to do about it. Keep the tone quiet and precise, and end with the lamp being lit at dusk.")
NONCE = itertools.count()


def fresh(text: str) -> str:
    """The text behind a number no other request has: no prompt cache answers it (each TTFT is a whole prefill)."""
    return f"Request {next(NONCE)} of this run. {text}"


def q8_copy(source: str, target: str) -> str:
    """A Q8_0 copy of `source` made by llama.cpp's own quantizer (its per-tensor log silenced)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, True, 1
    with _quiet_stderr():
        code = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> Q8_0 failed with {code}")
    return target


@contextlib.contextmanager
def _quiet_stderr():
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def planned(path: str, budget: int = 0) -> int:
    """What the registry counts for a model of this server's settings: its plan, less the gateway's own runtime."""
    from contracts.memory_plan import GATEWAY_RUNTIME
    from edge.check_model.memory import machine, serve_plan
    from edge.config import ServeConfig, model_config
    from edge.models.spec import ModelSpec
    server = ServeConfig(prefill_workers=1, memory_budget=budget, models=(ModelSpec("x", path),))
    return serve_plan(model_config(server, ModelSpec("x", path)), path, machine("cpu")).used("host") - GATEWAY_RUNTIME


def budget_for_two(paths: dict[str, str]) -> int:
    """A memory_budget that holds any two of the three models and not all three."""
    from contracts.memory_plan import GATEWAY_RUNTIME
    costs = {name: planned(path) for name, path in paths.items()}
    two = sorted(costs.values())
    budget = GATEWAY_RUNTIME + two[1] + two[2] + two[0] // 2
    costs = {name: planned(path, budget) for name, path in paths.items()}
    held = budget - GATEWAY_RUNTIME
    if not (max(a + b for a in costs.values() for b in costs.values()) <= held < sum(costs.values())):
        raise RuntimeError(f"no budget holds two and not three of {costs}")
    return budget


def three_model_server(folder: Path, paths: dict[str, str], budget: int) -> System:
    config = folder / "serve.toml"
    tables = "".join(f'[[models]]\nname = "{name}"\nmodel = "{path}"\n' for name, path in paths.items())
    config.write_text('prefill_workers = 1\nkeep_alive = "-1"\nlog_level = "INFO"\nmodel_load_timeout_s = 1200\n'
                      f'memory_budget = {budget}\n{tables}')
    return System("ours, three models", "a", lambda port: [sys.executable, "-m", "edge.cli", "serve", "--config",
                                                            str(config), "--port", str(port)], ready_path="/health")


async def ttft(session: aiohttp.ClientSession, url: str, model: str, priority: int = 0,
               max_tokens: int = 8) -> float:
    spec = RequestSpec(({"role": "user", "content": fresh(PROMPT)},), max_tokens, priority)
    result = await send(session, url, model, spec)
    if not result.ok or result.ttft_s is None:
        raise RuntimeError(f"{model}: {result.status} {result.error}")
    return result.ttft_s


def models_state(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def model_pids(url: str, name: str) -> list[int]:
    processes = httpx.get(url + "/health", timeout=10).json()["models"][name].get("processes", {})
    return [p["pid"] for p in processes.values() if p.get("pid")]


async def loads(url: str, models: tuple[str, ...]) -> list[tuple[str, float, float]]:
    """(model, cold TTFT, loaded TTFT) of each model, loaded one after the other."""
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        for model in models:
            cold = await ttft(session, url, model)
            warm = statistics.median([await ttft(session, url, model) for _ in range(3)])
            rows.append((model, cold, warm))
    return rows


def third_evicts(url: str) -> tuple[list[tuple[str, float, float]], dict]:
    """c's first request, with a and b loaded and idle (a used first): a is evicted, its processes exit."""
    pids = model_pids(url, "a")
    rows = asyncio.run(loads(url, ("c",)))
    states = {name: m["state"] for name, m in models_state(url).items()}
    return rows, {"states": states, "pids": len(pids), "gone": sum(not psutil.pid_exists(pid) for pid in pids)}


def unload_frees(url: str, model: str = "b") -> dict:
    before = models_state(url)[model]["memory"]["measured"]
    pids = model_pids(url, model)
    available = psutil.virtual_memory().available
    answer = httpx.post(url + f"/v1/models/{model}/unload", timeout=120)
    answer.raise_for_status()
    gone = [pid for pid in pids if not psutil.pid_exists(pid)]
    return {"rss": before["rss"], "pss": before["pss"], "pids": len(pids), "gone": len(gone),
            "available_delta": psutil.virtual_memory().available - available,
            "state": answer.json()["state"]}


async def priority(url: str, burst: int, max_tokens: int, repeats: int) -> dict[str, list[float]]:
    """b's TTFT alone, during a's low-priority burst at high priority, and at the burst's own priority."""
    out: dict[str, list[float]] = {"idle": [], "high": [], "low": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await ttft(session, url, "a")  # a loaded again (evicted by c above)
        for _ in range(repeats):
            out["idle"].append(await ttft(session, url, "b", priority=0))
        for label, level in (("high", 0), ("low", 10)):
            for _ in range(repeats):
                out[label].append(await _beside_burst(session, url, burst, max_tokens, level))
    return out


async def _beside_burst(session, url: str, burst: int, max_tokens: int, level: int) -> float:
    """b's TTFT sent once half of a's burst streams; the burst is then awaited to its end."""
    decoding = asyncio.Event()
    started: set[int] = set()

    def on_token(index: int):
        def seen() -> None:
            started.add(index)
            if len(started) >= burst // 2:
                decoding.set()
        return seen
    specs = [RequestSpec(({"role": "user", "content": fresh(PROMPT)},), max_tokens, 10, ignore_eos=True)
             for _ in range(burst)]
    tasks = [asyncio.create_task(send(session, url, "a", spec, on_token=on_token(i))) for i, spec in enumerate(specs)]
    await asyncio.wait_for(decoding.wait(), 600)
    measured = await ttft(session, url, "b", priority=level)
    results = await asyncio.gather(*tasks)
    if failed := [r for r in results if not r.ok]:
        raise RuntimeError(f"{len(failed)} burst requests failed: {failed[0].status} {failed[0].error}")
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from bench.gguf_ladder import build
    from prefill_cpu.embedded_model import embedded_model_path
    folder = Path(tempfile.mkdtemp(prefix="models-bench-"))
    source = embedded_model_path()
    paths = {"a": source, "b": q8_copy(source, str(folder / "smollm2-q8_0.gguf")),
             "c": build(folder, "tiny", ("q4_k_m",))["q4_k_m"]["path"]}
    budget = budget_for_two(paths)
    print(f"memory_budget {budget / MIB:.0f} MiB: plans " +
          ", ".join(f"{name} {planned(path, budget) / MIB:.0f} MiB" for name, path in paths.items()))
    server = three_model_server(folder, paths, budget)
    server.start()
    try:
        began = time.monotonic()
        rows = asyncio.run(loads(server.url, ("a", "b")))
        third, evicted = third_evicts(server.url)
        freed = unload_frees(server.url, "b")
        waits = asyncio.run(priority(server.url, args.burst, args.max_tokens, args.repeats))
        report(rows + third, evicted, freed, waits, args, time.monotonic() - began)
    finally:
        server.stop()
        print(f"server log: {server.log}")


def report(rows, evicted: dict, freed: dict, waits: dict[str, list[float]], args, wall_s: float) -> None:
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} cores; {wall_s:.0f} s")
    print(f"{'model':8} {'cold-load TTFT s':>17} {'loaded TTFT s':>14}")
    for model, cold, warm in rows:
        print(f"{model:8} {cold:17.2f} {warm:14.3f}")
    print(f"c's load with a and b idle: states after it {evicted['states']}; {evicted['gone']} of a's "
          f"{evicted['pids']} processes gone")
    print(f"unload of b: RSS {freed['rss'] / MIB:.0f} MiB, PSS {(freed['pss'] or 0) / MIB:.0f} MiB measured before; "
          f"{freed['gone']} of {freed['pids']} processes gone after it ({freed['state']}); the box's available "
          f"memory {freed['available_delta'] / MIB:+.0f} MiB")
    idle = statistics.median(waits["idle"])
    print(f"b's TTFT (median of {args.repeats}) beside a's {args.burst}-chat burst at priority 10, "
          f"{args.max_tokens} tokens each:")
    for label, name in (("idle", "alone (idle)"), ("high", "priority 0 during the burst"),
                        ("low", "priority 10 during the burst (baseline)")):
        median = statistics.median(waits[label])
        print(f"  {name:42} {median:7.3f} s  {median / idle:5.2f}x idle   "
              f"({', '.join(f'{x:.3f}' for x in waits[label])})")


if __name__ == "__main__":
    main()
