"""Time to first token of the real service per handoff KV type, on the local topology (`edge serve`).

    .venv/bin/python -m bench.kv_type_ttft_bench [--kv-types f16,q8_0,q4_0] [--lengths 128,512,1024] [--repeats 5]

For each KV type the service is started (`edge serve --kv-type T`: the gateway launches one prefill worker
and the decode engine next to it, Unix sockets), and prompts of each length are sent one at a time as token
ids to /v1/completions (streamed, greedy, max_tokens 4). Every prompt is new (random ids from a seeded
generator), so the prompt cache never helps. TTFT is from sending the request to the first streamed token;
it holds the gateway, llama.cpp prefill, the KV export, the handoff to the engine and the first token's way
back. One warm-up request per length, then the median of --repeats. --rounds > 1 runs the KV types again
in reverse order (ABBA...), so that a machine drifting over the run does not favour one type.

    .venv/bin/python -m bench.kv_type_ttft_bench --prefill-only [--cases f16:fa0,f16:fa1,q8_0:fa1]

llama.cpp prefill alone (prefill + export, no service) in the worker's configuration as `edge serve` starts
it (n_ctx 4096, n_batch 128, 2048-token prompt cache, all cores), per KV type and flash-attention setting:
it isolates what the KV type and flash attention cost. --prefix-cache-tokens 0 turns the prompt cache off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.systems import System
from contracts.handoff import SamplingParams
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

VOCAB_RANGE = (1000, 40000)  # ordinary tokens of the embedded model's 49152; no control tokens


async def first_token_s(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    started, ttft = time.perf_counter(), None
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:  # read to the end: the next prompt starts on an idle service
            line = raw.decode().strip()
            if ttft is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft


async def measure(url: str, model: str, lengths: list[int], repeats: int, rng) -> dict[int, list[float]]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        times: dict[int, list[float]] = {}
        for n in lengths:
            prompts = [rng.integers(*VOCAB_RANGE, size=n).tolist() for _ in range(repeats + 1)]
            runs = [await first_token_s(session, url, model, p) for p in prompts]
            times[n] = runs[1:]
    return times


def serve(kv_type: str, gguf: str, config: Path) -> System:
    model_id = Path(gguf).name.removesuffix(".gguf")
    return System(f"edge serve --kv-type {kv_type}", model_id, lambda port: [
        sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port", str(port), "--config", str(config),
        "--kv-type", kv_type], ready_path="/health")


def prefill_only(gguf: str, cases: list[str], lengths: list[int], repeats: int, cache_tokens: int) -> None:
    rng = np.random.default_rng(0)
    times: dict[tuple[str, int], float] = {}
    for case in cases:
        kv_type, _, fa = case.partition(":")
        config = PrefillConfig(gguf, n_ctx=4096, n_batch=128, kv_type=kv_type, flash_attn=fa == "fa1",
                               prefix_cache_tokens=cache_tokens)
        prefiller = Prefiller(config)
        for n in lengths:
            runs = []
            for i in range(repeats + 1):
                prompt = tuple(rng.integers(*VOCAB_RANGE, size=n).tolist())
                outcome = prefiller.prefill(PrefillRequest(f"p{i}", prompt, SamplingParams(temperature=0)))
                runs.append((outcome.prefill_s + outcome.export_s) * 1e3)
            times[(case, n)] = statistics.median(runs[1:])
        prefiller.close()
    print(f"\nllama.cpp prefill + export alone (n_ctx 4096, n_batch 128, prompt cache {cache_tokens}); medians in ms")
    print("| tokens | " + " | ".join(f"{c} ms" for c in cases) + " |")
    print("|" + "---|" * (1 + len(cases)))
    for n in lengths:
        print(f"| {n} | " + " | ".join(f"{times[(c, n)]:.0f}" for c in cases) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0")
    parser.add_argument("--lengths", default="128,512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prefill-only", action="store_true", help="llama.cpp alone, no service (see above)")
    parser.add_argument("--cases", default="f16:fa0,f16:fa1,q8_0:fa1", help="with --prefill-only: KV:fa0|fa1")
    parser.add_argument("--prefix-cache-tokens", type=int, default=2048, help="with --prefill-only")
    args = parser.parse_args()
    gguf = args.model or embedded_model_path()
    if args.prefill_only:
        prefill_only(gguf, args.cases.split(","), [int(n) for n in args.lengths.split(",")], args.repeats,
                     args.prefix_cache_tokens)
        return
    config = Path(tempfile.mkstemp(suffix=".toml")[1])
    config.write_text('log_level = "WARNING"\n')
    lengths = [int(n) for n in args.lengths.split(",")]
    kv_types = args.kv_types.split(",")
    rng = np.random.default_rng(0)
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for kv_type in kv_types if round_ % 2 == 0 else kv_types[::-1]:
            system = serve(kv_type, gguf, config)
            system.start()
            try:
                for n, runs in asyncio.run(measure(system.url, system.model, lengths, args.repeats, rng)).items():
                    times.setdefault((kv_type, n), []).extend(runs)
            finally:
                system.stop()
    print_table(times, kv_types, lengths)


def print_table(times: dict, kv_types: list[str], lengths: list[int]) -> None:
    print(f"\nTTFT through `edge serve` (local workers, Unix sockets); medians in ms, "
          f"{len(next(iter(times.values())))} requests each")
    print("| tokens | " + " | ".join(f"{kv} ms" for kv in kv_types) + " | " +
          " | ".join(f"{kv} vs {kv_types[0]}" for kv in kv_types[1:]) + " |")
    print("|" + "---|" * (1 + 2 * len(kv_types) - 1))
    for n in lengths:
        medians = [statistics.median(times[(kv, n)]) * 1e3 for kv in kv_types]
        print(f"| {n} | " + " | ".join(f"{m:.0f}" for m in medians) + " | " +
              " | ".join(f"{m / medians[0] - 1:+.0%}" for m in medians[1:]) + " |")


if __name__ == "__main__":
    main()
