"""Real model sizes served: `edge serve` (memory budget wired, so the plan decides) against llama.cpp, per ladder GGUF,
in one run: time to ready, every process's RSS and PSS idle, the peak over the run, and a burst of concurrent chats
and a single stream (ignore_eos, fixed max_tokens: the same work on both): output tok/s, TTFT and TPOT p50/p99.

    .venv/bin/python -m bench.sizes_bench                     # every ladder GGUF in /work/ladder (make bench-sizes)
    .venv/bin/python -m bench.sizes_bench --models /work/ladder/ladder-1b-q4_k_m.gguf --budget 16GiB

llama.cpp is, by preference: llama-server (checks/llama_server.py's build, if built; `make llama-server`), else
llama-cpp-python's server (`llama_cpp.server`, the `bench` extra), else llama-cpp-python's `Llama` behind a minimal
one-slot streaming endpoint in this file (`--serve-llama-cpp`): llama.cpp's memory as one process maps and holds it,
its requests served one at a time, as llama_cpp.server serves them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from bench.loadgen import RequestSpec, percentiles, run_open_loop
from bench.systems import System
from bench.workloads import text_of

MIB = 2**20
LADDER = Path("/work/ladder")
SAMPLE_S = 0.25  # how often the peak sampler reads every process
PROMPT = {"tokens": 128}  # the chats' text length (--prompt-tokens)
PROBES: dict[str, list[dict]] = {}  # gguf -> llama-server's options as measured before its run


def tree_memory(root: int) -> dict[str, dict[str, int]]:
    """name (pid) -> rss, pss of `root` and every descendant."""
    rows = {}
    try:
        top = psutil.Process(root)
        processes = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return rows
    for process in processes:
        try:
            full = process.memory_full_info()
            cmdline = process.cmdline()
            at = cmdline.index("-m") + 1 if "-m" in cmdline[:-1] else None
            module = process.name() if at is None else cmdline[at]
            if module == "edge.launch.child_main" and at + 1 < len(cmdline):  # the supervised child's own module
                module = cmdline[at + 1]
            rows[f"{module} ({process.pid})"] = {"rss": full.rss, "pss": full.pss}
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return rows


class PeakSampler:
    """The largest total RSS and PSS of a process tree, read every SAMPLE_S on a thread of its own."""

    def __init__(self, root: int) -> None:
        self.root, self.peak = root, {"rss": 0, "pss": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            rows = tree_memory(self.root).values()
            for key in self.peak:
                self.peak[key] = max(self.peak[key], sum(r[key] for r in rows))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def chats(n: int, max_tokens: int, seed: int = 0, prompt_tokens: int | None = None) -> list[RequestSpec]:
    """n chats of `prompt_tokens` of text (default: PROMPT["tokens"], --prompt-tokens), max_tokens out, ignore_eos."""
    rng, prompt_tokens = np.random.default_rng(seed), prompt_tokens or PROMPT["tokens"]
    return [RequestSpec(({"role": "user", "content": "Summarize: " + text_of(prompt_tokens, rng)},), max_tokens,
                        label="chat", ignore_eos=True) for _ in range(n)]


async def load(system: System, specs: list[RequestSpec]) -> dict:
    results, wall_s = await run_open_loop(system.url, system.model, specs, np.zeros(len(specs)))
    ok = [r for r in results if r.ok]
    return {"requests": len(results), "completed": len(ok), "wall_s": wall_s,
            "out_tok_s": sum(r.output_tokens for r in ok) / wall_s,
            "output_tokens": sum(r.output_tokens for r in ok),
            "ttft": percentiles([r.ttft_s for r in ok], (50, 99)),
            "tpot": percentiles([r.tpot_s for r in ok if r.tpot_s], (50, 99)),
            "errors": sorted({r.error or str(r.status) for r in results if not r.ok})}


def measure(system: System, concurrency: int, max_tokens: int, settle_s: float, cached: bool = False) -> dict:
    """cached: start it once more after the run (the same cache folder) and time that start to ready too."""
    oom_before, started = oom_kills(), time.monotonic()
    system.start(timeout_s=1800)
    ready_s = time.monotonic() - started
    print(f"  ready in {ready_s:.1f} s (load average {load_average()})", flush=True)
    peak = PeakSampler(system.process.pid)
    try:
        time.sleep(settle_s)  # start-up measurements end, allocators settle
        idle = tree_memory(system.process.pid)
        asyncio.run(load(system, chats(1, 4, seed=99)))  # warm-up: first-request costs out of the numbers
        burst = asyncio.run(load(system, chats(concurrency, max_tokens)))
        print(f"  burst: {burst['out_tok_s']:.2f} out tok/s, TPOT p50 {burst['tpot'][50] * 1e3:.0f} ms, idle PSS "
              f"{sum(r['pss'] for r in idle.values()) / MIB:.0f} MiB", flush=True)
        single = asyncio.run(load(system, chats(1, max_tokens, seed=1)))
        print(f"  single: {single['out_tok_s']:.2f} out tok/s", flush=True)
        busy = tree_memory(system.process.pid)
    finally:
        peaks = peak.stop()
        system.stop()
    cached_ready_s = None
    if cached:
        started = time.monotonic()
        system.start(timeout_s=1800)
        cached_ready_s = time.monotonic() - started
        print(f"  cached start ready in {cached_ready_s:.1f} s", flush=True)
        system.stop()
    return {"name": system.name, "ready_s": ready_s, "cached_ready_s": cached_ready_s, "idle": idle,
            "after_load": busy, "peak": peaks, "oom_kills": oom_kills() - oom_before,
            "swap_used": psutil.swap_memory().used,
            "burst": burst, "single": single, "load_average": load_average()}


def oom_kills() -> int:
    """The kernel's count of OOM kills since boot (/proc/vmstat), 0 where it cannot be read."""
    try:
        return next(int(line.split()[1]) for line in Path("/proc/vmstat").read_text().splitlines()
                    if line.startswith("oom_kill "))
    except (OSError, StopIteration):
        return 0


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def ours(gguf: str, budget: int, threads: int) -> System:
    """`edge serve` on a cache folder of its own, fresh: its first start is a first start on a new box (conversion,
    measurements), and measure()'s second start on the same folder is a cached start."""
    cache = tempfile.mkdtemp(prefix="sizes-bench-cache-")
    config = Path(tempfile.mkstemp(suffix=".toml")[1])
    lines = ['log_level = "WARNING"', f"memory_budget = {budget}", f"threads_per_worker = {threads}",
             "[limits]", "shutdown_grace_s = 1.0"]
    config.write_text("\n".join(lines) + "\n")
    return System("ours (edge serve)", Path(gguf).stem, lambda p: [
        "env", f"EDGE_LLM_CACHE={cache}", sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port", str(p),
        "--config", str(config)],
        ready_path="/health")


def llama_cpp(gguf: str, threads: int, slots: int, n_ctx: int, tune: bool, probe_tokens: int,
              burst_options: tuple[str, ...] = ("slots", "ubatch"), log=print) -> System:
    """llama-server at its best setting for `gguf` here, chosen by measuring its options right before the run
    (checks/llama_server_tuning.py), or at `-t threads -np slots` untuned; else the fallbacks (module docstring)."""
    from checks.llama_server import binary_path
    from checks.llama_server_tuning import PeerSetting, choose, system_for
    model_id = Path(gguf).stem
    if binary_path().exists():
        if not tune:
            return system_for(PeerSetting(gguf, "given", threads, slots, n_ctx), model_id)
        log(f"{Path(gguf).name}: choosing llama-server's setting ...")
        setting, probes = choose(gguf, slots, n_ctx, probe_tokens=probe_tokens, burst_options=burst_options, log=log)
        PROBES.setdefault(gguf, []).extend(probes)
        return system_for(setting, model_id)
    if all(importlib.util.find_spec(m) for m in ("uvicorn", "starlette", "sse_starlette", "fastapi")):
        return System("llama_cpp.server (one slot)", model_id, lambda p: [
            sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(p), "--n_threads", str(threads),
            "--n_ctx", str(n_ctx), "--model_alias", model_id])
    return System("llama.cpp (llama-cpp-python Llama, one slot)", model_id, lambda p: [
        sys.executable, "-m", "bench.sizes_bench", "--serve-llama-cpp", gguf, "--port", str(p),
        "--threads", str(threads), "--n-ctx", str(n_ctx)], ready_path="/health")


def serve_llama_cpp(gguf: str, port: int, threads: int, n_ctx: int) -> None:
    """A one-slot OpenAI chat stream around llama-cpp-python's Llama: requests one at a time, ignore_eos as a ban
    on the end-of-generation tokens."""
    from aiohttp import web
    from llama_cpp import Llama
    llm = Llama(gguf, n_ctx=n_ctx, n_threads=threads, n_batch=256, flash_attn=True, verbose=False)
    lock = asyncio.Lock()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bias = {llm.token_eos(): -1e9} if body.get("ignore_eos") else None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop, chunks = asyncio.get_running_loop(), asyncio.Queue()

        def run() -> None:
            for chunk in llm.create_chat_completion(body["messages"], max_tokens=body["max_tokens"], stream=True,
                                                    temperature=0.0, logit_bias=bias):
                loop.call_soon_threadsafe(chunks.put_nowait, chunk)
            loop.call_soon_threadsafe(chunks.put_nowait, None)
        # the stream merges the pieces of a character into one chunk: at "length" the answer is max_tokens long
        tokens, finish = 0, None
        async with lock:
            worker = loop.run_in_executor(None, run)
            while (chunk := await chunks.get()) is not None:
                tokens += any("content" in c.get("delta", {}) for c in chunk["choices"])
                finish = next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")), finish)
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await worker
        tokens = body["max_tokens"] if finish == "length" else tokens
        usage = {"choices": [], "usage": {"completion_tokens": tokens}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def print_table(results: list[dict], models: list[str], concurrency: int, max_tokens: int) -> None:
    print(f"\n| model | system | ready s (first / cached) | idle RSS / PSS MiB | peak RSS / PSS MiB | "
          f"burst {concurrency}x{max_tokens} "
          "out tok/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | single out tok/s | single TTFT s | single TPOT ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, row in zip(models, results):
        idle = row["idle"].values()
        b, s = row["burst"], row["single"]
        cached = "" if row["cached_ready_s"] is None else f" / {row['cached_ready_s']:.1f}"
        print(f"| {Path(model).stem} | {row['name']} | {row['ready_s']:.1f}{cached} | "
              f"{sum(r['rss'] for r in idle) / MIB:.0f} / {sum(r['pss'] for r in idle) / MIB:.0f} | "
              f"{row['peak']['rss'] / MIB:.0f} / {row['peak']['pss'] / MIB:.0f} | {b['out_tok_s']:.1f} | "
              f"{b['ttft'][50]:.2f} / {b['ttft'][99]:.2f} | {b['tpot'][50] * 1e3:.0f} / {b['tpot'][99] * 1e3:.0f} | "
              f"{s['out_tok_s']:.1f} | {s['ttft'][50]:.2f} | {s['tpot'][50] * 1e3:.0f} |")
    for gguf, probes in PROBES.items():
        print(f"\nllama-server's options measured for {Path(gguf).stem} (greedy, each against the best so far):")
        for row in probes:
            extra = (f", prefill {row['prefill_tok_s']:.1f} tok/s, ready {row['ready_s']:.1f} s"
                     if row["probe"] == "single" else f", in {row['wall_s']:.1f} s {' '.join(row['errors'])}")
            print(f"  {row['probe']:6} {row['setting'].label:48} {row['score']:7.2f} out tok/s{extra}")
    print("\nidle, per process (RSS / PSS MiB):")
    for model, row in zip(models, results):
        procs = ", ".join(f"{name} {r['rss'] / MIB:.0f} / {r['pss'] / MIB:.0f}" for name, r in row["idle"].items())
        print(f"  {Path(model).stem}, {row['name']}: {procs}; load average at its end {row['load_average']}, "
              f"OOM kills {row['oom_kills']}, swap used {row['swap_used'] / MIB:.0f} MiB")
        if row["burst"]["errors"] or row["single"]["errors"]:
            print(f"    errors: {row['burst']['errors'] + row['single']['errors']}")


THROUGHPUT_BAR, TPOT_BAR = 1.2, 0.8  # issue 44: at least 1.2x llama-server's burst tok/s, TPOT p50 at most 0.8x


def print_bounds(results: list[dict], models: list[str], concurrency: int) -> None:
    """Ours against llama-server per model (same run), and where ours falls short of a bar, what bounds it, measured:
    the decode step's matrix products as ours runs them (mapped and repacked) against llama.cpp's whole step, one
    sequence and a burst's rows, at one thread and at two (bench.sizes_bounds)."""
    from bench import sizes_bounds
    by_model: dict[str, dict[str, dict]] = {}
    for model, row in zip(models, results):
        by_model.setdefault(model, {})["ours" if row["name"].startswith("ours") else "peer"] = row
    for model, pair in by_model.items():
        if len(pair) < 2:
            continue
        ours_row, peer = pair["ours"], pair["peer"]
        ratio = ours_row["burst"]["out_tok_s"] / max(peer["burst"]["out_tok_s"], 1e-9)
        tpot = ours_row["burst"]["tpot"][50] / max(peer["burst"]["tpot"][50], 1e-9)
        short = ratio < THROUGHPUT_BAR or tpot > TPOT_BAR
        print(f"\n{Path(model).stem}: ours {ratio:.2f}x llama-server's burst out tok/s (bar {THROUGHPUT_BAR}x), "
              f"TPOT p50 {tpot:.2f}x (bar {TPOT_BAR}x): {'short' if short else 'met'}")
        if not short:
            continue
        threads = [1, 2] if (psutil.cpu_count() or 1) > 1 else [1]
        print(f"what bounds it (load average {load_average()}): ms per decode step")
        sizes_bounds.print_table(model, [1, concurrency], threads, 2)
        print("Where ours' products alone reach llama.cpp's whole step, the kernels bound it (the same ggml kernels on "
              "the same blocks); where they are well below, the rest of ours' step (attention, norms, sampling, "
              "Python, the prefill beside decode) does.")


def parse_args(argv=None) -> argparse.Namespace:
    from edge.check_model.command import parse_size
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", help="GGUFs (default: every ladder-*-q4_k_m.gguf in /work/ladder)")
    parser.add_argument("--budget", type=parse_size, default=0, help="memory_budget for ours (default: the box's)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=psutil.cpu_count() or 2)
    parser.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp's context per slot")
    parser.add_argument("--no-tune", action="store_true",
                        help="llama-server at -t THREADS -np CONCURRENCY, its options not measured")
    parser.add_argument("--probe-tokens", type=int, default=16, help="tokens out of each single-stream probe")
    parser.add_argument("--burst-options", default="slots,ubatch",
                        help="llama-server's burst options to measure (of slots, ubatch; '' for none: a large model's "
                             "probes are long)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="each chat's text, in tokens")
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--systems", default="ours,llama.cpp", help="ours, llama.cpp, or both (comma-separated)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--no-bounds", action="store_true",
                        help="where ours falls short of the bars, do not measure what bounds it (bench.sizes_bounds)")
    parser.add_argument("--serve-llama-cpp", metavar="GGUF", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.serve_llama_cpp:
        return serve_llama_cpp(args.serve_llama_cpp, args.port, args.threads, args.n_ctx)
    models = args.models or sorted(str(p) for p in LADDER.glob("ladder-*-q4_k_m.gguf"))
    wanted = args.systems.split(",")
    PROMPT["tokens"] = args.prompt_tokens
    burst_options = tuple(o for o in args.burst_options.split(",") if o)
    results, rows = [], []
    for gguf in models:
        makers = ([lambda: ours(gguf, args.budget, args.threads)] if "ours" in wanted else []) + \
            ([lambda: llama_cpp(gguf, args.threads, args.concurrency, args.n_ctx, not args.no_tune,
                                args.probe_tokens, burst_options)] if "llama.cpp" in wanted else [])
        for make in makers:
            system = make()  # llama-server's options are measured here, right before its run
            print(f"{Path(gguf).name}: {system.name} ... (load average {load_average()})", flush=True)
            results.append(measure(system, args.concurrency, args.max_tokens, args.settle,
                                   cached=system.name.startswith("ours")))
            rows.append(gguf)
    print_table(results, rows, args.concurrency, args.max_tokens)
    if not args.no_bounds:
        print_bounds(results, rows, args.concurrency)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
