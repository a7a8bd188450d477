"""The decode engine on the embedded model: batching and preemption never change greedy outputs."""

import pytest
import torch

from contracts.handoff import SamplingParams
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
TEXT = ("Operators of on-prem appliances care about predictable latency, honest errors and simple configuration. "
        "This paragraph is filler text used to build prompts of a chosen length for the engine tests. ")


@pytest.fixture(scope="module")
def workload(embedded_model_path, embedded_float32):
    """16 requests: prompt lengths 64/256/1024 in a 6:3:1 mix (10/5/1), output lengths 18 to 30.

    Every output crosses a 16-token block boundary, so a full pool must preempt to let them grow."""
    prefiller = Prefiller(PrefillConfig(embedded_model_path, n_ctx=1100, n_threads=2, kv_type="q8_0"))
    try:
        base = prefiller.tokenize(TEXT * 60)
        lengths = [64] * 10 + [256] * 5 + [1024]
        handoffs = []
        for i, n in enumerate(lengths):
            tokens = tuple(base[i * 7:i * 7 + n])  # different offsets: different prompts
            params = SamplingParams(temperature=0.0, max_tokens=[18, 22, 26, 30][i % 4])
            handoffs.append(prefiller.prefill(PrefillRequest(f"req{i:02d}", tokens, params)).handoff)
        identity = prefiller.identity
    finally:
        prefiller.close()
    return identity, embedded_float32, handoffs


def run(identity, model, handoffs, kv_tokens, max_num_seqs=32):
    from decode_gpu.core.scheduler import SchedulerConfig
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=kv_tokens), CPU)
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)))
    outputs = {}
    for handoff in handoffs:
        for event in engine.add(handoff):
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    while engine.has_work:
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
        engine.blocks.check_integrity()
    return outputs, engine.stats()


def test_batched_equals_alone_and_survives_a_small_pool(workload):
    identity, model, handoffs = workload
    alone = {}
    for handoff in handoffs:
        alone.update(run(identity, model, [handoff], kv_tokens=2048)[0])
    batched, stats = run(identity, model, handoffs, kv_tokens=8192)
    assert stats.num_preemptions == 0
    assert batched == alone
    # 16 requests need ~3.3k positions at once: their prompts take 184 blocks and each output two more. 208 blocks
    # (3328 tokens) admit every prompt and its first new block, and the growth past each output's 16th token forces
    # a swap (the 1024-token request's 65 blocks out and back in: 200 to 215 blocks do), in about as many steps as
    # the batched run (a pool that fits the longest prompt alone swaps too, but runs three times the steps)
    squeezed, stats = run(identity, model, handoffs, kv_tokens=3328)
    assert stats.num_preemptions > 0
    assert squeezed == alone
    # no EOS or stop ids are configured here, so every request runs to exactly its max_tokens
    assert {h.request_id: len(alone[h.request_id]) for h in handoffs} == \
        {h.request_id: h.sampling.max_tokens for h in handoffs}
