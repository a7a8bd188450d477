"""Scheduler and engine loop on fabricated model outputs: priority order, preemption, resume, abort."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_gpu.engine import DecodeEngine
from fake_runner import expected_tokens, fake_handoff, make_engine


def run_to_completion(engine: DecodeEngine, max_steps=10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason:
                assert event.request_id not in finished, "two terminal events for one request"
                finished[event.request_id] = event.finish_reason
        engine.blocks.check_integrity()
    assert not engine.has_work
    return outputs


def step(engine, outputs):
    for event in engine.step():
        outputs.setdefault(event.request_id, []).extend(event.token_ids)


def add(engine, outputs, request_id, prompt, max_tokens, priority=0):
    for event in engine.add(fake_handoff(request_id, prompt, max_tokens, priority)):
        outputs.setdefault(request_id, []).extend(event.token_ids)


def test_admission_follows_priority_then_arrival():
    engine, runner = make_engine(max_num_seqs=1)
    outputs = {}
    for rid, priority in [("low", 5), ("hi-a", 1), ("mid", 3), ("hi-b", 1), ("urgent", -2)]:
        add(engine, outputs, rid, [rid.__len__(), 9, 9], max_tokens=4, priority=priority)
    for rid, more in run_to_completion(engine).items():
        outputs[rid].extend(more)
    assert runner.decoded_order == ["urgent", "hi-a", "hi-b", "mid", "low"]


def test_preempted_sequences_resume_with_identical_tokens():
    prompts = {f"r{i}": [random.Random(i).randrange(3, 900) for _ in range(5 + 3 * i)] for i in range(8)}
    engine, runner = make_engine(num_blocks=14, block_size=4)  # far too small for all eight at once
    outputs = {}
    for rid, prompt in prompts.items():
        add(engine, outputs, rid, prompt, max_tokens=20)
    for rid, more in run_to_completion(engine).items():
        outputs[rid].extend(more)
    assert engine.stats().num_preemptions > 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == expected_tokens(prompt, 20), rid
    assert engine.blocks.num_free_blocks == 14 and not runner.swap_space


def test_high_priority_arrival_preempts_lower_priority_when_blocks_are_short():
    engine, runner = make_engine(num_blocks=8, block_size=4)
    outputs = {}
    add(engine, outputs, "background", list(range(3, 23)), max_tokens=8, priority=10)  # 20 tokens: 6 blocks
    step(engine, outputs)
    add(engine, outputs, "interactive", list(range(30, 42)), max_tokens=4, priority=0)  # needs 4 blocks
    step(engine, outputs)
    assert engine.scheduler.running.keys() == {"interactive"}
    assert engine.stats().num_preemptions == 1
    for rid, more in run_to_completion(engine).items():
        outputs[rid].extend(more)
    assert outputs["background"] == expected_tokens(list(range(3, 23)), 8)


def test_a_swapped_sequence_takes_only_the_blocks_holding_its_kv_to_host_memory():
    """Blocks reserved past a sequence's KV (a draft's positions, speculative decoding) are freed, not copied."""
    engine, runner = make_engine(num_blocks=10, block_size=4)
    outputs = {}
    add(engine, outputs, "background", list(range(3, 13)), max_tokens=8, priority=10)  # 10 tokens: 3 blocks
    step(engine, outputs)
    seq = engine.requests["background"][0]
    engine.blocks.append("background", seq.num_cached + 1 + 8)  # a draft's reservation: 2 blocks more
    holding = engine.blocks.blocks_for(seq.num_cached)
    assert len(engine.blocks.block_tables["background"]) == holding + 2
    add(engine, outputs, "interactive", list(range(30, 50)), max_tokens=4, priority=0)  # needs 6 blocks
    scheduled = engine.scheduler.schedule()
    assert [(seq_id, len(blocks)) for seq_id, blocks in scheduled.swap_out] == [("background", holding)]
    assert engine.scheduler.num_swapped_blocks == seq.num_swapped_blocks == holding
    runner.prepare(scheduled)
    for rid, more in run_to_completion(engine).items():
        outputs[rid].extend(more)
    assert outputs["background"] == expected_tokens(list(range(3, 13)), 8)
    assert engine.scheduler.num_swapped_blocks == 0 and not runner.swap_space


def test_abort_frees_blocks_at_every_stage():
    engine, runner = make_engine(num_blocks=10, block_size=4)
    outputs = {}
    add(engine, outputs, "running", list(range(3, 20)), max_tokens=10, priority=0)
    add(engine, outputs, "waiting", list(range(40, 67)), max_tokens=10, priority=1)  # shares no prefix: it waits
    engine.step()
    assert engine.blocks.num_used_blocks > 0 and engine.scheduler.num_waiting == 1
    assert engine.abort("waiting").finish_reason == "abort"
    assert engine.abort("running").finish_reason == "abort"
    assert engine.blocks.num_used_blocks == 0
    assert engine.abort("running") is None  # a second abort reports nothing new
    engine.blocks.check_integrity()
    add(engine, outputs, "swapped", list(range(3, 20)), max_tokens=10, priority=5)
    engine.step()
    add(engine, outputs, "vip", list(range(40, 67)), max_tokens=5, priority=0)
    engine.step()
    assert engine.requests["swapped"][0].state.value == "swapped" and runner.swap_space
    engine.abort("swapped")
    assert "swapped" not in runner.swap_space
    run_to_completion(engine)
    assert engine.blocks.num_free_blocks == 10


def test_request_too_long_for_the_pool_is_rejected_at_once():
    engine, _ = make_engine(num_blocks=4, block_size=4)
    try:
        engine.add(fake_handoff("big", list(range(3, 20)), max_tokens=10))
    except ValueError as err:
        assert "exceeds the limit of 16" in str(err)
    else:
        raise AssertionError("a request that can never fit was accepted")


@settings(max_examples=60, deadline=None)
@given(st.integers(6, 40), st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 9),
                                              st.integers(-2, 3), st.integers(1, 12)), min_size=1, max_size=80))
def test_random_traffic_keeps_integrity_and_exact_outputs(num_blocks, ops):
    engine, runner = make_engine(num_blocks=num_blocks, block_size=4, max_num_seqs=4)
    outputs, prompts, aborted = {}, {}, set()
    for op, who, priority, n in ops:
        rid = f"r{who}"
        if op == "add" and rid not in prompts:
            prompt = [3 + (who * 17 + i) % 900 for i in range(n)]
            try:
                add(engine, outputs, rid, prompt, max_tokens=n, priority=priority)
            except ValueError:
                continue  # too long for this pool: refused up front
            prompts[rid] = prompt
        elif op == "step":
            for event in engine.step():
                outputs.setdefault(event.request_id, []).extend(event.token_ids)
        elif op == "abort" and engine.abort(rid) is not None:
            aborted.add(rid)
        engine.blocks.check_integrity()
    for rid, more in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(more)
    assert engine.blocks.num_free_blocks == num_blocks and not runner.swap_space
    for rid, prompt in prompts.items():
        want = expected_tokens(prompt, len(prompt))
        got = outputs.get(rid, [])
        assert got == want[:len(got)] if rid in aborted else got == want, rid


def test_outranked_sequences_sit_out_steps_while_a_more_important_prompt_is_prefilled():
    from decode_gpu.core.priority_gate import PriorityGate
    engine, runner = make_engine()
    runner.gate = gate = PriorityGate(enabled=True)
    outputs = {}
    prompts = {"bg-1": [4, 5, 6], "bg-2": [7, 8], "fg": [9, 9, 9, 9]}
    for rid, priority in (("bg-1", 10), ("bg-2", 10), ("fg", 0)):
        add(engine, outputs, rid, prompts[rid], max_tokens=8, priority=priority)
    step(engine, outputs)
    assert {rid: len(out) for rid, out in outputs.items()} == {"bg-1": 2, "bg-2": 2, "fg": 2}
    gate.hold(0)  # a priority-0 prompt is in prefill: the priority-10 streams wait, the priority-0 one goes on
    step(engine, outputs)
    step(engine, outputs)
    assert {rid: len(out) for rid, out in outputs.items()} == {"bg-1": 2, "bg-2": 2, "fg": 4}
    gate.hold(None)
    step(engine, outputs)
    assert {rid: len(out) for rid, out in outputs.items()} == {"bg-1": 3, "bg-2": 3, "fg": 5}
    for rid, more in run_to_completion(engine).items():
        outputs[rid].extend(more)
    assert outputs == {rid: expected_tokens(prompt, 8) for rid, prompt in prompts.items()}


def test_prompt_blocks_are_shared_only_between_handoffs_of_one_cache_salt():
    """One tenant's cached prompt never spares another's import (nor can be timed through it)."""
    import dataclasses
    engine, _ = make_engine(num_blocks=64, block_size=4)
    prompt = list(range(10, 22))  # three full blocks
    outputs, hits = {}, []
    for rid, salt in [("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a")]:
        handoff = dataclasses.replace(fake_handoff(rid, prompt, max_tokens=30), cache_salt=salt)
        add_events = engine.add(handoff)
        outputs.setdefault(rid, []).extend(t for e in add_events for t in e.token_ids)
        step(engine, outputs)
        hits.append(engine.stats().prefix_cache_hits)
    assert hits[0] == hits[1] == 0  # b1's prompt is a1's, but another tenant's: imported in full
    assert hits[2] >= 8  # a2 finds a1's full blocks
