"""The engine's own decode step on the CPU in float32 and bfloat16, in one run (what `--dtype auto` picks).

    .venv/bin/python -m bench.cpu_dtype_bench [--model PATH] [--batches 1,8,32] [--context 256] [--steps 9]

One llama.cpp prefill (f16 KV) of a --context-token prompt gives the handoff; for each batch size, an engine
per dtype (ModelRunner + paged attention, pool storage following the model dtype as `--kv-storage auto`
does) imports it batch times and steps. Steps alternate between the two engines so that any drift of the
machine hits both alike; each number is the median of --steps steps after one warm-up step. The last
column is the share of rows whose greedy tokens agree between the dtypes over the measured steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from contracts.handoff import SamplingParams
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.model.loader import load_decode_model
from decode_gpu.runner.device import cpu_supports_bfloat16
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16)
TEXT = ("Operators of on-prem appliances care about predictable latency, honest errors and simple configuration. "
        "This paragraph is filler text used to build prompts of a chosen length for the benchmark. ")


def make_engine(model, identity, handoff, batch: int, context: int, steps: int) -> DecodeEngine:
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=(context + steps + 32) * batch), CPU)
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max(batch, 1))))
    for i in range(batch):
        engine.add(dataclasses.replace(handoff, request_id=f"s{i}"))
    return engine


def timed_step(engine: DecodeEngine, tokens: dict[str, list[int]]) -> float:
    started = time.perf_counter()
    events = engine.step()
    elapsed = (time.perf_counter() - started) * 1e3
    for event in events:
        tokens.setdefault(event.request_id, []).extend(event.token_ids)
    return elapsed


def measure(models, identity, handoff, batch: int, context: int, steps: int) -> tuple[dict, float]:
    engines = {dtype: make_engine(model, identity, handoff, batch, context, steps) for dtype, model in models.items()}
    times = {dtype: [] for dtype in engines}
    tokens = {dtype: {} for dtype in engines}
    for engine in engines.values():
        timed_step(engine, {})  # warm-up: the imports and the first step
    for _ in range(steps):
        for dtype, engine in engines.items():
            times[dtype].append(timed_step(engine, tokens[dtype]))
    first, second = (tokens[d] for d in DTYPES)
    agree = sum(first[r] == second.get(r) for r in first) / max(1, len(first))
    return {dtype: statistics.median(t) for dtype, t in times.items()}, agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    prefiller = Prefiller(PrefillConfig(args.model or embedded_model_path(), n_ctx=args.context + 16, kv_type="f16"))
    tokens = tuple(prefiller.tokenize(TEXT * (args.context // 30 + 2))[:args.context])
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8)
    handoff = prefiller.prefill(PrefillRequest("s", tokens, params)).handoff
    identity = prefiller.identity
    prefiller.close()
    models = {dtype: load_decode_model(identity, CPU, dtype) for dtype in DTYPES}
    print(f"\nEngine decode step on the CPU ({torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}, bfloat16 support {cpu_supports_bfloat16()}), "
          f"context {args.context}, median of {args.steps} steps")
    print("| batch | float32 ms | bfloat16 ms | bf16 speed-up | greedy rows agreeing |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        medians, agree = measure(models, identity, handoff, batch, args.context, args.steps)
        fp32, bf16 = medians[torch.float32], medians[torch.bfloat16]
        print(f"| {batch} | {fp32:.1f} | {bf16:.1f} | {fp32 / bf16:.2f}x | {agree:.0%} |", flush=True)


if __name__ == "__main__":
    main()
