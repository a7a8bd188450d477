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
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.core.sequence import SeqState
from decode_gpu.engine import DecodeEngine, EngineConfig, HandoffRejectedError
from decode_gpu.model.loader import load_decode_model
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
from tiny_gguf import prompts

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


@pytest.mark.slow
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


SERVE = """
kv_cache_tokens = 192
max_model_len = 192
preemption_mode = "recompute"
prefix_cache_tokens = 1024
"""
# no degradation tiers: a busy tier on a loaded 2-core box would change the KV type and with it the text
POLICY = """
version = 1
"""


@pytest.mark.slow
def test_edge_serve_recomputes_a_preempted_request_on_a_worker_and_it_finishes_with_its_own_text(tmp_path):
    """Through the gateway: a background stream holds most of a 12-block pool; a more important request preempts it
    by recompute; a worker prefills the background's prompt and output again, and both finish with every token.
    The text after the preemption may differ from the text alone here: llama.cpp recomputes the output's KV with
    the GGUF's Q4_1 weights, the engine had made it with its own int8/bfloat16 ones (the engine test above, with
    the same float weights on both sides, holds the tokens to equality)."""
    import threading

    import httpx

    from server_process import ServerProcess
    server = ServerProcess(SERVE, tmp_path, POLICY).start()
    try:
        def complete(prompt: str, max_tokens: int, priority: int) -> int:
            response = httpx.post(server.base + "/v1/completions", timeout=120, json={
                "model": server.health()["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "priority": priority})
            assert response.status_code == 200, response.text
            return response.json()["usage"]["completion_tokens"]

        background = "Write a long story about a lighthouse keeper who counts the ships that pass at night. " * 2
        interactive = "List the steps to change a bicycle tire, one per line, with a short note for each step. " * 2
        results = {}
        thread = threading.Thread(target=lambda: results.setdefault("background", complete(background, 100, 5)))
        thread.start()
        assert wait_decoding(server)
        results["interactive"] = complete(interactive, 60, 0)
        thread.join(timeout=120)
        assert results == {"background": 100, "interactive": 60}
        assert server.metric("vllm:num_preemptions_total") >= 1
        assert "recomputing choice 0 of" in server.log_path.read_text()
    finally:
        server.stop()


def wait_decoding(server) -> bool:
    from server_process import wait_for
    return wait_for(lambda: server.metric("vllm:num_requests_running") >= 1, 30)


def test_a_recompute_that_cannot_be_queued_ends_its_request_with_503_saying_why():
    """A full prefill queue: the handler gets a 503 kv_cache_full naming the preemption, not a silent abort."""
    from contracts.messages import PrefillFailed, Recompute
    from edge.api.errors import prefill_error
    from edge.config import ServeConfig
    from edge.core.engine_client import EngineClient
    from edge.core.gateway import Gateway
    from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus
    from edge.core.metrics import Metrics
    from edge.core.prefill_pool import QueueFullError
    from policies.enforcer import PolicyEnforcer
    from policies.schema import Policy

    class FullPool:
        def submit(self, job):
            raise QueueFullError("the prefill queue is full (4 prompts waiting)")

    registry = InFlightRegistry()
    engine = EngineClient("unix:/nowhere", registry, b"")
    gateway = Gateway(ServeConfig(), "m", FullPool(), engine, registry, Metrics("m"), PolicyEnforcer(Policy("test")))
    registry.add(InFlight("r", priority=5, status=RequestStatus.DECODING))
    gateway.recompute(Recompute("r", 0, (1, 2, 3), SamplingParams(), 5), engine)  # edge.app wires it to the engine
    failed = registry.get("r").events.get_nowait()
    assert isinstance(failed, PrefillFailed) and failed.kind == "recompute_failed"
    error = prefill_error(failed)
    assert (error.status, error.code) == (503, "kv_cache_full") and "could not be queued again" in error.message
