"""N-gram speculative decoding: the proposer, the acceptance rule against its target distribution, and the engine
with speculation on giving exactly the tokens it gives with speculation off (greedy and seeded sampling), with
its KV blocks accounted and its counters right.

The engine tests run a tiny random Llama in float32, where a forward of K + 1 tokens per sequence gives the same
logits as K + 1 forwards of one; a repetitive prompt makes its greedy output repeat, so drafts get accepted.
"""

import dataclasses
import random

import pytest
import torch

from contracts.handoff import SamplingParams
from decode_gpu.core.speculative import (
    DraftState,
    LiveCosts,
    NgramIndex,
    SpecConfig,
    Speculator,
    StepCosts,
    accepted_length,
    measurement_rows,
    plan_drafts,
    propose_ngram,
)
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from decode_gpu.service.server import parse_args, spec_config
from sampling.sampler import sample
from sampling.sampling_params import SamplingBatch, SamplingRow
from tiny_llama import handoff, tiny_engine_setup

# every proposal drafted in full (no cost model): the tests of exactness and accounting want drafts every step
NGRAM = SpecConfig(method="ngram", num_speculative_tokens=4, planned=False)
REPETITIVE = [5, 6, 7, 8, 9, 10, 11, 12] * 4


@pytest.fixture(scope="module")
def tiny():
    model, identity, handoffs = tiny_engine_setup("cpu")
    return model, identity, handoffs, handoff(model, identity, "rep", REPETITIVE)


def _engine(tiny, spec: SpecConfig = SpecConfig(), kv_tokens: int = 512, step_costs: StepCosts | None = None,
            **config) -> DecodeEngine:
    model, identity = tiny[:2]
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=kv_tokens, kv_storage="float32"),
                         torch.device("cpu"))
    return DecodeEngine(runner, EngineConfig(speculative=spec, **config), step_costs=step_costs)


def _run(engine: DecodeEngine, handoffs) -> dict[str, list[int]]:
    """Every request's tokens from a run to the end, checking block accounting after each step."""
    outputs: dict[str, list[int]] = {}
    events = [e for h in handoffs for e in engine.add(h)]
    while engine.has_work:
        events += engine.step()
        engine.blocks.check_integrity()
    for event in events:
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
    assert engine.blocks.num_used_blocks == 0
    return outputs


def _with(handoff_, **sampling):
    return dataclasses.replace(handoff_, sampling=dataclasses.replace(handoff_.sampling, **sampling))


# --- the proposer -------------------------------------------------------------------------------------------
def _lookup_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup by brute force: the latest earlier occurrence of the longest suffix n-gram, copied on."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                out = list(tokens)
                for j in range(k):
                    out.append(out[start + n + j])
                return out[len(tokens):]
    return []


def test_the_proposal_is_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3, n_min=1, n_max=3) == [3, 4, 1]
    assert propose_ngram([1, 2, 7, 1, 2, 8, 5, 1, 2], k=2, n_min=2, n_max=2) == [8, 5]  # the latest occurrence
    # [1, 2, 3] occurred after 9; the shorter [2, 3] occurred later, before 6: the longer match wins
    assert propose_ngram([9, 1, 2, 3, 5, 2, 3, 6, 1, 2, 3], k=1, n_min=1, n_max=3) == [5]
    assert propose_ngram([1, 2, 3, 4, 5, 1], k=3, n_min=2, n_max=3) == []  # one-token matches are below n_min
    assert propose_ngram([7, 1, 2, 1, 2], k=5, n_min=2, n_max=2) == [1, 2, 1, 2, 1]  # a period shorter than k repeats


def test_the_incremental_index_proposes_what_brute_force_finds_at_every_length():
    rng = random.Random(0)
    for _ in range(20):
        tokens = [rng.randrange(4) for _ in range(60)]
        index = NgramIndex(2, 4)
        for end in range(1, len(tokens) + 1):
            assert index.propose(tokens[:end], 3) == _lookup_reference(tokens[:end], 3, 2, 4), tokens[:end]


def test_accepted_length_is_the_prefix_the_target_draws_confirm():
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_length([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_length([4, 5], [-1, 5, 1]) == 0  # a row that could not be sampled matches nothing
    assert accepted_length([], [3]) == 0


# --- planning drafts against the cost model -----------------------------------------------------------------
FLAT = StepCosts(plain=((1, 10.0), (8, 10.0)), verify=((2, 10.0), (40, 10.0)), width=5)  # a GPU's small batches
LINEAR = StepCosts(plain=((1, 10.0), (8, 80.0)), verify=((2, 20.0), (40, 400.0)), width=5)  # every row costs alike
# a CPU with int8 weights up to 4 rows and float above (the embedded model here, rounded): 5 rows cost much more
STEPPED = StepCosts(plain=((1, 20.0), (4, 25.0), (5, 38.0), (8, 40.0)),
                    verify=((2, 23.0), (4, 26.0), (5, 38.0), (20, 44.0), (40, 54.0)), width=5, seq_ms=1.0)


def test_the_cost_model_interpolates_extrapolates_and_charges_for_sequences():
    assert STEPPED.plain_ms(1) == 20.0 and STEPPED.plain_ms(3) == pytest.approx(23.33, abs=0.01)
    assert STEPPED.verify_ms(12, 3) == pytest.approx(38 + 6 * 7 / 15)  # 3 sequences feed 12 rows as measured
    assert STEPPED.verify_ms(12, 4) == pytest.approx(STEPPED.verify_ms(12, 3) + 1.0)  # one more sequence
    assert STEPPED.verify_ms(60, 12) == pytest.approx(64.0)  # past the last point, along the last slope
    assert measurement_rows(8) == [1, 2, 3, 4, 5, 6, 8]
    assert measurement_rows(160) == [1, 2, 3, 4, 5, 6, 9, 13, 19, 28, 42, 64]  # capped at 64
    assert measurement_rows(1) == [1]


def test_drafts_are_planned_for_the_most_tokens_per_ms():
    proposals = [[1, 2, 3, 4]] * 2
    assert plan_drafts(proposals, [0.5, 0.5], FLAT) == [4, 4]  # verifying costs nothing more: draft all
    assert plan_drafts(proposals, [0.95, 0.95], LINEAR) == [0, 0]  # every row costs a step's row: never pays
    # alone, 3 draft tokens stay under the 5-row step of the CPU's weights; a 4th token is not worth 38 ms
    assert plan_drafts([[1, 2, 3, 4]], [0.9], STEPPED) == [3]
    assert plan_drafts([[1, 2, 3, 4]], [0.1], STEPPED) == [0]  # unlikely drafts: the plain step makes more
    # a row costs a fifth of a step: the likelier sequence's whole draft pays, the other's first token does not
    fifth = StepCosts(plain=((1, 10.0), (8, 10.0)), verify=((2, 10.0), (3, 12.0)), width=5)
    assert plan_drafts([[1, 2, 3, 4], [5, 6, 7, 8]], [0.3, 0.95], fifth) == [0, 4]
    assert plan_drafts([[1, 2], []], [0.9, 0.9], FLAT) == [2, 0]
    assert plan_drafts(proposals, [0.5, 0.5], None) == [4, 4]  # no cost model: everything
    # a plan that only breaks even is not taken once a margin is asked for
    even = StepCosts(plain=((1, 10.0), (2, 10.0)), verify=((2, 15.0), (10, 15.0)), width=5)
    assert plan_drafts([[1]], [0.6], even) == [1] and plan_drafts([[1]], [0.6], even, margin=0.1) == [0]


def test_acceptance_falls_with_rejections_and_recovers_while_a_sequence_rests():
    config = SpecConfig(method="ngram", decay=0.5, recovery=0.5)
    state = DraftState(NgramIndex(2, 4))
    assert state.acceptance == 1.0  # optimistic at first
    state.record(4, 1, config)  # 1 accepted of 2 tried: (0.5 + 1) / (0.5 + 2) = 0.6
    assert state.acceptance == pytest.approx(0.6)
    state.record(2, 0, config)  # (0.75 + 0) / (1.25 + 1) = 0.33
    assert state.acceptance == pytest.approx(1 / 3)
    rested = []
    for _ in range(4):
        state.rest(config)
        rested.append(state.acceptance)
    assert rested == sorted(rested) and rested[-1] > 0.9  # back towards the optimistic start: tried again


@pytest.mark.slow
def test_a_plan_drafts_only_where_the_cost_model_says_it_pays(tiny):
    """Through the engine: with every row as dear as a plain step's, nothing is drafted; with verification free,
    every step of a repetitive prompt drafts. The tokens are the same either way."""
    request = _with(tiny[3], max_tokens=40)
    planned = dataclasses.replace(NGRAM, planned=True)
    plain = _run(_engine(tiny), [request])
    for costs, drafts in ((LINEAR, False), (FLAT, True)):
        engine = _engine(tiny, planned, step_costs=costs)
        assert _run(engine, [request]) == plain
        assert (engine.stats().num_spec_drafts > 0) == drafts


@pytest.mark.slow
def test_the_engine_measures_its_cost_model_at_start_and_its_output_is_unchanged(tiny):
    """The measurement writes dummy K/V into blocks nothing owns yet: the requests after it decode as before."""
    request = _with(tiny[3], max_tokens=40)
    engine = _engine(tiny, SpecConfig(method="ngram", num_speculative_tokens=4))
    costs = engine.speculator.costs.prior  # the start-up model; the live one corrects it step by step
    # the fewest rows first, as many as the 3 s budget reaches (a busy machine reaches fewer)
    plain_rows, verify_rows = [rows for rows, _ in costs.plain], [rows for rows, _ in costs.verify]
    assert plain_rows == measurement_rows(engine.config.scheduler.max_num_seqs)[:len(plain_rows)]
    assert len(plain_rows) >= 2 and verify_rows[0] == 2
    assert all(ms > 0 for _, ms in costs.plain + costs.verify) and costs.seq_ms >= 0 and costs.width == 5
    assert engine.blocks.num_used_blocks == 0
    assert _run(engine, [request]) == _run(_engine(tiny), [request])


# --- the acceptance rule against its target distribution ----------------------------------------------------
def test_accepting_a_draft_when_the_targets_own_draw_equals_it_is_rejection_sampling():
    """For a one-hot draft d, speculative rejection sampling accepts d with probability p(d) and otherwise draws
    from p without d, renormalized. The engine accepts d when the sampler's seeded draw at that position equals
    d, and otherwise emits that draw: over many seeds both frequencies must match p (temperature and top-k
    applied: p is the processed distribution)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -3.0])  # [vocab 6]
    params = SamplingParams(temperature=0.7, top_k=5)
    p = torch.softmax(logits[:5] / 0.7, dim=-1)  # [5]: token 5 is outside the top 5
    seeds = 20000
    batch = SamplingBatch.build([SamplingRow(params, seed, 11) for seed in range(seeds)], torch.device("cpu"))
    draws, codes = sample(logits.expand(seeds, -1), batch)  # [seeds] each
    assert not codes.any()
    draft = 1
    accepted = (draws == draft).float().mean().item()
    assert abs(accepted - p[draft].item()) < 4 * (p[draft] * (1 - p[draft]) / seeds).sqrt().item()
    rejected = draws[draws != draft]
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()  # [5]: p without the draft token, renormalized
    observed = torch.bincount(rejected, minlength=6).float() / len(rejected)  # [6]
    assert observed[5] == 0 and observed[draft] == 0
    tolerance = 4 * (residual * (1 - residual) / len(rejected)).sqrt()  # [5]: four standard errors
    assert ((observed[:5] - residual).abs() <= tolerance + 1e-9).all(), (observed, residual)


# --- the engine ----------------------------------------------------------------------------------------------
def test_greedy_output_is_unchanged_and_drafts_are_accepted_on_a_repetitive_prompt(tiny):
    request = _with(tiny[3], max_tokens=40)
    plain = _run(_engine(tiny), [request])
    engine = _engine(tiny, NGRAM)
    assert _run(engine, [request]) == plain
    stats = engine.stats()
    assert stats.num_spec_accepted_tokens > 0
    assert stats.num_spec_drafts < 40 - 1  # fewer steps than tokens


def test_greedy_output_is_unchanged_on_non_repetitive_prompts_batched_together(tiny):
    requests = [_with(h, max_tokens=24) for h in tiny[2]] + [_with(tiny[3], max_tokens=24)]
    assert _run(_engine(tiny, NGRAM), requests) == _run(_engine(tiny), requests)


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.1, seed=11),
    dict(temperature=0.1, top_p=0.9, top_k=20, seed=12, logprobs=2),
    dict(temperature=0.1, seed=13, frequency_penalty=0.01, repetition_penalty=1.05, logit_bias=((343, 1.0),)),
    dict(temperature=0.1, seed=14, min_tokens=30, stop_token_ids=(343,)),
], ids=["temperature", "top-p-top-k-logprobs", "penalties-and-bias", "min-tokens"])
@pytest.mark.slow
def test_seeded_sampling_gives_the_same_tokens_as_without_speculation(tiny, sampling):
    """The accepted draft tokens are the draws the plain step makes at their positions, so a seeded request's
    output (and its distribution over seeds) is unchanged; penalties see the draft tokens ahead as context."""
    request = _with(tiny[3], max_tokens=40, **sampling)
    plain_engine, spec_engine = _engine(tiny), _engine(tiny, NGRAM)
    plain, plain_logprobs = _run_with_logprobs(plain_engine, request)
    spec, spec_logprobs = _run_with_logprobs(spec_engine, request)
    assert spec == plain
    assert spec_logprobs == pytest.approx(plain_logprobs, abs=1e-4)
    assert spec_engine.stats().num_spec_accepted_tokens > 0


def _run_with_logprobs(engine: DecodeEngine, request) -> tuple[list[int], list[float]]:
    events = engine.add(request)
    while engine.has_work:
        events += engine.step()
    assert engine.blocks.num_used_blocks == 0
    return [t for e in events for t in e.token_ids], [lp.logprob for e in events for lp in e.logprobs]


def test_counters_add_up_and_every_step_makes_one_token_plus_the_accepted_ones(tiny):
    engine = _engine(tiny, NGRAM)
    request = _with(tiny[3], max_tokens=40)
    events = engine.add(request)
    steps = 0
    while engine.has_work:
        new = engine.step()
        steps += sum(1 for e in new if e.token_ids)
        events += new
    stats = engine.stats()
    generated = sum(len(e.token_ids) for e in events) - 1  # the first token came with the handoff
    assert generated == 39 == steps + stats.num_spec_accepted_tokens
    assert stats.num_spec_drafts <= steps
    assert stats.num_spec_accepted_tokens <= stats.num_spec_draft_tokens <= 4 * stats.num_spec_drafts
    assert sum(stats.spec_accepted_per_pos) == stats.num_spec_accepted_tokens
    assert list(stats.spec_accepted_per_pos) == sorted(stats.spec_accepted_per_pos, reverse=True)
    assert stats.generated_tokens == generated


def test_drafts_hold_no_block_after_an_abort_mid_speculation_or_the_end(tiny):
    engine = _engine(tiny, NGRAM)
    requests = [_with(tiny[3], max_tokens=60), _with(dataclasses.replace(tiny[3], request_id="rep2"), max_tokens=60)]
    for request in requests:
        engine.add(request)
    for _ in range(4):
        engine.step()
        engine.blocks.check_integrity()
    assert engine.stats().num_spec_drafts > 0
    seq = engine.requests["rep"][0]
    # the reservation covers the draft's positions: the table may reach past what the sequence has cached
    assert len(engine.blocks.block_tables["rep"]) >= engine.blocks.blocks_for(seq.num_cached + 1)
    engine.abort("rep")
    engine.blocks.check_integrity()
    while engine.has_work:
        engine.step()
        engine.blocks.check_integrity()
    assert engine.blocks.num_used_blocks == 0


def test_drafts_never_preempt_in_a_tight_pool(tiny):
    """A pool with room for the sequences' own tokens and little more: the drafts take what is spare, and the
    output is what it is without speculation."""
    requests = [_with(dataclasses.replace(tiny[3], request_id=f"r{i}"), max_tokens=30) for i in range(3)]
    kv_tokens = 3 * 64 + 16  # 62 tokens each round up to 4 blocks of 16; one block spare
    plain_engine, spec_engine = _engine(tiny, kv_tokens=kv_tokens), _engine(tiny, NGRAM, kv_tokens=kv_tokens)
    assert _run(spec_engine, requests) == _run(plain_engine, requests)
    assert spec_engine.stats().num_preemptions == plain_engine.stats().num_preemptions == 0


def test_structured_output_does_not_speculate_and_a_policy_can_turn_speculation_off(tiny):
    engine = _engine(tiny, NGRAM)
    engine.add(_with(tiny[3], max_tokens=30))
    seq = engine.requests["rep"][0]
    seq.meta["matcher"] = object()  # what admit puts there for a structured request
    assert engine.speculator.plan([seq], engine.blocks, 4096, []) == {}
    del seq.meta["matcher"]
    engine.set_speculation(False)
    while engine.has_work:
        engine.step()
    assert engine.stats().num_spec_drafts == 0
    engine.set_speculation(True)
    assert engine.speculator.enabled
    off = _engine(tiny)
    off.set_speculation(True)  # not configured: stays off
    assert not off.speculator.enabled


def test_engine_process_options():
    base = ["--model", "m.gguf", "--listen", "unix:/tmp/x.sock"]
    assert spec_config(parse_args(base)) == SpecConfig()
    config = spec_config(parse_args(base + ["--speculative", "ngram", "--num-speculative-tokens", "3"]))
    assert config.enabled and config.num_speculative_tokens == 3
    with pytest.raises(SystemExit, match="num_speculative_tokens"):
        spec_config(parse_args(base + ["--speculative", "ngram", "--num-speculative-tokens", "0"]))


CODE_REQUEST = ("Here is a Python function:\n```python\ndef count_words(text):\n    counts = {}\n"
                "    for line in text.splitlines():\n        for word in line.split():\n"
                "            counts[word] = counts.get(word, 0) + 1\n    return counts\n```\n"
                "Return the whole function again with the variable `counts` renamed to `output`. Reply with the code only.")


@pytest.mark.slow
def test_the_embedded_model_quoting_code_from_its_prompt_decodes_the_same_tokens_from_accepted_drafts(
        embedded_model_path, embedded_float32):
    """Greedy, float32: the answer quotes the prompt's function, drafts are accepted, the tokens are unchanged."""
    from decode_gpu.model.loader import load_tokenizer
    from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
    prefiller = Prefiller(PrefillConfig(embedded_model_path, n_ctx=512, n_threads=2, kv_type="f16"))
    try:
        identity = prefiller.identity
        text = load_tokenizer(identity).apply_chat_template([{"role": "user", "content": CODE_REQUEST}], tokenize=False,
                                                            add_generation_prompt=True)
        tokens = tuple(prefiller.tokenize(text, add_special=False))
        params = SamplingParams(temperature=0.0, max_tokens=48)
        request = prefiller.prefill(PrefillRequest("code", tokens, params)).handoff
    finally:
        prefiller.close()
    model = embedded_float32  # the session's, loaded once
    plain_engine, spec_engine = (_engine((model, identity), spec, kv_tokens=1024) for spec in (SpecConfig(), NGRAM))
    assert _run(spec_engine, [request]) == _run(plain_engine, [request])
    stats = spec_engine.stats()
    assert stats.num_spec_accepted_tokens >= 24  # most of the answer is the quoted code


def test_a_speculating_sequence_preempted_by_a_more_important_one_resumes_with_the_same_tokens(tiny):
    """Swapped out with blocks reserved for a draft it had not grown into, it comes back with fewer blocks."""
    def scenario(spec: SpecConfig) -> tuple[dict, DecodeEngine]:
        engine = _engine(tiny, spec, kv_tokens=96)  # 6 blocks: the repetitive request needs all of them at its end
        outputs: dict[str, list[int]] = {}
        events = engine.add(dataclasses.replace(_with(tiny[3], max_tokens=60), priority=1))
        for _ in range(5):
            events += engine.step()
        events += engine.add(dataclasses.replace(_with(tiny[2][2], max_tokens=8), priority=0))
        while engine.has_work:
            events += engine.step()
            engine.blocks.check_integrity()
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
        assert engine.blocks.num_used_blocks == 0
        return outputs, engine

    (plain, _), (spec, engine) = scenario(SpecConfig()), scenario(NGRAM)
    assert spec == plain
    assert engine.stats().num_preemptions >= 1


def test_a_sequence_swapped_out_with_unfilled_draft_blocks_swaps_back_into_fewer(tiny):
    from decode_gpu.core.scheduler import ScheduledStep
    runner = _engine(tiny).runner
    pool = runner.pool
    for tensor in pool.k + pool.v:
        tensor.normal_()
    before = pool.read_blocks([1, 2, 3])  # the third block held only a rejected draft's K/V
    assert runner.prepare(ScheduledStep(swap_out=[("s", [1, 2, 3])])) == []
    assert runner.prepare(ScheduledStep(swap_in=[("s", [7, 8])])) == []
    after = pool.read_blocks([7, 8])
    assert all(torch.equal(a, b[:2]) for a, b in zip(after, before))


# --- decisions measured while serving -----------------------------------------------------------------------
def test_the_live_cost_model_follows_injected_step_times():
    """Plain steps twice as slow as modelled move the plain level towards 2 (and the verify cost with it, none
    observed yet); verify steps observed at the model's time then bring the verify level back on their own; one
    stall is clamped."""
    live = LiveCosts(FLAT)
    for _ in range(30):
        live.observe("plain", 1, 1, 2 * FLAT.plain_ms(1))
    assert live.plain_ms(1) == pytest.approx(2 * FLAT.plain_ms(1), rel=0.01)
    assert live.verify_ms(5, 1) == pytest.approx(2 * FLAT.verify_ms(5, 1), rel=0.01)
    for _ in range(30):
        live.observe("verify", 5, 1, FLAT.verify_ms(5, 1))
    assert live.verify_ms(5, 1) == pytest.approx(FLAT.verify_ms(5, 1), rel=0.01)
    assert live.plain_ms(1) == pytest.approx(2 * FLAT.plain_ms(1), rel=0.01)
    before = live.plain_level
    live.observe("plain", 1, 1, 1e6 * FLAT.plain_ms(1))  # a stall: counts as 8x at most
    assert live.plain_level == pytest.approx(before + 0.2 * (8 - before))
    assert "plain 2" in live.describe() or "plain 3" in live.describe()


def test_a_probe_taken_under_a_hog_is_corrected_for_verify_by_the_plain_steps():
    """A start-up model measured while a hog ran: every step of both kinds 2.5x too dear. Once the hog stops, the
    plain steps that run all the time bring verify's cost down with theirs, without waiting for verify steps (which a
    model that thinks them dear seldom runs); verify's own offset from plain, once observed, stays."""
    live = LiveCosts(FLAT)
    live.observe("verify", 5, 1, FLAT.verify_ms(5, 1))  # one verify step during the start, as modelled
    for _ in range(40):
        live.observe("plain", 1, 1, 0.4 * FLAT.plain_ms(1))
    assert live.plain_ms(1) == pytest.approx(0.4 * FLAT.plain_ms(1), rel=0.01)
    assert live.verify_ms(5, 1) == pytest.approx(0.4 * FLAT.verify_ms(5, 1), rel=0.01)
    for _ in range(40):
        live.observe("verify", 5, 1, 0.6 * FLAT.verify_ms(5, 1))  # verify a bit dearer than plain's level says
    assert live.verify_ms(5, 1) == pytest.approx(0.6 * FLAT.verify_ms(5, 1), rel=0.01)
    assert live.verify_level == pytest.approx(0.6, rel=0.01)


def test_speculation_starts_at_one_margin_and_keeps_going_at_a_smaller_one():
    """Hysteresis: a plan 20% better than the plain step does not start drafting (margin 0.3) but keeps it going
    (keep_margin 0.1); when the live costs say verify got dearer, drafting stops."""
    costs = StepCosts(plain=((1, 10.0), (8, 12.0)), verify=((2, 12.0), (8, 14.0)), width=5)
    speculator = Speculator(dataclasses.replace(NGRAM, planned=True), costs)
    proposals, acceptance = [[1, 2, 3, 4]], [0.6]
    # one row at 10 ms against a draft of 4 at 12 ms with 1 + 0.6 + 0.36 + ... expected: about 1.6x
    rate = lambda n: (1 + sum(0.6 ** j for j in range(1, n + 1))) / costs.verify_ms(1 + n, 1)  # noqa: E731
    best = max(rate(n) for n in range(1, 5)) / (1 / costs.plain_ms(1))
    assert best > 1.3  # starts
    assert any(speculator.lengths(proposals, acceptance)) and speculator.drafting
    for _ in range(40):  # verify steps are observed 1.4x dearer than modelled: the plan now beats plain by ~15%
        speculator.observe(True, 5, 1, 1.4 * costs.verify_ms(5, 1))
    assert any(speculator.lengths(proposals, acceptance))  # still drafting: above keep_margin
    speculator.drafting = False
    assert not any(speculator.lengths(proposals, acceptance))  # would not start at that
    for _ in range(40):
        speculator.observe(True, 5, 1, 3 * costs.verify_ms(5, 1))
    speculator.drafting = True
    assert not any(speculator.lengths(proposals, acceptance)) and not speculator.drafting  # stops


def test_a_speculator_whose_costs_say_never_still_probes_now_and_then():
    """A cost model taken in a noisy second (every draft too dear) cannot keep speculation off: after probe_steps
    steps with proposals, the likeliest one is verified, and what that step takes corrects the model."""
    speculator = Speculator(dataclasses.replace(NGRAM, planned=True, probe_steps=5), LINEAR)
    proposals, acceptance = [[1, 2], [3, 4, 5]], [0.5, 0.9]
    planned = [speculator.lengths(proposals, acceptance) for _ in range(5)]
    assert planned[:4] == [[0, 0]] * 4 and planned[4] == [0, 3]
    assert speculator.lengths(proposals, acceptance) == [0, 0]  # counting again from the probe


class _Window:
    """A measurement window with its answer set (contracts/cpu_window.py measures the real one)."""
    def __init__(self, quiet: bool) -> None:
        self._quiet = quiet

    def quiet(self) -> bool:
        return self._quiet

    def describe(self) -> str:
        return "quiet" if self._quiet else "busy"


def test_the_start_up_probe_is_short_and_a_quiet_start_is_recorded_and_reused(tiny, tmp_path, monkeypatch):
    from decode_gpu.runner import cost_probe
    model, identity = tiny[:2]
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512, kv_storage="float32"), torch.device("cpu"))
    record = tmp_path / "costs.json"
    monkeypatch.setattr(cost_probe, "_window", lambda: _Window(quiet=False))
    runner.step_costs(4, 2, budget_s=0.0, record=record)  # the budget spent at once: the fewest rows only
    assert not record.exists()  # other work through the probe: not recorded
    monkeypatch.setattr(cost_probe, "_window", lambda: _Window(quiet=True))
    measured = runner.step_costs(4, 2, budget_s=0.0, record=record)
    assert record.exists()
    monkeypatch.setattr(runner, "measure_step_costs", lambda *a, **k: pytest.fail("measured again"))
    assert runner.step_costs(4, 2, record=record) == measured
    record.write_text("{not json")
    monkeypatch.undo()
    assert runner.step_costs(4, 2, budget_s=0.0, record=record).plain  # a broken record is measured anew


def test_a_spent_budget_leaves_out_the_largest_row_counts(tiny):
    """A probe on a machine too busy for its budget (a CPU hog at start-up) stops once it has timed the fewest rows of
    each kind, however slow they were; verify's curve then grows past its one point as the plain step's does."""
    model, identity = tiny[:2]
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=512, kv_storage="float32"), torch.device("cpu"))
    spent = runner.measure_step_costs(4, 2, budget_s=0.0)
    assert [rows for rows, _ in spent.plain] == [1, 2] and [rows for rows, _ in spent.verify] == [2, 4]
    assert spent.verify[1][1] / spent.verify[0][1] == pytest.approx(spent.plain_ms(4) / spent.plain_ms(2))
    assert spent.seq_ms == 0.0  # not reached
    full = runner.measure_step_costs(4, 2, budget_s=60.0)
    assert [rows for rows, _ in full.plain] == measurement_rows(4)
    assert [rows for rows, _ in full.verify] == [r for r in measurement_rows(12) if r > 1]


def test_the_probe_stays_within_a_short_max_model_len(tiny):
    """max_model_len under the probe's 256-token context: its dummy sequences end where the rotary table does."""
    model, identity = tiny[:2]
    config = RunnerConfig(kv_cache_tokens=512, kv_storage="float32", max_model_len=100)
    runner = ModelRunner(model, identity, config, torch.device("cpu"))
    costs = runner.measure_step_costs(2, 2, budget_s=0.0)
    assert costs.plain and costs.verify
