"""End-to-end serving benchmark: ours vs llama.cpp's llama-server vs llama-cpp-python's server vs a
transformers baseline, on the same GGUF, threads and workload, in one run.

    make bench-serving                       # = .venv/bin/python -m bench.serving_bench [options]
    .venv/bin/python -m bench.serving_bench --systems ours,llama-server --rates 0.5,1,2 --requests 24

Per system: idle TTFT of a short interactive request (sequential), then the mixed workload (prompts
64/256/1024 in 6:3:1 under a shared system prompt) at each offered load, open loop, then the priority
scenario: --interactive high-priority requests arriving Poisson, first alone, then on top of
--background low-priority streams started at once. Prints one table per part, writes JSON and a PNG of latency
against offered load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench.loadgen import arrival_times, percentiles, run_open_loop, send, summarize
from bench.systems import make_systems
from bench.workloads import background, interactive, mixed
from prefill_cpu.embedded_model import embedded_model_path


async def idle_ttft(system, specs) -> list[float]:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        results = [await send(session, system.url, system.model, spec) for spec in specs]
    return [r.ttft_s for r in results if r.ok]


async def priority_scenario(system, args) -> dict:
    """Interactive requests twice, with the same Poisson arrivals: alone (what they cost each other on
    one box), then, with other prompts, on top of the background streams, which all start at t=0 (the interactive
    ones from t=warmup on). Background streams still running when the last interactive request ends are cancelled
    (not counted as errors); what they streamed until then gives the background's throughput."""
    fg = interactive(args.interactive, args.seed)
    fg_offsets = arrival_times(len(fg), args.interactive_rate, args.seed)
    # other prompts of the same kind: no server may replay the loaded run's prompts from a cache
    alone, _ = await run_open_loop(system.url, system.model, interactive(args.interactive, args.seed + 500),
                                   fg_offsets, args.scenario_timeout_s)
    bg = background(args.background, args.seed, args.background_tokens)
    bg_chunks = []  # arrival times of background content chunks (about one token each)
    started = time.perf_counter()
    fg_task = asyncio.create_task(run_open_loop(system.url, system.model, fg, fg_offsets + args.background_warmup_s,
                                                args.scenario_timeout_s))
    bg_task = asyncio.create_task(run_open_loop(system.url, system.model, bg, [0.0] * len(bg),
                                                args.scenario_timeout_s,
                                                on_token=lambda: bg_chunks.append(time.perf_counter())))
    fg_results, _ = await fg_task
    bg_task.cancel()
    window = time.perf_counter() - started
    return {"background_tok_s": len(bg_chunks) / window, "scenario_s": window,
            "interactive_alone_ttft": percentiles([r.ttft_s for r in alone if r.ok]),
            "interactive_ttft": percentiles([r.ttft_s for r in fg_results if r.ok]),
            "interactive_errors": sum(1 for r in fg_results + alone if not r.ok),
            "interactive_statuses": sorted({r.status for r in fg_results + alone})}


async def bench_system(system, args) -> dict:
    system.start()
    try:
        await idle_ttft(system, interactive(1, args.seed + 99))  # warm-up
        idle = await idle_ttft(system, interactive(5, args.seed + 7))
        loads = {}
        for i, rate in enumerate(args.rates):
            # fresh prompts at each load (the system prompt stays shared), so no server replays a cached prompt
            specs = mixed(args.requests, args.seed + 1000 * i, args.max_tokens, ignore_eos=args.ignore_eos)
            results, wall = await run_open_loop(system.url, system.model, specs,
                                                arrival_times(len(specs), rate, args.seed, args.burstiness))
            loads[rate] = summarize(results, wall, args.slo)
            print(f"  {system.name} @ {rate} req/s: {loads[rate]['completed']}/{len(specs)} ok, "
                  f"e2e p50 {loads[rate]['e2e'][50]:.2f} s", flush=True)
        scenario = await priority_scenario(system, args) if args.background else None
        return {"idle_ttft": percentiles(idle), "loads": loads, "priority": scenario}
    finally:
        system.stop()


def print_tables(all_results: dict, args) -> None:
    print(f"\nMixed workload ({args.requests} requests per load, max_tokens {args.max_tokens}"
          f"{', ignore_eos' if args.ignore_eos else ''}, seed {args.seed}, "
          f"gamma shape {args.burstiness}); SLO: {args.slo}")
    head = ("system", "offered req/s", "done", "req/s", "out tok/s", "goodput req/s", "TTFT p50/p90/p99 s",
            "TPOT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p90/p99 s", "errors")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, res in all_results.items():
        for rate, s in res["loads"].items():
            print(f"| {name} | {rate} | {s['completed']}/{s['requests']} | {s['request_throughput']:.2f} | "
                  f"{s['output_throughput']:.1f} | {s['goodput']:.2f} | {_p(s['ttft'])} | "
                  f"{_ms(s['tpot'])} | {_ms(s['itl'])} | {_p(s['e2e'])} | {s['errors'] or '-'} |")
    if args.background:
        print(f"\nPriority scenario: {args.background} background streams (priority 10, {args.background_tokens} "
              f"tokens) + {args.interactive} interactive requests (priority 0) at {args.interactive_rate} req/s")
        print("| system | idle TTFT p50 s | alone TTFT p50/p99 s | loaded TTFT p50 s | loaded TTFT p99 s | "
              "p99 / idle | p99 / alone p99 | background out tok/s | errors |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, res in all_results.items():
            idle, sc = res["idle_ttft"][50], res["priority"]
            alone, loaded = sc["interactive_alone_ttft"], sc["interactive_ttft"]
            print(f"| {name} | {_s(idle)} | {_s(alone[50])}/{_s(alone[99])} | {_s(loaded[50])} | {_s(loaded[99])} | "
                  f"{_s(loaded[99] / idle, 'x', 1)} | {_s(loaded[99] / alone[99], 'x', 1)} | "
                  f"{_s(sc['background_tok_s'], '', 1)} | {sc['interactive_errors'] or '-'} |")


def _s(value: float, unit: str = "", digits: int = 2) -> str:
    """A number for the table; '-' where nothing completed (NaN)."""
    return "-" if value != value else f"{value:.{digits}f}{unit}"


def _p(values: dict) -> str:
    return "/".join(f"{v:.2f}" for v in values.values())


def _ms(values: dict) -> str:
    return "/".join(f"{v * 1e3:.0f}" for k, v in values.items() if k in (50, 99))


def plot(all_results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in all_results.items():
        rates = sorted(res["loads"])
        for ax, metric in zip(axes, ("e2e", "ttft")):
            ax.plot(rates, [res["loads"][r][metric][50] for r in rates], marker="o", label=name)
    for ax, title in zip(axes, ("end-to-end latency p50 (s)", "time to first token p50 (s)")):
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--systems", default="ours,llama-server,llama-cpp-python,transformers")
    parser.add_argument("--rates", default="0.25,0.5,1", help="offered loads, requests per second")
    parser.add_argument("--requests", type=int, default=16, help="requests per offered load")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="mixed workload: every answer runs to --max-tokens (as vLLM's serving benchmark can), so "
                             "out tok/s compares the same work; --no-ignore-eos lets each model end its answers")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for every llama.cpp-based server")
    parser.add_argument("--slots", type=int, default=12, help="llama-server -np (parallel slots)")
    parser.add_argument("--pace-ms", type=float, default=100, help="ours-paced: its cpu_decode_pace_ms")
    parser.add_argument("--ctx-per-slot", type=int, default=2048)
    parser.add_argument("--background", type=int, default=30, help="priority scenario: background streams (0: skip)")
    parser.add_argument("--background-tokens", type=int, default=128)
    parser.add_argument("--background-warmup-s", type=float, default=5.0)
    parser.add_argument("--interactive", type=int, default=8)
    parser.add_argument("--interactive-rate", type=float, default=0.5)
    parser.add_argument("--scenario-timeout-s", type=float, default=180.0)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000)
    parser.add_argument("--slo-tpot-ms", type=float, default=250)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.slo = {"ttft_s": args.slo_ttft_ms / 1e3, "tpot_s": args.slo_tpot_ms / 1e3}
    return args


def main() -> None:
    args = parse_args()
    gguf = args.model or embedded_model_path()
    systems = make_systems(args.systems.split(","), gguf, args.threads, args.slots, args.ctx_per_slot, args.pace_ms)
    all_results = {}
    for system in systems:
        print(f"benchmarking {system.name} ...", flush=True)
        try:
            all_results[system.name] = asyncio.run(bench_system(system, args))
        except RuntimeError as err:
            print(f"  {system.name} failed: {err}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(all_results, indent=1, default=str))
    print_tables(all_results, args)
    try:
        plot(all_results, out / "serving_latency.png")
    except ImportError:  # a venv from `make install` alone; `make bench-serving` installs the bench extra
        print(f"\nwrote {out / 'serving.json'}; no plot: matplotlib is not installed (pip install -e '.[bench]')")
        return
    print(f"\nwrote {out / 'serving.json'} and {out / 'serving_latency.png'}")


if __name__ == "__main__":
    main()
