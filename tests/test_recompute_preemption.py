"""Preemption by recompute: a preempted sequence's blocks are freed, its prompt and output (but the newest token)
are prefilled again by a real llama.cpp worker at its priority, and it resumes from that handoff with the tokens it
would have decoded without preemption.

The engine's part is here; the loop that takes its recompute requests to a prefill worker plays the gateway's
part (which `edge serve` does not have yet: preemption_mode stays "swap" there).
"""

import dataclasses

import pytest
import torch

from contracts.handoff import SamplingParams
from contracts.identity import read_gguf_identity
from decode_gpu.engine import DecodeEngine, EngineConfig, HandoffRejectedError
from decode_gpu.model_loader import load_decode_model
from decode_gpu.model_runner import ModelRunner, RunnerConfig
from decode_gpu.scheduler import SchedulerConfig
from decode_gpu.sequence import SeqState
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
from test_handoff_tiny_models import prompts

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_gguf, conversion_cache):
    path = tiny_gguf("llama", "f32")
    identity = read_gguf_identity(str(path))
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_batch=64, n_threads=2, kv_type="f16"))
    yield identity, load_decode_model(identity, CPU, torch.float32, conversion_cache), prefiller
    prefiller.close()


def _engine(identity, model, kv_tokens: int, mode: str) -> DecodeEngine:
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=kv_tokens, block_size=16), CPU)
    return DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(preemption_mode=mode)))


def _run(engine: DecodeEngine, prefiller: Prefiller, background, interactive) -> dict[str, list[int]]:
    """The background request decodes a few steps, then the interactive one arrives; recompute requests are
    prefilled as a gateway would, at the victim's priority."""
    outputs: dict[str, list[int]] = {}

    def record(events):
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.token_ids)

    record(engine.add(background))
    for _ in range(4):
        record(engine.step())
    record(engine.add(interactive))
    while engine.has_work:
        record(engine.step())
        for seq in engine.recompute_requests:
            tokens = tuple(seq.tokens[:-1])
            handoff = prefiller.prefill(PrefillRequest(seq.request_id, tokens, seq.sampling, seq.priority)).handoff
            engine.add(dataclasses.replace(handoff, resume_index=seq.index))
        engine.recompute_requests.clear()
        engine.blocks.check_integrity()
    assert engine.blocks.num_used_blocks == 0
    return outputs


def test_a_sequence_preempted_by_recompute_decodes_what_it_decodes_without_preemption(tiny):
    identity, model, prefiller = tiny
    long_prompt, short_prompt = prompts()[2], prompts()[1]  # 75 and 40 tokens
    background = prefiller.prefill(PrefillRequest("background", long_prompt,
                                                  SamplingParams(temperature=0.0, max_tokens=40), priority=5)).handoff
    interactive = prefiller.prefill(PrefillRequest("interactive", short_prompt,
                                                   SamplingParams(temperature=0.0, max_tokens=20))).handoff
    alone = _run(_engine(identity, model, 4096, "recompute"), prefiller, background, interactive)
    engine = _engine(identity, model, 128, "recompute")  # 8 blocks: the two cannot fit together
    preempted = _run(engine, prefiller, background, interactive)
    assert engine.stats().num_preemptions >= 1
    assert preempted == alone
    swapped_engine = _engine(identity, model, 128, "swap")
    assert _run(swapped_engine, prefiller, background, interactive) == alone
    assert swapped_engine.stats().num_preemptions >= 1


def test_a_recompute_that_does_not_match_a_preempted_choice_is_refused(tiny):
    identity, model, prefiller = tiny
    engine = _engine(identity, model, 1024, "recompute")
    handoff = prefiller.prefill(PrefillRequest("r", prompts()[0], SamplingParams(temperature=0.0, max_tokens=8))).handoff
    with pytest.raises(HandoffRejectedError, match="waiting for a recompute"):
        engine.add(dataclasses.replace(handoff, resume_index=0))
    engine.add(handoff)
    engine.step()
    seq = engine.requests["r"][0]
    seq.state = SeqState.RECOMPUTING  # as if preempted (its blocks stay held here: only the check is under test)
    with pytest.raises(HandoffRejectedError, match="not its"):
        engine.add(dataclasses.replace(handoff, resume_index=0))  # the prompt alone, not the prompt and output


def test_an_unknown_preemption_mode_is_refused():
    with pytest.raises(ValueError, match="preemption_mode must be one of swap, recompute"):
        SchedulerConfig(preemption_mode="drop")
