"""A prompt prefilled again while it is in the prompt cache gets exactly what its first prefill gave: every KV cell
and the last token's logits, so the same seed draws the same first tokens and the decode engine continues from the
same KV. (A token llama.cpp computes alone rounds otherwise than inside a chunk, so a hit that computed the last
prompt token again would part from the miss.)"""

import numpy as np
import pytest

from contracts.handoff import SamplingParams
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

pytestmark = pytest.mark.slow  # llama.cpp contexts on a tiny GGUF, a few seconds
SEEDED = SamplingParams(temperature=1.0, seed=5, n=3, logprobs=3)
PROMPT = tuple(range(5, 45))  # 40 tokens: two chunks of 32


@pytest.fixture(scope="module")
def prefiller(tiny_gguf):
    prefiller = Prefiller(PrefillConfig(str(tiny_gguf("llama", "f16")), n_ctx=256, n_batch=32, n_threads=2,
                                        kv_type="f16", prefix_cache_tokens=512, prefix_cache_entries=3))
    yield prefiller
    prefiller.close()


def test_a_repeated_prompt_gets_the_cells_and_logits_of_its_first_prefill(prefiller, monkeypatch):
    first = prefiller.prefill(PrefillRequest("a", PROMPT, SEEDED, cache_salt="t"))
    computed = []
    monkeypatch.setattr(prefiller, "_decode_prompt", lambda tokens, cancel, start, *a: computed.append(start))
    again = prefiller.prefill(PrefillRequest("b", PROMPT, SEEDED, cache_salt="t"))
    assert first.cached_tokens == 0 and again.cached_tokens == len(PROMPT) and computed == [len(PROMPT)]
    assert again.handoff.k_layers == first.handoff.k_layers and again.handoff.v_layers == first.handoff.v_layers
    assert again.handoff.positions == first.handoff.positions
    assert again.handoff.first_tokens == first.handoff.first_tokens  # tokens and logprobs, bit for bit
    assert len({t.token for t in first.handoff.first_tokens}) > 1  # three seeded choices, not one repeated


def test_a_longer_or_other_salts_prompt_computes_past_the_cached_prefix(prefiller):
    base = prefiller.prefill(PrefillRequest("a", PROMPT, SEEDED, cache_salt="t"))
    longer = prefiller.prefill(PrefillRequest("c", PROMPT + (50, 51), SEEDED, cache_salt="t"))
    assert longer.cached_tokens == len(PROMPT) and len(longer.handoff.positions) == len(PROMPT) + 2
    other = prefiller.prefill(PrefillRequest("d", PROMPT, SEEDED, cache_salt="u"))
    assert other.cached_tokens == 0
    # the other tenant computed the prompt itself: the same logits up to llama.cpp's rounding, same chunks
    np.testing.assert_allclose([t.logprob for t in other.handoff.first_tokens],
                               [t.logprob for t in base.handoff.first_tokens], atol=1e-4)
