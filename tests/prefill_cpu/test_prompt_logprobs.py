"""Prompt logprobs: the collector's arithmetic on its own, then the prefiller on the embedded model against a
transformers reference, teacher-forced (the same tokens fed to both)."""

import numpy as np
import pytest
import torch

from contracts.handoff import SamplingParams
from prefill_cpu.prompt_logprobs import PromptLogprobCollector

TEXT = ("The capital of France is Paris. The capital of Germany is Berlin, and the river that flows through it is "
        "the Spree. Water boils at one hundred degrees Celsius at sea level. ") * 4
# measured on the embedded model (Q4_1 weights in llama.cpp, q8_0 KV; the reference dequantized to float32):
# mean |difference| 0.04 nats per token, largest 0.40, top-1 agreement 0.96
MEAN_BOUND, MAX_BOUND, TOP1_AGREEMENT = 0.1, 0.6, 0.9


def test_collector_scores_each_token_given_the_ones_before_in_chunks():
    rng = np.random.default_rng(0)
    tokens = [3, 1, 4, 1, 5, 9, 2]
    logits = rng.normal(size=(len(tokens), 11)).astype(np.float32)  # [n, vocab]
    collector = PromptLogprobCollector(tokens, top_k=3)
    collector.add(0, logits[:4])  # two chunks, as the prefiller decodes them
    collector.add(4, logits[4:])
    reference = torch.log_softmax(torch.from_numpy(logits), -1)
    expected = reference[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    np.testing.assert_allclose(collector.logprobs, expected, atol=1e-5)
    top = torch.topk(reference[:-1], 3)
    np.testing.assert_array_equal(collector.top_ids, top.indices.numpy())
    np.testing.assert_allclose(collector.top_logprobs, top.values.numpy(), atol=1e-5)
    ranks = (reference[:-1] > torch.from_numpy(expected)[:, None]).sum(-1).numpy() + 1
    np.testing.assert_array_equal(collector.ranks, ranks)
    entries = collector.entries(lambda t: f"<{t}>")
    assert [e.token_id for e in entries] == tokens[1:] and entries[0].token == "<1>"
    assert [t.token_id for t in entries[2].top] == list(top.indices[2].numpy())


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_teacher_forced(embedded_model_path):
    from decode_gpu.model.loader import load_decode_model
    from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
    prefiller = Prefiller(PrefillConfig(embedded_model_path, n_ctx=512, n_threads=2, kv_type="q8_0",
                                        prefix_cache_tokens=512))
    try:
        tokens = prefiller.tokenize(TEXT)
        assert len(tokens) > 128  # more than one chunk of logits
        plain = prefiller.prefill(PrefillRequest("warm", tuple(tokens), SamplingParams(max_tokens=2)))
        assert plain.prompt_logprobs is None and plain.handoff is not None
        # the prompt is cached now; a scored prompt computes every position all the same
        outcome = prefiller.prefill(PrefillRequest("r", tuple(tokens), SamplingParams(max_tokens=0), prompt_logprobs=4))
        identity = prefiller.identity
    finally:
        prefiller.close()
    assert outcome.handoff is None and outcome.cached_tokens == 0  # max_tokens 0: nothing for an engine
    scored = outcome.prompt_logprobs
    model = load_decode_model(identity, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)  # [n, vocab]
    expected = reference[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    difference = np.abs(scored.logprobs - expected)
    assert difference.mean() < MEAN_BOUND and difference.max() < MAX_BOUND, (difference.mean(), difference.max())
    top1 = reference[:-1].argmax(-1).numpy()
    assert (scored.top_ids[:, 0] == top1).mean() >= TOP1_AGREEMENT
    assert scored.top_ids.shape == (len(tokens) - 1, 4)
