"""The batched sampler (sampling/): per-row results independent of the batch, exact top-k/top-p sets with their ties,
seeded and distributed as softmax, bad rows flagged, one host read; and the engine's use of it. What each control
does to a token, greedy or seeded, is the table of tests/sampling/test_sampling_semantics.py, run through both the
engine and the prefill worker."""

import dataclasses
import math

import pytest
import torch
from test_engine_server import run_engine

from contracts.events import FinishReason
from contracts.handoff import SamplingParams as P
from fake_runner import expected_tokens, fake_handoff, make_engine
from sampling.sampler import NOISE_ROWS, PROBLEMS, filter_scores, sample_packed, sample_rows
from sampling.sampling_params import SamplingBatch, SamplingRow, resolve_seed
from sampling.seeded_noise import GOLDEN, mix64

CPU = torch.device("cpu")
MASK64 = (1 << 64) - 1


def run(logits, rows, device=CPU):
    return sample_rows(logits.to(device), SamplingBatch.build(rows, device))


def alone(logits, rows, device=CPU):
    return [run(logits[i:i + 1], [row], device)[0] for i, row in enumerate(rows)]


def tokens(results):
    return [r.token for r in results]


def same_params(params, n, position=0):
    """n rows with `params`, seeds 0..n-1."""
    return [SamplingRow(params, seed, position) for seed in range(n)]


MIXED = [P(temperature=0.0), P(temperature=1.0), P(temperature=0.7, top_k=20), P(temperature=1.3, top_p=0.9),
         P(temperature=1.0, top_k=5, top_p=0.5), P(temperature=0.0, top_k=3, top_p=0.2),
         P(temperature=0.5, logprobs=3), P(temperature=1.0, logprobs=0), P(temperature=2.0, top_k=1),
         P(temperature=0.9, seed=5, top_p=0.95, logprobs=2)]


def mixed_rows():
    return [SamplingRow(params, seed=1000 + 17 * i, position=40 + i) for i, params in enumerate(MIXED)]


# --- the counter-based hash ---------------------------------------------------------------------
def splitmix64_reference(x: int) -> int:
    """splitmix64's finalizer on Python ints (the published algorithm, unsigned 64-bit)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def test_mix64_is_splitmix64_in_wrapping_int64():
    assert mix64(torch.tensor([GOLDEN])).item() & MASK64 == 0xE220A8397B1DCDAF  # splitmix64(seed 0)'s first output
    values = [0, 1, -1, 2**63 - 1, -2**63, 0x0123456789ABCDEF, -0x0123456789ABCDEF, 12345678901234567]
    got = [v & MASK64 for v in mix64(torch.tensor(values)).tolist()]
    assert got == [splitmix64_reference(v & MASK64) for v in values]


def test_resolve_seed_wraps_into_int64_and_draws_distinct_seeds_for_unseeded_requests():
    assert [resolve_seed(P(seed=s)) for s in (0, -1, 2**63 - 1, -2**63, 2**63, 2**64 + 3)] == \
        [0, -1, 2**63 - 1, -2**63, -2**63, 3]
    drawn = {resolve_seed(P()) for _ in range(100)}
    assert len(drawn) == 100 and all(-2**63 <= s < 2**63 for s in drawn)


# --- batched equals per-row ---------------------------------------------------------------------
def test_batched_sampling_equals_each_row_sampled_alone():
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED), 500) * 3  # [rows, vocab]
    batched, rows_alone = run(logits, mixed_rows()), alone(logits, mixed_rows())
    assert tokens(batched) == tokens(rows_alone)
    for b, a in zip(batched, rows_alone):
        assert b.problem is a.problem is None
        assert (b.logprob is None) == (a.logprob is None) and [t for t, _ in b.top] == [t for t, _ in a.top]
        if b.logprob is not None:
            assert b.logprob == pytest.approx(a.logprob, abs=1e-6)


def test_rows_past_the_first_noise_chunk_equal_themselves_alone():
    torch.manual_seed(7)
    n = NOISE_ROWS * 2 + 5
    logits = torch.randn(n, 200) * 2  # [n, vocab]
    rows = [SamplingRow(MIXED[i % len(MIXED)], seed=i, position=i % 7) for i in range(n)]
    assert tokens(run(logits, rows)) == tokens(alone(logits, rows))


def test_a_rows_draw_depends_on_neither_its_batch_position_nor_the_other_rows():
    torch.manual_seed(1)
    logits, rows = torch.randn(len(MIXED), 500) * 3, mixed_rows()  # [rows, vocab]
    reference = tokens(run(logits, rows))
    order = list(reversed(range(len(rows))))
    assert tokens(run(logits[order], [rows[i] for i in order])) == [reference[i] for i in order]
    others = torch.randn(len(MIXED), 500) * 3  # [rows, vocab]: different neighbours for row 3
    others[3] = logits[3]
    assert tokens(run(others, rows))[3] == reference[3]


# --- exact top-k and top-p sets -----------------------------------------------------------------
def kept_ids(scores, params):
    batch = SamplingBatch.build([SamplingRow(p, 0, 0) for p in params], CPU)
    kept = filter_scores(scores.expand(len(params), -1), batch).isfinite()  # [rows, vocab]
    return [set(torch.nonzero(row)[:, 0].tolist()) for row in kept]


def test_top_k_keeps_exactly_the_k_best_and_breaks_ties_by_lower_id():
    scores = torch.tensor([[1.0, 5.0, 3.0, 3.0, 3.0, 0.0]])  # [1, vocab]: ids 2, 3, 4 tie
    params = [P(top_k=1), P(top_k=3), P(top_k=4), P(top_k=0), P(top_k=100)]
    assert kept_ids(scores, params) == [{1}, {1, 2, 3}, {1, 2, 3, 4}, set(range(6)), set(range(6))]


PROBS = [0.0625, 0.5, 0.125, 0.25, 0.0625]  # best first: ids 1, 3, 2, then 0 and 4 tied


@pytest.mark.parametrize("params, kept", [
    (P(top_p=0.4), {1}),
    (P(top_p=0.74), {1, 3}),  # 0.75 reaches it
    (P(top_p=0.76), {1, 3, 2}),
    (P(top_p=0.9), {1, 3, 2, 0}),  # 0.9375: of the tied pair, the lower id
    (P(top_p=1.0), {0, 1, 2, 3, 4}),
    (P(top_p=1e-9), {1}),  # the best token always stays
    (P(top_k=2, top_p=0.6), {1}),  # top-p over what top-k kept: 1 has 2/3 of that mass
    (P(top_k=2, top_p=0.7), {1, 3}),
])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_it(params, kept):
    scores = torch.tensor([PROBS]).log() + 4.0  # [1, vocab]: any offset gives the same distribution
    assert kept_ids(scores, [params]) == [kept]


# --- seeds ----------------------------------------------------------------------------------------
def test_the_same_seed_gives_the_same_tokens_and_other_seeds_or_positions_differ():
    flat = torch.zeros(64, 1000)  # [rows, vocab]: every draw is uniform over 1000 tokens
    first, again = run(flat, same_params(P(), 64)), run(flat, same_params(P(), 64))
    assert tokens(first) == tokens(again)
    assert len(set(tokens(first))) > 55  # 64 uniform draws of 1000 repeat ~2 times
    by_position = [SamplingRow(P(), 7, position) for position in range(64)]
    assert len(set(tokens(run(flat, by_position)))) > 55


# --- the distribution ----------------------------------------------------------------------------
BASE = [0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]
CHI2_P001 = {2: 13.82, 7: 24.32}  # by degrees of freedom; a fixed seed range makes the test deterministic


def renormalized(weights):
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize("params, expected", [
    (P(temperature=1.0), BASE),
    (P(temperature=0.5), renormalized([p ** 2 for p in BASE])),
    (P(temperature=2.0), renormalized([p ** 0.5 for p in BASE])),
    (P(temperature=1.0, top_k=3), renormalized(BASE[:3] + [0.0] * 5)),
    (P(temperature=1.0, top_p=0.7), renormalized(BASE[:3] + [0.0] * 5)),  # 0.6 < 0.7 <= 0.75
], ids=["t1", "t0.5", "t2", "top_k3", "top_p0.7"])
def test_draws_follow_the_tempered_filtered_softmax(params, expected):
    n = 20_000
    logits = torch.tensor([BASE]).log().expand(n, -1) - 2.0  # [n, vocab]
    counts = torch.bincount(torch.tensor(tokens(run(logits, same_params(params, n, position=11)))), minlength=8)
    assert all(counts[i] == 0 for i, p in enumerate(expected) if p == 0)
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts.tolist(), expected) if p > 0)
    assert chi2 < CHI2_P001[sum(p > 0 for p in expected) - 1], (chi2, counts.tolist())


@pytest.mark.slow
def test_a_long_tail_of_rare_tokens_gets_its_mass():
    """5000 tokens of probability 2e-5 each: together they get their 10% of the draws."""
    n, tail = 2000, 5000
    logits = torch.full((n, tail + 1), math.log(0.1 / tail))  # [n, vocab]
    logits[:, 0] = math.log(0.9)
    drawn = torch.tensor(tokens(run(logits, same_params(P(), n))))  # [n]
    tail_share = (drawn != 0).float().mean().item()
    assert abs(tail_share - 0.1) < 4 * math.sqrt(0.09 / n)
    assert len(set(drawn.tolist())) > 150  # spread over the tail, not stuck on a few ids


# --- bad rows ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_rows_are_flagged_and_leave_the_others_alone(temperature):
    torch.manual_seed(3)
    logits = torch.randn(4, 50)  # [rows, vocab]
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    rows = same_params(P(temperature=temperature, top_k=10), 4)
    results = run(logits, rows)
    assert [r.problem for r in results] == [None, PROBLEMS[1], PROBLEMS[2], PROBLEMS[3]]
    assert results[0] == alone(logits, rows)[0]


def test_a_nan_temperature_is_flagged_not_taken_for_greedy():
    results = run(torch.randn(2, 50), [SamplingRow(P(temperature=float("nan")), 1, 0), SamplingRow(P(), 1, 0)])
    assert [r.problem for r in results] == [PROBLEMS[3], None]


# --- logprobs --------------------------------------------------------------------------------------
def test_logprobs_are_the_raw_distributions_for_the_rows_that_ask():
    torch.manual_seed(4)
    logits = torch.randn(3, 100) * 2  # [rows, vocab]
    rows = [SamplingRow(P(temperature=0.7), 1, 0), SamplingRow(P(temperature=0.7, logprobs=0), 2, 0),
            SamplingRow(P(temperature=0.7, logprobs=3), 3, 0)]
    results = run(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)  # [rows, vocab]: before temperature, as OpenAI reports
    assert results[0].logprob is None and results[0].top == ()
    assert results[1].logprob == pytest.approx(raw[1, results[1].token].item(), abs=1e-6) and results[1].top == ()
    best = torch.topk(raw[2], 3)
    assert [t for t, _ in results[2].top] == best.indices.tolist()
    assert [v for _, v in results[2].top] == pytest.approx(best.values.tolist(), abs=1e-6)


def test_sampling_reads_the_device_once(monkeypatch):
    """Every way a tensor reaches the host, counted: a step makes exactly one (on CUDA, the one copy)."""
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n),
                                                                                                _o(self, *a, **k))[1])
    torch.manual_seed(5)
    results = run(torch.randn(len(MIXED), 200), mixed_rows())
    assert reads == ["tolist"] and len(results) == len(MIXED)


# --- the engine ------------------------------------------------------------------------------------
def flat_engine():
    """The fake runner's logits scaled down, so that sampling at temperature 1 is far from greedy."""
    engine, runner = make_engine()
    forward = runner.forward
    runner.forward = lambda seqs, tables: forward(seqs, tables) * 0.1  # [len(seqs), vocab]
    return engine


def seeded(request_id, prompt, seed):
    handoff = fake_handoff(request_id, prompt, 12)
    return dataclasses.replace(handoff, sampling=P(temperature=1.0, seed=seed, max_tokens=12))


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch():
    prompt = [5, 6, 7, 8]
    alone_tokens = run_engine(flat_engine(), [seeded("s", prompt, 1234)])[0]["s"]
    others = [seeded(f"o{i}", [9 + i] * (3 + i), seed=i) for i in range(3)]
    batched = run_engine(flat_engine(), [*others, seeded("s", prompt, 1234)])[0]["s"]
    other_seed = run_engine(flat_engine(), [seeded("s", prompt, 4321)])[0]["s"]
    assert batched == alone_tokens and other_seed != alone_tokens
    assert alone_tokens[1:] != expected_tokens(prompt, 12)[1:]  # not greedy: the seed decided


def test_a_row_that_breaks_the_batched_sampler_fails_alone():
    engine, _ = make_engine()
    prompts = {rid: [3 + i, 4, 5] for i, rid in enumerate(["a", "bad", "b"])}
    handoffs = [fake_handoff(rid, p, 8) for rid, p in prompts.items()]
    handoffs[1] = dataclasses.replace(handoffs[1], sampling=P(temperature=1.0, top_k=2 ** 70, max_tokens=8))
    out, endings = run_engine(engine, handoffs)
    assert endings["bad"].finish_reason is FinishReason.ERROR and "sampling failed" in endings["bad"].error
    for rid in ("a", "b"):
        assert out[rid] == expected_tokens(prompts[rid], 8)


@pytest.mark.gpu
def test_cuda_sampling_is_sync_free_and_matches_each_row_alone():
    cuda = torch.device("cuda")
    torch.manual_seed(6)
    logits = (torch.randn(len(MIXED), 32_000) * 3).to(cuda)  # [rows, vocab]
    batch = SamplingBatch.build(mixed_rows(), cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = sample_packed(logits, batch)  # [rows, columns]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert packed.device.type == "cuda"
    assert tokens(run(logits, mixed_rows(), cuda)) == tokens(alone(logits, mixed_rows(), cuda))
