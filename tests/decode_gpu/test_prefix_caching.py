"""Prefix caching on the embedded model: 16 requests with one 300-token system prompt hold its blocks once, and
decode exactly what they decode without sharing.

The handoffs come from one llama.cpp worker with its prompt cache, as in serving: the shared prefix is prefilled
once and its cells copied, so every handoff carries the same prefix KV.
"""

import dataclasses

import pytest
import torch

from checks.shared_prefix import BLOCK, N_REQUESTS, SYSTEM_TOKENS, shared_prefix_handoffs
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.prefiller import PrefillConfig, Prefiller

pytestmark = pytest.mark.slow  # the embedded model end to end
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def shared_prefix(embedded_model_path, embedded_float32):
    prefiller = Prefiller(PrefillConfig(embedded_model_path, n_ctx=512, n_threads=2, kv_type="f16",
                                        prefix_cache_tokens=512, prefix_cache_entries=2))
    try:
        handoffs = shared_prefix_handoffs(prefiller)
        identity = prefiller.identity
    finally:
        prefiller.close()
    return identity, embedded_float32, handoffs


def _run(identity, model, handoffs, prefix_caching: bool):
    """Every request's tokens, and the pool blocks in use once all are admitted."""
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=8192, block_size=BLOCK), CPU)
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(prefix_caching=prefix_caching)))
    outputs = {}
    for event in [e for h in handoffs for e in engine.add(h)]:
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
    blocks_in_use = None
    while engine.has_work:
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
        if blocks_in_use is None:
            blocks_in_use = engine.blocks.num_used_blocks
        engine.blocks.check_integrity()
    return outputs, blocks_in_use, engine


def test_sixteen_requests_hold_the_system_prompt_once_and_decode_the_same(shared_prefix):
    identity, model, handoffs = shared_prefix
    private, private_blocks, _ = _run(identity, model, handoffs, prefix_caching=False)
    shared, shared_blocks, engine = _run(identity, model, handoffs, prefix_caching=True)
    assert shared == private
    prefix_blocks = SYSTEM_TOKENS // BLOCK  # the full blocks of the system prompt: 18
    assert private_blocks - shared_blocks == (N_REQUESTS - 1) * prefix_blocks  # held once, not 16 times
    assert shared_blocks <= 0.4 * private_blocks
    assert engine.blocks.num_cache_hits == (N_REQUESTS - 1) * prefix_blocks
    # after the requests end their blocks stay cached: the same prompt again finds every full block of it
    again = dataclasses.replace(handoffs[0], request_id="again")
    engine.add(again)
    engine.step()
    assert engine.blocks.num_cache_hits - (N_REQUESTS - 1) * prefix_blocks == again.n_tokens // BLOCK
