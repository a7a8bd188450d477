"""Decode and llama.cpp prefill on the same cores: the engine's decode step and the prefill rate, each alone and
side by side at several thread splits, in one run (why contracts/cpu_share.py exists).

    .venv/bin/python -m bench.cpu_share_bench [--batch 8] [--steps 60] [--splits 2+2,1+2,1+1,2+1]

A split "d+p" runs decode with d torch threads next to a prefill process looping over 256-token prompts with
p llama.cpp threads. Decode: median ms of --steps engine steps (batch --batch, context 256, bfloat16 when the
CPU has it). Prefill: prompt tokens per second over the window in which those steps ran.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from bench.cpu_dtype_bench import TEXT, make_engine
from contracts.handoff import SamplingParams
from decode_gpu.model.loader import load_decode_model
from decode_gpu.runner.device import resolve_dtype
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

CPU = torch.device("cpu")
CONTEXT = 256


def prefill_loop(threads: int) -> None:
    """Child process: prefill 256-token prompts until stdin closes, printing `wall-clock-time tokens-so-far`."""
    prefiller = Prefiller(PrefillConfig(embedded_model_path(), n_ctx=600, kv_type="f16", n_threads=threads))
    base = prefiller.tokenize(TEXT * 40)
    print("ready", flush=True)
    done = 0
    for i in range(10**9):
        tokens = tuple(base[i % 50:i % 50 + 256])
        prefiller.prefill(PrefillRequest(f"r{i}", tokens, SamplingParams(temperature=0.0, max_tokens=1)))
        done += len(tokens)
        print(f"{time.time()} {done}", flush=True)


def decode_ms(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def prefill_rate(threads: int, during) -> tuple[float, float]:
    """Run `during()` (returns decode ms, or None for prefill alone) next to a prefill loop; (decode ms, tok/s)."""
    child = subprocess.Popen([sys.executable, "-m", "bench.cpu_share_bench", "--child", str(threads)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.stdout.readline()  # the first prompt: warm-up
    start = time.time()
    ms = during()
    end = time.time()
    child.kill()
    stamps = [tuple(map(float, line.split())) for line in child.stdout.read().splitlines() if line.strip()]
    inside = [(t, n) for t, n in stamps if start <= t <= end]
    rate = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]) if len(inside) > 1 else float("nan")
    return ms, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--splits", default="2+2,1+2,1+1,2+1")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return prefill_loop(args.child)
    cores = torch.get_num_threads()
    prefiller = Prefiller(PrefillConfig(embedded_model_path(), n_ctx=CONTEXT + 16, kv_type="f16"))
    tokens = tuple(prefiller.tokenize(TEXT * (CONTEXT // 30 + 2))[:CONTEXT])
    params = SamplingParams(temperature=0.0, max_tokens=20 * args.steps)
    handoff = prefiller.prefill(PrefillRequest("s", tokens, params)).handoff
    identity = prefiller.identity
    prefiller.close()
    dtype = resolve_dtype("auto", CPU)
    engine = make_engine(load_decode_model(identity, CPU, dtype), identity, handoff, args.batch, CONTEXT,
                         20 * args.steps)
    engine.step()
    print(f"\nDecode (batch {args.batch}, context {CONTEXT}, {dtype}) next to llama.cpp prefill of 256-token "
          f"prompts, {cores} cores; median of {args.steps} steps")
    print("| decode threads + prefill threads | decode step ms | prefill tok/s |")
    print("|---|---|---|")
    torch.set_num_threads(cores)
    print(f"| decode alone, {cores} | {decode_ms(engine, args.steps):.1f} | - |", flush=True)
    for threads in sorted({cores, max(1, cores // 2)}, reverse=True):
        _, rate = prefill_rate(threads, lambda: time.sleep(8) or None)
        print(f"| prefill alone, {threads} | - | {rate:.0f} |", flush=True)
    for split in args.splits.split(","):
        decode_threads, prefill_threads = map(int, split.split("+"))
        torch.set_num_threads(decode_threads)
        ms, rate = prefill_rate(prefill_threads, lambda: decode_ms(engine, args.steps))
        print(f"| {decode_threads} + {prefill_threads} | {ms:.1f} | {rate:.0f} |", flush=True)


if __name__ == "__main__":
    main()
