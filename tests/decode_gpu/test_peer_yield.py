"""Decode of a request whose class promises a first token and nothing per token, or of one with several choices,
yields to its own priority's prompts (issue 47): Sequence.decode_priority, and the step's sequences that sit out
(core/prefill_yield.py)."""

from contracts.handoff import SamplingParams
from decode_gpu.core.prefill_yield import yield_to_prefill
from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.core.scheduler import ScheduledStep
from decode_gpu.core.sequence import Sequence


def seq(seq_id: str, priority: int = 0, deadline: float = 0.0, tpot_slo_ms: int = 0, n: int = 1) -> Sequence:
    return Sequence(seq_id, priority, 0, prompt_len=3, tokens=[1, 2, 3, 4],
                    sampling=SamplingParams(max_tokens=8, n=n), deadline=deadline, tpot_slo_ms=tpot_slo_ms)


def test_decode_priority_is_half_a_level_below_for_a_ttft_objective_alone():
    assert seq("a", 2, deadline=1e9).decode_priority == 2.5
    assert seq("b", 2, deadline=1e9, tpot_slo_ms=80).decode_priority == 2.0  # promises its tokens' pace: no yield
    assert seq("c", 2).decode_priority == 2.0  # no objective: shares with its level's prompts, as before
    assert seq("d", 2, n=32).decode_priority == 2.5  # many choices: yields to a plain prompt of its level
    assert seq("e", 2, n=32, tpot_slo_ms=80).decode_priority == 2.0


def test_the_peers_sit_out_while_their_level_s_prompts_wait_the_others_decode():
    gate = PriorityGate(enabled=True, max_hold_s=30.0)
    peer, paced, plain = seq("peer", deadline=1e9), seq("paced", deadline=1e9, tpot_slo_ms=80), seq("plain")
    step = ScheduledStep(decode=[peer, paced, plain])
    assert yield_to_prefill(step, gate).decode == [peer, paced, plain]  # nothing held
    gate.hold(0)
    assert yield_to_prefill(step, gate).decode == [paced, plain]
    gate.hold(1)
    assert yield_to_prefill(step, gate).decode == [peer, paced, plain]  # a less important prompt holds none


def test_the_engine_publishes_a_yielding_batch_at_the_next_level_for_the_workers_threads():
    """contracts/cpu_share.py: a worker keeps every thread for a prompt that ranks strictly above the published level;
    a batch that yields to its own priority's prompts is published at the next level, so those prompts get them."""
    from types import SimpleNamespace

    from decode_gpu.core.sequence import SeqState
    from decode_gpu.service.engine_loop import EngineLoop

    def level(*seqs: Sequence) -> int | None:
        for s in seqs:
            s.state = SeqState.RUNNING
        return EngineLoop._decode_level(SimpleNamespace(engine=SimpleNamespace(sequences=list(seqs))))

    assert level() is None
    assert level(seq("peer", 2, deadline=1e9)) == 3
    assert level(seq("peer", 2, deadline=1e9), seq("plain", 2)) == 2
    assert level(seq("big", 1, n=32), seq("plain", 2)) == 2
