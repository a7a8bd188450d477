"""Decode step ms with and without stacked q/k/v and gate/up projections (decode_gpu.model.fused_projections), in one
process, the two engines stepping in turns so that a busy neighbour slows both alike.

    .venv/bin/python -m bench.fusion_bench [--weights int4,bfloat16] [--batches 1,4,16] [--steps 15]

Each weight dtype loads the model twice as `edge serve --weight-dtype X` would (EDGE_FUSED_PROJECTIONS=1, then 0),
each engine decodes `batch` copies of one 256-token prompt; the table gives the median step of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

CONTEXT = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="int4,bfloat16")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    import torch

    from bench.decode_bench import TEXT, _renamed
    from contracts.handoff import SamplingParams
    from decode_gpu.engine import DecodeEngine, EngineConfig
    from decode_gpu.model.weight_quant import load_weights
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    from prefill_cpu.embedded_model import embedded_model_path
    from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
    cpu = torch.device("cpu")
    batches = [int(b) for b in args.batches.split(",")]
    prefiller = Prefiller(PrefillConfig(embedded_model_path(), n_ctx=512, kv_type="f16"))
    tokens = tuple(prefiller.tokenize(TEXT * 8)[:CONTEXT])
    sampling = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    handoff = prefiller.prefill(PrefillRequest("s", tokens, sampling)).handoff
    identity = prefiller.identity
    prefiller.close()
    print("| weight_dtype | batch | stacked ms | separate ms | stacked / separate |")
    print("|---|---|---|---|---|")
    for weights in args.weights.split(","):
        models = {}
        for fused in ("1", "0"):
            os.environ["EDGE_FUSED_PROJECTIONS"] = fused
            models[fused] = load_weights(identity, cpu, torch.bfloat16, weights, max(batches))[0]
        for batch in batches:
            engines = {}
            for fused, model in models.items():
                runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=(CONTEXT + args.steps + 40) * batch),
                                     cpu)
                engines[fused] = DecodeEngine(runner, EngineConfig())
                for i in range(batch):
                    engines[fused].add(_renamed(handoff, f"s{i}"))
                engines[fused].step()  # imports and the first step
            times = {fused: [] for fused in engines}
            for _ in range(args.steps):
                for fused, engine in engines.items():
                    started = time.perf_counter()
                    engine.step()
                    times[fused].append(time.perf_counter() - started)
            stacked, separate = (statistics.median(times[f]) * 1e3 for f in ("1", "0"))
            print(f"| {weights} | {batch} | {stacked:.1f} | {separate:.1f} | {stacked / separate:.2f} |", flush=True)


if __name__ == "__main__":
    main()
