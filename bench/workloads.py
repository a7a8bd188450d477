"""Benchmark workloads: mixed prompt lengths (6:3:1), a shared system prompt, and a priority scenario."""

from __future__ import annotations

import numpy as np

from bench.loadgen import RequestSpec

WORDS = ("appliance firewall operator latency request model token cache memory throughput queue priority "
         "engine worker prefill decode batch policy tier signal metric stream answer question river mountain "
         "history science music garden kitchen library window morning evening ocean forest city village").split()
SYSTEM_PROMPT = ("You are the assistant of an on-prem appliance. Answer briefly and precisely. " * 6).strip()


def text_of(n_tokens: int, rng: np.random.Generator) -> str:
    """Roughly n_tokens tokens of filler (about 1.3 tokens per word for this vocabulary)."""
    return " ".join(rng.choice(WORDS, size=max(1, int(n_tokens / 1.3))))


def mixed(n: int, seed: int, max_tokens: int = 64, shared_system: bool = True,
          ignore_eos: bool = False) -> list[RequestSpec]:
    """Prompt lengths 64/256/1024 tokens in a 6:3:1 mix, each under the same system prompt; with ignore_eos
    every answer is max_tokens long, so servers whose weights end answers at different places do the same work."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([64, 256, 1024], size=n, p=[0.6, 0.3, 0.1])
    specs = []
    for length in lengths:
        messages = [{"role": "user", "content": "Summarize: " + text_of(int(length), rng)}]
        if shared_system:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        specs.append(RequestSpec(tuple(messages), max_tokens, label=f"prompt{length}", ignore_eos=ignore_eos))
    return specs


def background(n: int, seed: int, max_tokens: int = 128) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    return [RequestSpec(({"role": "user", "content": "Write a long report about: " + text_of(200, rng)},),
                        max_tokens, priority=10, label="background") for _ in range(n)]


def interactive(n: int, seed: int, max_tokens: int = 16) -> list[RequestSpec]:
    rng = np.random.default_rng(seed + 1)
    return [RequestSpec(({"role": "user", "content": "Quick question: " + text_of(40, rng)},), max_tokens,
                        priority=0, label="interactive") for _ in range(n)]
