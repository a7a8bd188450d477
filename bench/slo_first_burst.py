"""The first burst on a freshly started server (issue 47), a phase of `make bench-slo` (`--first-burst`, or
`--first-burst-only` for this phase alone):

1. one class promising `--burst-ttft-ms` (default 1500) with on_slo_miss = "reject"; `--burst-size` chats of about
   `--burst-tokens` prompt tokens sent at once as soon as /health says ready: how many were served, how many of
   those met the objective, how fast the refusals came;
   (an earlier start of the same settings served a few requests before it, so that a record of the prefill line
   exists, as on an appliance that served before: edge/core/prefill_line.py);
2. on the same server, a plain request of 8 tokens sent together with four requests of n = 32 (64 tokens each):
   the plain one's whole-answer time (fair decode slots: it must not wait for the others' choices).

The server keeps its default max_num_seqs (32), so one n = 32 request alone fills the decode batch.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.loadgen import RequestResult, RequestSpec, percentiles, send
from bench.systems import System
from bench.workloads import text_of


def fresh_server(gguf: str, threads: int, ttft_slo_ms: int, log_level: str) -> System:
    folder = Path(tempfile.mkdtemp(prefix="slo-burst-"))
    (folder / "policy.toml").write_text(f'version = 1\ndefault_class = "chat"\n[classes.chat]\npriority = 0\n'
                                        f'ttft_slo_ms = {ttft_slo_ms}\non_slo_miss = "reject"\n')
    (folder / "serve.toml").write_text(f'log_level = "{log_level}"\npolicy = "{folder / "policy.toml"}"\n'
                                       f"threads_per_worker = {threads}\n[limits]\nprefill_queue_size = 512\n")
    return System("ours, first burst", Path(gguf).name.removesuffix(".gguf"), lambda port: [
        sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port", str(port),
        "--config", str(folder / "serve.toml")], ready_path="/health")


async def _all(system: System, specs: list[RequestSpec], extras: list[dict], timeout_s: float) -> list[RequestResult]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def one(spec: RequestSpec, extra: dict) -> RequestResult:
            sent = time.perf_counter()
            result = await send(session, system.url, system.model, spec, extra)
            if result.e2e_s is None:  # an error status: how long its answer took
                result.e2e_s = time.perf_counter() - sent
            return result
        return list(await asyncio.gather(*(one(s, e) for s, e in zip(specs, extras))))


async def burst(system: System, args) -> dict:
    rng = np.random.default_rng(args.seed + 47)
    specs = [RequestSpec(({"role": "user", "content": "Quick question: " + text_of(args.burst_tokens - 30, rng)},),
                         args.burst_max_tokens, ignore_eos=True) for _ in range(args.burst_size)]
    results = await _all(system, specs, [{}] * len(specs), 300)
    served = [r for r in results if r.ok]
    refused = [r for r in results if r.status == 429]
    slo_s = args.burst_ttft_ms / 1e3
    return {"offered": len(results), "served": len(served), "met": sum(r.ttft_s <= slo_s for r in served),
            "refused": len(refused), "failed": len(results) - len(served) - len(refused),
            "ttft": percentiles([r.ttft_s for r in served], (50, 100)),
            "refusal_ms": percentiles([r.e2e_s * 1e3 for r in refused], (50, 100))}


async def beside_big_n(system: System, args) -> dict:
    rng = np.random.default_rng(args.seed + 32)
    big = RequestSpec(({"role": "user", "content": "Tell a story about " + text_of(20, rng)},), 64, ignore_eos=True)
    plain = RequestSpec(({"role": "user", "content": "Say hello."},), 8, ignore_eos=True)
    results = await _all(system, [big] * 4 + [plain], [{"n": 32, "temperature": 1.0}] * 4 + [{}], 600)
    return {"plain_s": results[-1].e2e_s if results[-1].ok else None, "plain_status": results[-1].status,
            "big_s": max((r.e2e_s for r in results[:4] if r.ok), default=None)}


async def earlier_start(system: System, args) -> None:
    """What an earlier run of the same settings serves before the measured start: prompts one at a time (prefills
    alone), then eight at once (prefills beside decoding); its gateway records the prefill line it measured."""
    rng = np.random.default_rng(args.seed + 1)
    for i in range(8):
        spec = RequestSpec(({"role": "user", "content": text_of(40 if i % 2 else 300, rng)},), 4)
        await _all(system, [spec], [{}], 120)
    specs = [RequestSpec(({"role": "user", "content": text_of(40 if i % 2 else 300, rng)},), 48, ignore_eos=True)
             for i in range(8)]
    await _all(system, specs, [{}] * len(specs), 300)


def run_first_burst(gguf: str, args) -> str:
    earlier = fresh_server(gguf, args.threads, args.burst_ttft_ms, args.log_level)
    earlier.start()
    try:
        asyncio.run(earlier_start(earlier, args))
    finally:
        earlier.stop()
    system = fresh_server(gguf, args.threads, args.burst_ttft_ms, args.log_level)
    started = time.perf_counter()
    system.start()
    ready_s = time.perf_counter() - started
    try:
        first = asyncio.run(burst(system, args))
        fair = asyncio.run(beside_big_n(system, args))
    finally:
        system.stop()
    return table(first, fair, ready_s, args) + f"\nLog: {system.log}"


def table(first: dict, fair: dict, ready_s: float, args) -> str:
    plain = f"{fair['plain_s']:.1f} s" if fair["plain_s"] is not None else f"failed ({fair['plain_status']})"
    big = f"{fair['big_s']:.1f} s" if fair["big_s"] is not None else "-"
    return "\n".join([
        f"First burst on a fresh server (ready {ready_s:.1f} s after start): {first['offered']} chats of about "
        f"{args.burst_tokens} prompt tokens at once, TTFT objective {args.burst_ttft_ms} ms, reject",
        "| served | met the objective | refused (p50/max ms) | failed | TTFT p50/max of served s |",
        "|---|---|---|---|---|",
        f"| {first['served']} | {first['met']} | {first['refused']} ({first['refusal_ms'][50]:.0f}/"
        f"{first['refusal_ms'][100]:.0f}) | {first['failed']} | {first['ttft'][50]:.2f}/{first['ttft'][100]:.2f} |",
        f"A plain 8-token request sent with four n = 32 requests (64 tokens each): answered in {plain}; "
        f"the four in {big}"])
