"""Swap against recompute preemption under a pool too small for the load, on the embedded model.

    .venv/bin/python -m bench.preemption_bench        # part of `make bench-decode`

Eight requests of 200-token prompts, 64 greedy output tokens each, arriving two per step into an engine whose pool
holds about half of them: later, more important requests (lower priority numbers) preempt earlier ones. "swap"
copies a victim's KV to host memory and back; "recompute" frees it and has llama.cpp prefill the victim's prompt and
output again (its worker's prompt cache finds the prompt), then imports that. Rows: wall time to finish all,
preemptions, the time spent re-prefilling, and whether the tokens equal a run with room for everyone. On this box
prefill and decode share two cores; on the appliance the recompute runs on the CPU while the GPU decodes.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from contracts.handoff import SamplingParams
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.model.loader import load_decode_model
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

TEXT = ("Operators of on-prem appliances care about predictable latency, honest errors and simple configuration. "
        "This paragraph is filler text used to build prompts of a chosen length for the benchmark. ")
N_REQUESTS, PROMPT, OUTPUT, BLOCK = 8, 200, 64, 16
CPU = torch.device("cpu")


def run(identity, model, prefiller, handoffs, kv_tokens: int, mode: str) -> dict:
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=kv_tokens, block_size=BLOCK), CPU)
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(preemption_mode=mode)))
    outputs, recompute_s, pending = {}, 0.0, list(handoffs)
    started = time.perf_counter()
    while pending or engine.has_work:
        for handoff in pending[:2]:
            for event in engine.add(handoff):
                outputs.setdefault(event.request_id, []).extend(event.token_ids)
        pending = pending[2:]
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
        for seq in engine.recompute_requests:
            t = time.perf_counter()
            done = prefiller.prefill(PrefillRequest(seq.request_id, tuple(seq.tokens[:-1]), seq.sampling, seq.priority))
            engine.add(dataclasses.replace(done.handoff, resume_index=seq.index))
            recompute_s += time.perf_counter() - t
        engine.recompute_requests.clear()
    return dict(wall=time.perf_counter() - started, preemptions=engine.stats().num_preemptions,
                recompute_s=recompute_s, outputs=outputs)


def main() -> None:
    prefiller = Prefiller(PrefillConfig(embedded_model_path(), n_ctx=512, n_threads=2, kv_type="f16",
                                        prefix_cache_tokens=2048, prefix_cache_entries=8))
    base = prefiller.tokenize(TEXT * 40)
    handoffs = [prefiller.prefill(PrefillRequest(
        f"r{i}", tuple(base[i * 11:i * 11 + PROMPT]), SamplingParams(temperature=0.0, max_tokens=OUTPUT),
        priority=N_REQUESTS - i)).handoff for i in range(N_REQUESTS)]
    identity = prefiller.identity
    model = load_decode_model(identity, CPU, torch.float32)
    roomy = run(identity, model, prefiller, handoffs, 8192, "swap")
    tight = (PROMPT + OUTPUT) * N_REQUESTS // 2
    print(f"preemption: {N_REQUESTS} requests of {PROMPT} prompt + {OUTPUT} output tokens, two arriving per step, "
          f"later ones more important; pool {tight} tokens (room for everyone: {roomy['wall']:.1f} s)")
    print(f"{'mode':>10} {'wall s':>7} {'preemptions':>12} {'re-prefill s':>13} {'same tokens':>12}")
    for mode in ("swap", "recompute"):
        result = run(identity, model, prefiller, handoffs, tight, mode)
        print(f"{mode:>10} {result['wall']:>7.1f} {result['preemptions']:>12} {result['recompute_s']:>13.1f} "
              f"{str(result['outputs'] == roomy['outputs']):>12}")
    prefiller.close()


if __name__ == "__main__":
    main()
