"""The shared-prefix workload: N_REQUESTS greedy handoffs that share one SYSTEM_TOKENS-token system prompt, from one
llama.cpp worker with its prompt cache (the prefix prefilled once, its cells copied), as in serving. Its benchmark
is bench/prefix_bench.py; tests/decode_gpu/test_prefix_caching.py checks prefix caching on it."""

from __future__ import annotations

from contracts.handoff import SamplingParams
from prefill_cpu.prefiller import Prefiller, PrefillRequest

SYSTEM = ("You are the appliance's assistant. Answer in plain words, cite the manual's section numbers, never "
          "invent a setting that the configuration reference does not list, and say so when you do not know. ")
N_REQUESTS, SYSTEM_TOKENS, BLOCK, OUTPUT = 16, 300, 16, 16


def shared_prefix_handoffs(prefiller: Prefiller) -> list:
    """N_REQUESTS greedy handoffs: one SYSTEM_TOKENS system prompt, then a question each."""
    system = prefiller.tokenize(SYSTEM * 10)[:SYSTEM_TOKENS]
    handoffs = []
    for i in range(N_REQUESTS):
        question = prefiller.tokenize(f" Question {i}: how do I change setting number {i * 7}?")
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT)
        handoffs.append(prefiller.prefill(PrefillRequest(f"q{i:02d}", tuple(system + question), params)).handoff)
    return handoffs
