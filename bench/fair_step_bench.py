"""A plain request beside one with n = 32, the engine alone (issue 47): the share of a step's time
(`SchedulerConfig.share_step_factor`, decode_gpu/core/fair_share.py `step_budget`) against slots only (factor 0), in one
run.

    .venv/bin/python -m bench.fair_step_bench [--rounds 3] [--factor 2]

Two engines on the CPU (the embedded model, llama.cpp prefill for the handoffs), one per factor; rounds alternate
between them so that the machine's drift hits both alike. Each round, per engine: a plain request of 8 tokens alone
(its decode steps: the idle time), then a request with n = 32 (64 tokens each, sampled) decoding, and after its third
step the plain request again: the plain one's decode time from its handoff to its last token, the decode batch of
those steps, and the n = 32 request's tokens a second over the same window. The plain request's prefill is not in
these times (the served bench, bench/slo_first_burst.py, has the whole answer).
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
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

CPU = torch.device("cpu")
BIG_N, BIG_TOKENS, PLAIN_TOKENS = 32, 64, 8


def handoffs(model: str):
    prefiller = Prefiller(PrefillConfig(model, n_ctx=256, kv_type="f16"))
    try:
        big = prefiller.prefill(PrefillRequest("big", tuple(prefiller.tokenize("Tell a story about a lighthouse.")),
                                               SamplingParams(temperature=1.0, n=BIG_N, max_tokens=BIG_TOKENS,
                                                              ignore_eos=True))).handoff
        plain = prefiller.prefill(PrefillRequest("plain", tuple(prefiller.tokenize("Say hello.")),
                                                 SamplingParams(temperature=0.0, max_tokens=PLAIN_TOKENS,
                                                                ignore_eos=True))).handoff
        return prefiller.identity, big, plain
    finally:
        prefiller.close()


def until_done(engine: DecodeEngine, request_id: str, other: str | None = None) -> tuple[float, list[int], int]:
    """Step until request_id ends: (seconds, decode batch of each step, tokens `other` got meanwhile)."""
    started, batches, others = time.perf_counter(), [], 0
    while request_id in engine.requests:
        events = engine.step()
        batches.append(engine.scheduler.num_running)
        others += sum(len(e.token_ids) for e in events if e.request_id == other)
    return time.perf_counter() - started, batches, others


def round_on(engine: DecodeEngine, big, plain, index: int) -> dict:
    alone_id = f"alone{index}"
    engine.add(dataclasses.replace(plain, request_id=alone_id))
    alone_s, _, _ = until_done(engine, alone_id)
    big_id, plain_id = f"big{index}", f"plain{index}"
    engine.add(dataclasses.replace(big, request_id=big_id))
    for _ in range(3):
        engine.step()
    engine.add(dataclasses.replace(plain, request_id=plain_id))
    beside_s, batches, big_tokens = until_done(engine, plain_id, big_id)
    engine.abort(big_id)
    while engine.has_work:
        engine.step()
    return {"alone_s": alone_s, "beside_s": beside_s, "batch": statistics.median(batches),
            "big_tok_s": big_tokens / beside_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--factor", type=float, default=1.25, help="share_step_factor measured against 0 (slots only)")
    args = parser.parse_args()
    identity, big, plain = handoffs(args.model or embedded_model_path())
    model = load_decode_model(identity, CPU, torch.float32)
    engines = {}
    for factor in (args.factor, 0.0):
        runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=(BIG_N + 1) * 512), CPU)
        engines[factor] = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=BIG_N,
                                                                                      share_step_factor=factor)))
    results = {factor: [] for factor in engines}
    for index in range(args.rounds + 1):  # the first round warms up (imports, the first steps, the step curve)
        for factor, engine in engines.items():
            found = round_on(engine, big, plain, index)
            if index:
                results[factor].append(found)
    print(f"\nA plain request ({PLAIN_TOKENS} tokens) beside one with n = {BIG_N} ({BIG_TOKENS} tokens), decode only, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print("| share_step_factor | plain alone s | plain beside n = 32 s | beside / alone | decode batch (median) "
          "| n = 32 tok/s meanwhile |")
    print("|---|---|---|---|---|---|")
    for factor, rounds in results.items():
        med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        print(f"| {factor:g}{' (slots only)' if not factor else ''} | {med['alone_s']:.3f} | {med['beside_s']:.3f} | "
              f"{med['beside_s'] / med['alone_s']:.1f}x | {med['batch']:.0f} | {med['big_tok_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
