"""Scheduling to service-level objectives: goodput and attainment of two classes under overload, in one run.

    make bench-slo                       # = .venv/bin/python -m bench.slo_bench [options]
    .venv/bin/python -m bench.slo_bench --phase-s 20 --capacity-requests 12     # a short run

Two classes share the box: interactive (short prompts, a TTFT and a TPOT objective) and batch (longer prompts, no
objective, priority 10), picked by the X-Tenant header. First the capacity of the mix is measured on ours with
priorities only (requests a second when everything arrives at once), and, unless given, the objectives are set to
--ttft-margin times the p90 TTFT and --margin times the p90 TPOT of interactive requests in a phase at the lowest
load on it (attainable below capacity on this box: the TTFT margin of 2 lets a prompt queued behind one other
interactive prompt still meet it, as two arrivals close together do now and then at any load); then each system
gets the same seeded Poisson arrivals at 0.5x, 1.5x and 3x of the capacity,
one phase per load:
- ours, objectives: the policy gives interactive ttft_slo_ms, tpot_slo_ms and on_slo_miss = "reject";
- ours, priorities only: the same classes and priorities, no objectives;
- llama-server (llama.cpp's, from checks/llama_server.py) when it is built, else llama-cpp-python's server when
  its extras are installed; else that column is skipped with a note.
Per system and load: goodput (requests a second that met their class's objectives; batch: that completed),
attainment per class (of what was offered; interactive also of what was served, and of that the TTFT objective alone),
p50/p99 TTFT of what was served, refusals and how fast they came, and our predictor's error (from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from bench.loadgen import RequestResult, RequestSpec, arrival_times, percentiles, send
from bench.systems import System
from bench.workloads import text_of
from prefill_cpu.embedded_model import embedded_model_path

CLASSES = {"interactive": "chat", "batch": "nightly"}  # class -> the X-Tenant value that picks it


def policy(ttft_slo_ms: int | None, tpot_slo_ms: int | None) -> str:
    objectives = (f"ttft_slo_ms = {ttft_slo_ms}\ntpot_slo_ms = {tpot_slo_ms}\non_slo_miss = \"reject\"\n"
                  if ttft_slo_ms else "")
    return (f'version = 1\ndefault_class = "batch"\n[classes.interactive]\npriority = 0\n{objectives}'
            f'[classes.batch]\npriority = 10\n[tenants]\nheader = "X-Tenant"\n[tenants.classes]\n'
            + "".join(f'{tenant} = "{name}"\n' for name, tenant in CLASSES.items()))


def ours(name: str, gguf: str, threads: int, policy_text: str, log_level: str = "WARNING") -> System:
    folder = Path(tempfile.mkdtemp(prefix="slo-bench-"))
    (folder / "policy.toml").write_text(policy_text)
    (folder / "serve.toml").write_text(f'log_level = "{log_level}"\npolicy = "{folder / "policy.toml"}"\n'
                                       f"threads_per_worker = {threads}\nmax_num_seqs = 64\n"
                                       f"[limits]\nprefill_queue_size = 512\n")
    return System(name, Path(gguf).name.removesuffix(".gguf"), lambda port: [
        sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port", str(port),
        "--config", str(folder / "serve.toml")], ready_path="/health")


def baseline(gguf: str, threads: int) -> tuple[System | None, str]:
    """llama.cpp's server if built, else llama-cpp-python's if its extras are installed; else why not."""
    from checks.llama_server import binary_path
    model = Path(gguf).name.removesuffix(".gguf")
    if binary_path().exists():
        return System("llama-server (-np 8)", model, lambda port: [
            str(binary_path()), "-m", gguf, "--port", str(port), "-t", str(threads), "-np", "8", "-c", "16384",
            "--log-disable"], ready_path="/health"), ""
    try:
        import llama_cpp.server.app  # noqa: F401  (the extras: fastapi, uvicorn, sse-starlette)
    except ImportError as err:
        return None, (f"llama-server is not built (`make llama-server`) and llama-cpp-python's server extras are "
                      f"absent ({err}): its column is skipped")
    return System("llama_cpp.server", model, lambda port: [
        sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port), "--n_threads",
        str(threads), "--n_ctx", "4096", "--model_alias", model]), ""


def objective_ms(margin: float, p90_s: float, floor_ms: int) -> int:
    """margin x the p90 measured below capacity, rounded up to whole 10 ms (at least floor_ms): rounding to the
    nearest cut the margin (36 ms x 1.25 = 45 rounded to 40, 1.1x), and the objectives mode then refused requests
    below capacity that its calibration had served."""
    return max(floor_ms, 10 * math.ceil(round(margin * p90_s * 100, 6)))


def workload(n: int, seed: int, share: float, max_tokens: tuple[int, int]) -> list[RequestSpec]:
    """Interactive (short questions) and batch (longer reports) requests, mixed at random in `share`."""
    rng = np.random.default_rng(seed)
    specs = []
    for is_interactive in rng.random(n) < share:
        if is_interactive:
            text, tokens, label = "Quick question: " + text_of(40, rng), max_tokens[0], "interactive"
        else:
            text, tokens, label = "Write a report about: " + text_of(300, rng), max_tokens[1], "batch"
        specs.append(RequestSpec(({"role": "user", "content": text},), tokens, label=label, ignore_eos=True))
    return specs


async def offer(system: System, specs: list[RequestSpec], offsets, timeout_s: float) -> list[RequestResult]:
    """Each class through its own session (its X-Tenant header); arrivals as scheduled, whatever comes back."""
    sessions = {name: aiohttp.ClientSession(headers={"X-Tenant": tenant}, connector=aiohttp.TCPConnector(limit=0),
                                            timeout=aiohttp.ClientTimeout(total=timeout_s))
                for name, tenant in CLASSES.items()}
    started = time.perf_counter()

    async def fire(spec: RequestSpec, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        sent = time.perf_counter()
        result = await send(sessions[spec.label], system.url, system.model, spec)
        if result.e2e_s is None:  # answered with an error status: how long the answer took
            result.e2e_s = time.perf_counter() - sent
        return result
    try:
        return list(await asyncio.gather(*(fire(s, float(o)) for s, o in zip(specs, offsets))))
    finally:
        for session in sessions.values():
            await session.close()


def prediction_errors(url: str, client_class: str = "interactive") -> dict[float, float]:
    """Our predictor's error histogram for one class (cumulative counts by upper bound), {} for other servers."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for labels, count in re.findall(r'edge:slo_ttft_prediction_error_seconds_bucket\{([^}]*)\} ([0-9.e+]+)', text):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if named.get("class") == client_class:
            out[float(named["le"])] = float(count)
    return out


def error_shares(before: dict, after: dict) -> str:
    """Share of this phase's predictions within 0.25 s and 1 s of the measured TTFT."""
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    total = delta.get(float("inf"), 0.0)
    if not total:
        return "-"
    within = [(delta[b] - delta[-b]) / total for b in (0.25, 1.0)]
    return f"{within[0]:.0%} / {within[1]:.0%} of {total:.0f}"


def summarize(results: list[RequestResult], phase_s: float, slo: tuple[float, float]) -> dict:
    out = {}
    for name in CLASSES:
        mine = [r for r in results if r.label == name]
        served = [r for r in mine if r.ok]
        refused = [r for r in mine if r.status == 429]  # slo_unattainable (ours with objectives) or a full queue
        if name == "interactive":
            met = [r for r in served if r.ttft_s <= slo[0] and (r.tpot_s or 0) <= slo[1]]
        else:
            met = served
        out[name] = {"offered": len(mine), "served": len(served), "met": len(met), "refused": len(refused),
                     "goodput": len(met) / phase_s, "attainment": len(met) / len(mine) if mine else float("nan"),
                     "served_attainment": len(met) / len(served) if served else float("nan"),
                     "ttft_attainment": (sum(r.ttft_s <= slo[0] for r in served) / len(served)
                                         if served else float("nan")),
                     "ttft": percentiles([r.ttft_s for r in served], (50, 99)),
                     "refusal_p99_ms": max((r.e2e_s for r in refused), default=0.0) * 1e3,
                     "failed": len(mine) - len(served) - len(refused)}
    return out


async def capacity(system: System, args) -> float:
    """Requests a second of the mix when everything arrives at once (what the box completes flat out)."""
    specs = workload(args.capacity_requests, args.seed + 99, args.share, args.max_tokens)
    started = time.perf_counter()
    results = await offer(system, specs, np.zeros(len(specs)), 600)
    return sum(1 for r in results if r.ok) / (time.perf_counter() - started)


async def calibrate(system: System, rate: float, args) -> tuple[float, float]:
    """TTFT and TPOT (s) that interactive requests get below capacity: the p90 of each over a phase of the mix at
    `rate` (seeded apart from the measured phases). The objectives are set from these, so that they are attainable
    on this box at this load, whatever its speed or the load beside the benchmark."""
    n = max(6, round(rate * args.calibrate_s))
    specs = workload(n, args.seed + 500, args.share, args.max_tokens)
    results = await offer(system, specs, arrival_times(n, rate, args.seed + 500), args.calibrate_s + args.drain_s)
    served = [r for r in results if r.ok and r.label == "interactive"]
    if not served:
        raise SystemExit("no interactive request was served while calibrating the objectives")
    return (float(np.percentile([r.ttft_s for r in served], 90)),
            float(np.percentile([r.tpot_s or 0.0 for r in served], 90)))


async def run_system(system: System, rates: list[float], loads: list[float], args, slo) -> dict:
    system.start()
    try:
        await offer(system, workload(4, args.seed + 7, 0.5, args.max_tokens), np.zeros(4), 120)  # warm-up
        phases = {}
        for i, rate in enumerate(rates):
            n = max(4, round(rate * args.phase_s))
            specs = workload(n, args.seed + 1000 * i, args.share, args.max_tokens)
            before = prediction_errors(system.url)
            results = await offer(system, specs, arrival_times(n, rate, args.seed + i), args.phase_s + args.drain_s)
            phases[rate] = {"classes": summarize(results, args.phase_s, slo),
                            "predictor": error_shares(before, prediction_errors(system.url))}
            print(table({system.name: phases}, [rate], [loads[i]]).splitlines()[-1], flush=True)
        return phases
    finally:
        system.stop()


def table(results: dict, rates: list[float], loads: list[float]) -> str:
    head = ("system", "load", "goodput int/batch req/s", "attainment int (of served; TTFT alone of served) / batch",
            "TTFT p50/p99 int s",
            "TTFT p50/p99 batch s", "refused int (slowest ms)", "failed", "predictor within 0.25 s / 1 s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, phases in results.items():
        for load, rate in zip(loads, rates):
            c = phases[rate]["classes"]
            i, b = c["interactive"], c["batch"]
            lines.append(
                f"| {name} | {load:g}x ({rate:.2f}/s) | {i['goodput']:.2f} / {b['goodput']:.2f} | "
                f"{i['attainment']:.0%} ({i['served_attainment']:.0%}; {i['ttft_attainment']:.0%}) / "
                f"{b['attainment']:.0%} | "
                f"{i['ttft'][50]:.2f}/{i['ttft'][99]:.2f} | {b['ttft'][50]:.2f}/{b['ttft'][99]:.2f} | "
                f"{i['refused']} ({i['refusal_p99_ms']:.0f}) | {i['failed'] + b['failed']} | "
                f"{phases[rate]['predictor']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loads", default="0.5,1.5,3", help="multiples of the measured capacity")
    parser.add_argument("--phase-s", type=float, default=60.0, help="seconds of arrivals per load")
    parser.add_argument("--drain-s", type=float, default=60.0, help="a request still open this long after its "
                        "phase's arrivals end counts as failed")
    parser.add_argument("--capacity-requests", type=int, default=24)
    parser.add_argument("--capacity", type=float, default=0.0, help="the mix's capacity, req/s, instead of measuring "
                        "it (a capacity measured while the box is busier than during the phases makes 3x no overload)")
    parser.add_argument("--share", type=float, default=0.8, help="interactive share of the requests (at 0.5 the "
                        "interactive requests alone stay below capacity at 3x, and priorities only serve most in time)")
    parser.add_argument("--ttft-slo-ms", type=int, default=0, help="interactive TTFT objective; 0: --ttft-margin times "
                        "the p90 TTFT measured here at the lowest load (a busy or slow box keeps objectives it can "
                        "meet below capacity)")
    parser.add_argument("--tpot-slo-ms", type=int, default=0, help="interactive TPOT objective; 0: likewise")
    parser.add_argument("--margin", type=float, default=1.25, help="TPOT objective over the p90 measured below "
                        "capacity")
    parser.add_argument("--ttft-margin", type=float, default=2.0, help="TTFT objective over the p90 measured below "
                        "capacity (2: one interactive prompt ahead still meets it)")
    parser.add_argument("--no-baseline", action="store_true", help="skip llama-server (ours in both modes only)")
    parser.add_argument("--calibrate-s", type=float, default=30.0, help="seconds of arrivals at the lowest load on "
                        "ours with priorities only, to measure what interactive requests get below capacity")
    parser.add_argument("--max-tokens", default="32,64", help="interactive,batch answer lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-burst", action="store_true", help="also the first-burst phase on a freshly started "
                        "server (bench/slo_first_burst.py)")
    parser.add_argument("--first-burst-only", action="store_true", help="that phase alone")
    parser.add_argument("--burst-size", type=int, default=64)
    parser.add_argument("--burst-tokens", type=int, default=130, help="prompt tokens of each burst chat, about")
    parser.add_argument("--burst-max-tokens", type=int, default=16)
    parser.add_argument("--burst-ttft-ms", type=int, default=1500)
    parser.add_argument("--log-level", default="WARNING", help="our servers' log level (INFO: a line per request, "
                        "with where its TTFT went); each server's log is named at the end")
    args = parser.parse_args()
    args.max_tokens = tuple(int(x) for x in args.max_tokens.split(","))
    gguf = args.model or str(embedded_model_path())
    loads = [float(x) for x in args.loads.split(",")]
    if args.first_burst or args.first_burst_only:
        from bench.slo_first_burst import run_first_burst
        print(run_first_burst(gguf, args), flush=True)
        if args.first_burst_only:
            return
    priority_only = ours("ours, priorities only", gguf, args.threads, policy(None, None), args.log_level)
    other, note = (None, "llama-server skipped (--no-baseline)") if args.no_baseline else baseline(gguf, args.threads)

    logs: list[System] = []

    async def run() -> tuple[float, dict]:
        priority_only.start()
        try:
            await offer(priority_only, workload(4, args.seed + 7, 0.5, args.max_tokens), np.zeros(4), 120)  # warm-up
            cap = args.capacity or await capacity(priority_only, args)
            below = await calibrate(priority_only, min(loads) * cap, args)
        finally:
            priority_only.stop()
        args.ttft_slo_ms = args.ttft_slo_ms or objective_ms(args.ttft_margin, below[0], 100)
        args.tpot_slo_ms = args.tpot_slo_ms or objective_ms(args.margin, below[1], 20)
        print(f"measured capacity of the mix: {cap:.2f} req/s; at {min(loads):g}x of it interactive p90 TTFT "
              f"{below[0] * 1e3:.0f} ms, TPOT {below[1] * 1e3:.0f} ms; objectives {args.ttft_slo_ms:.0f} / "
              f"{args.tpot_slo_ms:.0f} ms", flush=True)
        slo = (args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
        systems = [ours("ours, objectives", gguf, args.threads, policy(int(args.ttft_slo_ms), int(args.tpot_slo_ms)),
                        args.log_level),
                   priority_only, *([other] if other else [])]
        logs.extend(systems)
        rates = [load * cap for load in loads]
        return cap, {system.name: await run_system(system, rates, loads, args, slo) for system in systems}

    started = time.perf_counter()
    cap, results = asyncio.run(run())
    how_measured = "given" if args.capacity else f"{args.capacity_requests} at once, ours with priorities only"
    rates = [load * cap for load in loads]
    print(f"\nObjectives: interactive TTFT {args.ttft_slo_ms:.0f} ms, TPOT {args.tpot_slo_ms:.0f} ms; batch none. "
          f"Capacity {cap:.2f} req/s ({how_measured}); "
          f"{args.phase_s:g} s of Poisson arrivals per load, {args.share:.0%} interactive, answers "
          f"{args.max_tokens[0]}/{args.max_tokens[1]} tokens; {time.perf_counter() - started:.0f} s in all")
    if note:
        print(f"Note: {note}")
    print("Logs: " + "; ".join(f"{system.name}: {system.log}" for system in logs))
    print(table(results, rates, loads))


if __name__ == "__main__":
    main()
