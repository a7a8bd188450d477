"""Prefix sharing in the paged pool: 16 requests with one 300-token system prompt, with and without prefix caching.

    .venv/bin/python -m bench.prefix_bench        # part of `make bench-decode`

Handoffs come from one llama.cpp worker with its prompt cache (the system prompt is prefilled once), f16 KV as
next to the engine. Rows, per run of 16 requests:
  pool blocks in use once all are admitted, and as a fraction of the run without sharing;
  import ms per request: the engine step that imports all 16 (and decodes their first token), divided by 16;
  greedy output: whether the 16 x 16 tokens equal the run without sharing.
Then the wire: what each handoff costs to encode and decode (msgpack) and its bytes, whole, and as it would be if
the worker knew the engine held the prefix and sent only the rest: the measurement behind leaving the worker
as it is (docs/decode.md).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from checks.shared_prefix import BLOCK, N_REQUESTS, SYSTEM_TOKENS, shared_prefix_handoffs
from contracts.handoff import decode_handoff, encode_handoff
from contracts.kv_dtypes import kv_dtype
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.model.loader import load_decode_model
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller

CPU = torch.device("cpu")


def run_engine(identity, model, handoffs, prefix_caching: bool) -> dict:
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=8192, block_size=BLOCK), CPU)
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(prefix_caching=prefix_caching)))
    outputs = {}

    def record(events):
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.token_ids)

    for handoff in handoffs:
        record(engine.add(handoff))
    started = time.perf_counter()
    record(engine.step())  # imports all 16 and decodes their first token
    admit_ms = (time.perf_counter() - started) * 1e3
    blocks = engine.blocks.num_used_blocks
    while engine.has_work:
        record(engine.step())
    return dict(blocks=blocks, import_ms=admit_ms / len(handoffs), outputs=outputs)


def wire_costs(handoff, skip_tokens: int = 0, repeats: int = 5) -> tuple[int, float]:
    """Bytes and encode+decode ms of a handoff, or of the part after its first skip_tokens positions."""
    if skip_tokens:
        lay = handoff.layout
        k_row = kv_dtype(lay.k_dtype).row_bytes(lay.num_kv_heads * lay.head_dim_k)
        v_row = kv_dtype(lay.v_dtype).row_bytes(lay.num_kv_heads * lay.head_dim_v)
        handoff = dataclasses.replace(
            handoff, positions=handoff.positions[skip_tokens:], prompt_tokens=handoff.prompt_tokens[skip_tokens:],
            k_layers=tuple(k[skip_tokens * k_row:] for k in handoff.k_layers),
            v_layers=tuple(v[skip_tokens * v_row:] for v in handoff.v_layers))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        data = encode_handoff(handoff)
        if not skip_tokens:  # a cut handoff is not a valid one on its own: its encoding is the cost that matters
            decode_handoff(data)
        times.append((time.perf_counter() - started) * 1e3)
    return len(data), statistics.median(times)


def main() -> None:
    path = embedded_model_path()
    prefiller = Prefiller(PrefillConfig(path, n_ctx=512, n_threads=2, kv_type="f16", flash_attn=True,
                                        prefix_cache_tokens=512, prefix_cache_entries=2))
    try:
        handoffs = shared_prefix_handoffs(prefiller)
        identity = prefiller.identity
    finally:
        prefiller.close()
    model = load_decode_model(identity, CPU, torch.float32)
    runs = {name: run_engine(identity, model, handoffs, caching) for name, caching in (("off", False), ("on", True))}
    print(f"prefix sharing: {N_REQUESTS} requests, {SYSTEM_TOKENS}-token system prompt, f16 handoffs, "
          f"block {BLOCK}, embedded model on the CPU")
    print(f"{'prefix caching':>15} {'pool blocks':>12} {'vs off':>7} {'import ms/request':>18} "
          f"{'same greedy output':>19}")
    for name, run in runs.items():
        same = run["outputs"] == runs["off"]["outputs"]
        print(f"{name:>15} {run['blocks']:>12} {run['blocks'] / runs['off']['blocks']:>7.2f} "
              f"{run['import_ms']:>18.1f} {str(same):>19}")
    skip = SYSTEM_TOKENS // BLOCK * BLOCK
    whole, whole_ms = wire_costs(handoffs[1])
    rest, rest_ms = wire_costs(handoffs[1], skip)
    print(f"\nthe wire, per request: whole handoff {whole / 1e6:.2f} MB, encode+decode {whole_ms:.1f} ms; "
          f"without the {skip} cached prefix tokens {rest / 1e6:.2f} MB, encode {rest_ms:.1f} ms")


if __name__ == "__main__":
    main()
