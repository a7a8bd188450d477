"""The first burst on a freshly started server (issue 47), a phase of `make bench-slo` (`--first-burst`, or
`--first-burst-only` for this phase alone):

1. one class promising `--burst-ttft-ms` (default 1500) with on_slo_miss = "reject"; `--burst-size` chats of about
   `--burst-tokens` prompt tokens sent at once as soon as /health says ready: how many were served, how many of
   those met the objective, how fast the refusals came (at the client from the send, which counts this client
   creating, connecting and writing the 64 requests on the same cores, and from each request's headers written; and
   the span of the server's refusal log lines at INFO);
   (an earlier start of the same settings, with a class without objectives, served a few requests before it, alone
   and beside decoding, so that a record of the prefill line exists with its beside-decoding line, as on an
   appliance that served before: edge/core/prefill_line.py);
2. the baseline, in the same run and on the same server: prompts of the same size sent one by one, counting how many
   first tokens fit in the objective's time of sequential work (the sum of their TTFTs); the burst's served-in-time
   must be at least 0.8x that count;
3. the same burst (fresh prompts) again after a warm-up, on the same server;
4. fair decode slots: a plain request of 8 tokens alone (its idle time), sent while one request of n = 32 decodes,
   and sent together with four requests of n = 32 (64 tokens each): its whole-answer time. These requests name a
   class of the same priority without objectives (a tenant header), so that none is refused; one that is not served
   fails the bench.

The server keeps its default max_num_seqs (32), so one n = 32 request alone fills the decode batch.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.loadgen import RequestResult, RequestSpec, percentiles, send
from bench.systems import System
from bench.workloads import text_of

TENANT_HEADER, FAIR_TENANT = "x-bench-tenant", "fair"


def fresh_server(gguf: str, threads: int, ttft_slo_ms: int, log_level: str) -> System:
    """ttft_slo_ms 0: a class without objectives (the earlier start's: nothing it sends is refused, so its prefills
    beside decoding are measured and recorded too)."""
    folder = Path(tempfile.mkdtemp(prefix="slo-burst-"))
    objective = f'ttft_slo_ms = {ttft_slo_ms}\non_slo_miss = "reject"\n' if ttft_slo_ms else ""
    # the fair-share phase's requests name the tenant FAIR_TENANT: a class of the same priority without objectives,
    # so none of its n = 32 requests or its plain one is refused (else "beside four" measures beside fewer)
    (folder / "policy.toml").write_text('version = 1\ndefault_class = "chat"\n[classes.chat]\npriority = 0\n'
                                        + objective + '[classes.plain]\npriority = 0\n'
                                        f'[tenants]\nheader = "{TENANT_HEADER}"\n[tenants.classes]\n'
                                        f'{FAIR_TENANT} = "plain"\n')
    (folder / "serve.toml").write_text(f'log_level = "{log_level}"\npolicy = "{folder / "policy.toml"}"\n'
                                       f"threads_per_worker = {threads}\n[limits]\nprefill_queue_size = 512\n")
    return System("ours, first burst", Path(gguf).name.removesuffix(".gguf"), lambda port: [
        sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port", str(port),
        "--config", str(folder / "serve.toml")], ready_path="/health")


_WRITTEN: contextvars.ContextVar[list[float]] = contextvars.ContextVar("written")


async def _headers_sent(session, context, params) -> None:
    """aiohttp's trace hook, in the request's own task: when its request line and headers went out."""
    written = _WRITTEN.get(None)
    if written is not None and not written:
        written.append(time.perf_counter())


async def _all(system: System, specs: list[RequestSpec], extras: list[dict], timeout_s: float,
               headers: dict | None = None, written_s: list | None = None) -> list[RequestResult]:
    """Every spec sent at once; an error status's e2e_s is how long its answer took from the coroutine's start.
    written_s, if given, gets per request the seconds from its headers going out to its answer (None when they never
    went out): what the server took, without the time this client (on the same cores) took to send it, 64 requests
    being created, connected and written one after another by one event loop."""
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_headers_sent)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers, trace_configs=[trace],
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def one(spec: RequestSpec, extra: dict) -> tuple[RequestResult, float | None]:
            written: list[float] = []
            _WRITTEN.set(written)
            sent = time.perf_counter()
            result = await send(session, system.url, system.model, spec, extra)
            ended = time.perf_counter()
            if result.e2e_s is None:  # an error status: how long its answer took
                result.e2e_s = ended - sent
            return result, (ended - written[0] if written else None)
        done = await asyncio.gather(*(one(s, e) for s, e in zip(specs, extras)))
    if written_s is not None:
        written_s.extend(w for _, w in done)
    return [r for r, _ in done]


def burst_specs(args, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    return [RequestSpec(({"role": "user", "content": "Quick question: " + text_of(args.burst_tokens - 30, rng)},),
                        args.burst_max_tokens, ignore_eos=True) for _ in range(args.burst_size)]


async def burst(system: System, args, seed: int) -> dict:
    written: list[float | None] = []
    results = await _all(system, burst_specs(args, seed), [{}] * args.burst_size, 300, written_s=written)
    served = [r for r in results if r.ok]
    refused = [r for r in results if r.status == 429]
    refused_written = [w * 1e3 for r, w in zip(results, written) if r.status == 429 and w is not None]
    slo_s = args.burst_ttft_ms / 1e3
    return {"offered": len(results), "served": len(served), "met": sum(r.ttft_s <= slo_s for r in served),
            "refused": len(refused), "failed": len(results) - len(served) - len(refused),
            "ttft": percentiles([r.ttft_s for r in served], (50, 100)),
            "refusal_ms": percentiles([r.e2e_s * 1e3 for r in refused], (50, 100)),
            "written_ms": percentiles(refused_written, (50, 100))}


def sequential_fit(ttfts_s: list[float], budget_s: float) -> int:
    """How many first tokens fit in budget_s of sequential work: the longest run of requests, sent one after
    another, whose TTFTs sum to at most budget_s."""
    spent, fit = 0.0, 0
    for ttft in ttfts_s:
        spent += ttft
        if spent > budget_s:
            break
        fit += 1
    return fit


async def sequential(system: System, args, seed: int) -> dict:
    """The baseline: burst-sized prompts (fresh ones, so no prompt cache helps) sent one by one until their TTFTs
    sum past the objective; how many fit."""
    slo_s, ttfts = args.burst_ttft_ms / 1e3, []
    for spec in burst_specs(args, seed):
        (result,) = await _all(system, [spec], [{}], 120)
        if not result.ok:
            raise RuntimeError(f"a sequential request failed: {result.status} {result.error}")
        ttfts.append(result.ttft_s)
        if sum(ttfts) > slo_s:
            break
    return {"fit": sequential_fit(ttfts, slo_s), "ttft_s": ttfts}


async def beside_big_n(system: System, args) -> dict:
    """The plain request's whole-answer time alone (idle), sent while one n = 32 request decodes, and sent with four."""
    rng = np.random.default_rng(args.seed + 32)
    big = RequestSpec(({"role": "user", "content": "Tell a story about " + text_of(20, rng)},), 64, ignore_eos=True)
    plain = RequestSpec(({"role": "user", "content": "Say hello."},), 8, ignore_eos=True)
    big_extra = {"n": 32, "temperature": 1.0}
    fair = {TENANT_HEADER: FAIR_TENANT}
    idle = [(await _all(system, [plain], [{}], 120, fair))[0] for _ in range(3)]

    async def one_decoding() -> list[RequestResult]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), headers=fair) as session:
            decoding = asyncio.Event()  # its first content chunk came: it decodes (no longer in prefill)
            big_task = asyncio.ensure_future(send(session, system.url, system.model, big, big_extra,
                                                  on_token=decoding.set))
            await _decoding(decoding, big_task)
            plain_task = asyncio.ensure_future(_all(system, [plain], [{}], 120, fair))
            batches = await _batches_while(session, system, plain_task)
            (result,) = await plain_task
            return [result, await big_task], batches

    beside_one, batches = await one_decoding()
    results = await _all(system, [big] * 4 + [plain], [big_extra] * 4 + [{}], 600, fair)
    failed = [f"{r.status} {r.error}" for r in idle + beside_one + results if not r.ok]
    if failed:
        raise RuntimeError(f"fair-share phase: {len(failed)} requests were not served: {failed[:3]}")
    beside_one = beside_one[0]
    ok_idle = [r.e2e_s for r in idle if r.ok]
    return {"idle_s": float(np.median(ok_idle)) if ok_idle else None, "batches": batches,
            "one_s": beside_one.e2e_s if beside_one.ok else None,
            "plain_s": results[-1].e2e_s if results[-1].ok else None, "plain_status": results[-1].status,
            "big_s": max((r.e2e_s for r in results[:4] if r.ok), default=None)}


async def _batches_while(session: aiohttp.ClientSession, system: System, task: asyncio.Future,
                         every_s: float = 0.05) -> list[int]:
    """The engine's decode batch (/health's engine num_running: the sequences that decode at a step, paused choices
    not counted) as seen every every_s until the task ends; /health's engine stats come with a heartbeat every 0.5 s,
    so a value may be up to that old."""
    seen: list[int] = []
    while not task.done():
        try:
            async with session.get(system.url + "/health") as response:
                engine = (await response.json()).get("engine") or {}
            if not seen or engine.get("num_running") != seen[-1]:
                seen.append(engine.get("num_running"))
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(every_s)
    return seen


async def _decoding(decoding: asyncio.Event, task: asyncio.Future) -> None:
    """Until the request streams its first tokens (/health's engine stats come with a heartbeat every 0.5 s, so a
    count seen there may be an earlier request's: the plain one was then sent during the n = 32 prefill and
    refused); it must not end first."""
    waiting = asyncio.ensure_future(decoding.wait())
    await asyncio.wait([waiting, task], return_when=asyncio.FIRST_COMPLETED)
    if not decoding.is_set():
        waiting.cancel()
        raise RuntimeError("the n = 32 request ended before it streamed a token")


async def earlier_start(system: System, args, seed: int | None = None, alone: int = 8) -> None:
    """What an earlier run of the same settings serves before the measured start: prompts one at a time (prefills
    alone), then eight at once (prefills beside decoding); its gateway records the prefill line it measured."""
    rng = np.random.default_rng(args.seed + 1 if seed is None else seed)
    for i in range(alone):
        spec = RequestSpec(({"role": "user", "content": text_of(40 if i % 2 else 300, rng)},), 4)
        await _all(system, [spec], [{}], 120)
    specs = [RequestSpec(({"role": "user", "content": text_of(40 if i % 2 else 300, rng)},), 48, ignore_eos=True)
             for i in range(8)]
    await _all(system, specs, [{}] * len(specs), 300)


def refusal_span_ms(log_path: Path, since: int) -> float | None:
    """The span between the first and the last refusal line the server logged (INFO) after byte `since` of its log:
    the gateway's own time to refuse the burst, without the client's."""
    try:
        with open(log_path, "rb") as f:
            f.seek(since)
            lines = [line.decode("utf-8", "replace") for line in f if b"refused a request" in line]
    except OSError:
        return None
    stamps = [_stamp(line) for line in lines]
    stamps = [t for t in stamps if t is not None]
    return (max(stamps) - min(stamps)) * 1e3 if len(stamps) > 1 else None


def _stamp(line: str) -> float | None:
    """Seconds of the day of a log line that starts with 'YYYY-MM-DD HH:MM:SS,mmm' (logging's asctime)."""
    try:
        clock = line.split()[1]
        hours, minutes, rest = clock.split(":")
        seconds, millis = rest.split(",")
        return int(hours) * 3600 + int(minutes) * 60 + int(seconds) + int(millis[:3]) / 1e3
    except (IndexError, ValueError):
        return None


def _log_size(system: System) -> int:
    try:
        return Path(system.log).stat().st_size
    except (OSError, TypeError):
        return 0


async def warm_up(system: System, args) -> None:
    """Requests one at a time, then eight at once (the earlier start's workload, on the measured server)."""
    await earlier_start(system, args, seed=args.seed + 2, alone=3)


def run_first_burst(gguf: str, args) -> str:
    earlier = fresh_server(gguf, args.threads, 0, args.log_level)
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
        at = _log_size(system)
        first = asyncio.run(burst(system, args, args.seed + 47))
        first["span_ms"] = refusal_span_ms(Path(system.log), at)
        baseline = asyncio.run(sequential(system, args, args.seed + 48))
        asyncio.run(warm_up(system, args))
        at = _log_size(system)
        warm = asyncio.run(burst(system, args, args.seed + 49))
        warm["span_ms"] = refusal_span_ms(Path(system.log), at)
        fair = asyncio.run(beside_big_n(system, args))
    finally:
        system.stop()
    return table({"fresh start": first, "after a warm-up": warm}, baseline, fair, ready_s, args) + \
        f"\nLog: {system.log}"


def _ms(values: dict, key: str) -> str:
    return "-" if np.isnan(values[key][50]) else f"{values[key][50]:.0f}/{values[key][100]:.0f}"


def table(bursts: dict[str, dict], baseline: dict, fair: dict, ready_s: float, args) -> str:
    def seconds(value: float | None) -> str:
        return f"{value:.2f} s" if value is not None else "failed"
    slo_s = args.burst_ttft_ms / 1e3
    rows = [f"First burst on a fresh server (ready {ready_s:.1f} s after start): {args.burst_size} chats of about "
            f"{args.burst_tokens} prompt tokens at once, TTFT objective {args.burst_ttft_ms} ms, reject. "
            f"Sequential baseline (same server, same prompt size, one by one): {baseline['fit']} first tokens fit in "
            f"{slo_s:g} s (TTFTs {', '.join(f'{t:.2f}' for t in baseline['ttft_s'])} s)",
            "| burst | served | served in time | 0.8x sequential | in time, of served | refused | refusal ms "
            "p50/max (client, from the send) | refusal ms p50/max (client, from its headers written) | refusal "
            "log span ms (server) | failed | TTFT p50/max of served s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, b in bursts.items():
        share = f"{b['met'] / b['served']:.0%}" if b["served"] else "-"
        span = f"{b['span_ms']:.0f}" if b.get("span_ms") is not None else "-"
        ttft = "-" if not b["served"] else f"{b['ttft'][50]:.2f}/{b['ttft'][100]:.2f}"
        rows.append(f"| {name} | {b['served']} | {b['met']} | {0.8 * baseline['fit']:.1f} | {share} | {b['refused']} "
                    f"| {_ms(b, 'refusal_ms')} | {_ms(b, 'written_ms')} | {span} | {b['failed']} | {ttft} |")
    big = seconds(fair["big_s"]) if fair["big_s"] is not None else "-"
    plain = seconds(fair["plain_s"]) if fair["plain_s"] is not None else f"failed ({fair['plain_status']})"
    rows += ["", "A plain 8-token request (whole answer):",
             "| alone (idle) | sent while one n = 32 request decodes | sent with four n = 32 requests (64 tokens) |",
             "|---|---|---|",
             f"| {seconds(fair['idle_s'])} | {seconds(fair['one_s'])} | {plain} (the four: {big}) |",
             f"Decode batch seen on /health while the plain request ran beside one n = 32 request (changes only): "
             f"{fair['batches']}"]
    return "\n".join(rows)
