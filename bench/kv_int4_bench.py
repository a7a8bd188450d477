"""int4 against int8 KV pool storage on the embedded model: tokens a pool holds for a byte budget, and the step.

    .venv/bin/python -m bench.kv_int4_bench [--device auto] [--batches 1,8,32] [--budget-mib 64]

Rows per storage: pool bytes per token (K and V of every layer, codes plus group scales), the tokens a pool of
--budget-mib holds, and the median decode step (of 9) at each batch size with a 256-token context from one
llama.cpp q8_0 handoff copied per row, prefix caching off (as bench/decode_bench.py times steps). The storages
alternate inside each batch size, so a drift of the machine's load falls on both.
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
from decode_gpu.kv.pool import bytes_per_token
from decode_gpu.model.loader import load_decode_model
from decode_gpu.runner.device import resolve_device, resolve_dtype
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

STORAGES = ("int8", "int4")
CONTEXT, STEPS = 256, 9
TEXT = ("Operators of on-prem appliances care about predictable latency, honest errors and simple configuration. "
        "This paragraph is filler text used to build prompts of a chosen length for the benchmark. ")


def kv_int4_rows(prefiller: Prefiller, model, device: torch.device, batches: list[int],
                 budget_bytes: int) -> list[dict]:
    """One row per storage: bytes per token, tokens in budget_bytes, and {batch: median step ms}."""
    ident = prefiller.identity
    tokens = tuple(prefiller.tokenize(TEXT * 8)[:CONTEXT])
    handoff = prefiller.prefill(PrefillRequest("s", tokens, SamplingParams(temperature=0.0, max_tokens=64))).handoff
    rows = []
    for storage in STORAGES:
        per_token = bytes_per_token(ident.n_layer, ident.num_kv_heads, ident.head_dim_k, storage)
        rows.append(dict(storage=storage, per_token=per_token, tokens=budget_bytes // per_token, steps={}))
    for batch in batches:
        for row in rows:
            row["steps"][batch] = step_ms(model, ident, device, handoff, batch, row["storage"])
    return rows


def step_ms(model, ident, device: torch.device, handoff, batch: int, storage: str) -> float:
    """Median decode step of `batch` copies of the handoff with this pool storage."""
    runner = ModelRunner(model, ident, RunnerConfig(kv_cache_tokens=(CONTEXT + 80) * batch, kv_storage=storage),
                         device)
    # private copies: every row holds (and the step reads) its own context, as distinct prompts would
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(prefix_caching=False)))
    for i in range(batch):
        engine.add(dataclasses.replace(handoff, request_id=f"s{i}"))
    engine.step()  # the imports and the first step
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def print_kv_int4_rows(rows: list[dict], batches: list[int], budget_bytes: int, device: torch.device,
                       dtype: torch.dtype) -> None:
    print(f"\nKV pool storage, int8 against int4 ({device}, model {dtype}; step: median of {STEPS}, context "
          f"{CONTEXT})")
    print(f"| storage | bytes/token | tokens in {budget_bytes / 2**20:.0f} MiB | "
          + " | ".join(f"step ms b{b}" for b in batches) + " |")
    print("|---|---|---|" + "---|" * len(batches))
    for row in rows:
        print(f"| {row['storage']} | {row['per_token']} | {row['tokens']} | "
              + " | ".join(f"{row['steps'][b]:.1f}" for b in batches) + " |")
    base, new = rows[0], rows[1]
    print(f"| int4 / int8 | {new['per_token'] / base['per_token']:.2f}x | {new['tokens'] / base['tokens']:.2f}x | "
          + " | ".join(f"{new['steps'][b] / base['steps'][b]:.2f}x" for b in batches) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--budget-mib", type=int, default=64, help="pool bytes the token counts are for")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    batches = [int(b) for b in args.batches.split(",")]
    prefiller = Prefiller(PrefillConfig(args.model or embedded_model_path(), n_ctx=1100, kv_type="q8_0"))
    try:
        model = load_decode_model(prefiller.identity, device, dtype)
        rows = kv_int4_rows(prefiller, model, device, batches, args.budget_mib * 2**20)
    finally:
        prefiller.close()
    print_kv_int4_rows(rows, batches, args.budget_mib * 2**20, device, dtype)


if __name__ == "__main__":
    main()
