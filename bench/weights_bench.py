"""The decode step by weight_dtype: step ms at each batch size and the engine process's memory.

    .venv/bin/python -m bench.weights_bench [--weights float32,bfloat16,int8,int4,q8_0,auto] [--batches 1,8,32]

Also a part of `make bench-decode`. Each weight dtype runs in a process of its own (its RSS is then its own):
the model loaded and quantized as `edge serve --weight-dtype X` would, an engine with `batch` copies of one
256-token prompt, the median of 9 steps. The float32 row is the path the decode engine ran on this CPU before
bfloat16 and quantized weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CONTEXT = 256
WEIGHTS = "float32,bfloat16,int8,int4,q8_0,auto"  # the rows of a run, make bench-decode's too


def child(weight_dtype: str, batches: list[int], model_path: str | None) -> dict:
    import psutil
    import torch

    from bench.decode_bench import TEXT, _renamed, _timed
    from contracts.handoff import SamplingParams
    from decode_gpu.engine import DecodeEngine, EngineConfig
    from decode_gpu.model.weight_quant import FLOAT_WEIGHTS, load_weights
    from decode_gpu.runner.device import resolve_dtype
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    from prefill_cpu.embedded_model import embedded_model_path
    from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
    cpu = torch.device("cpu")
    prefiller = Prefiller(PrefillConfig(model_path or embedded_model_path(), n_ctx=512, kv_type="f16"))
    tokens = tuple(prefiller.tokenize(TEXT * 8)[:CONTEXT])
    handoff = prefiller.prefill(PrefillRequest("s", tokens, SamplingParams(temperature=0.0, max_tokens=64))).handoff
    identity = prefiller.identity
    prefiller.close()
    dtype = FLOAT_WEIGHTS.get(weight_dtype) or resolve_dtype("auto", cpu)
    before = psutil.Process().memory_info().rss
    model, report = load_weights(identity, cpu, dtype, weight_dtype, max(batches))
    steps = {}
    for batch in batches:
        runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=(CONTEXT + 80) * batch), cpu)
        engine = DecodeEngine(runner, EngineConfig())
        for i in range(batch):
            engine.add(_renamed(handoff, f"s{i}"))
        engine.step()  # imports and the first step
        steps[batch] = _timed(engine.step, 9, cpu)
    return {"held": report.weight_dtype, "weight_mib": report.total_bytes / 2**20, "steps": steps,
            "rss_mib": (psutil.Process().memory_info().rss - before) / 2**20}


def weight_rows(weights: list[str], batches: list[int], model_path: str | None = None) -> list[tuple[str, dict]]:
    rows = []
    for weight_dtype in weights:
        command = [sys.executable, "-m", "bench.weights_bench", "--child", weight_dtype,
                   "--batches", ",".join(map(str, batches))] + (["--model", model_path] if model_path else [])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            rows.append((weight_dtype, {"error": done.stderr.strip().splitlines()[-1:]}))
            continue
        rows.append((weight_dtype, json.loads(done.stdout.strip().splitlines()[-1])))
    return rows


def print_weight_rows(rows: list[tuple[str, dict]], batches: list[int]) -> None:
    print(f"\nDecode step by weight_dtype on the CPU (context {CONTEXT}, median of 9 steps; RSS: the engine "
          f"process's growth from loading the model and running the steps)")
    print("| weight_dtype | held as | weights MiB | " + " | ".join(f"step ms b{b}" for b in batches)
          + " | RSS MiB |")
    print("|---|---|---|" + "---|" * len(batches) + "---|")
    for name, r in rows:
        if "error" in r:
            print(f"| {name} | failed: {' '.join(r['error'])} |")
            continue
        steps = " | ".join(f"{r['steps'][str(b)]:.1f}" for b in batches)
        print(f"| {name} | {r['held']} | {r['weight_mib']:.0f} | {steps} | {r['rss_mib']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default=WEIGHTS)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(child(args.child, batches, args.model)))
        return
    print_weight_rows(weight_rows(args.weights.split(","), batches, args.model), batches)


if __name__ == "__main__":
    main()
