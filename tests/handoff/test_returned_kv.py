"""A finished answer's KV, returned by the decode engine to the prefill worker, stands for a full prefill of it: the
next turn computes only its new tokens and draws the greedy tokens a prefill of the whole conversation draws."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from contracts.handoff import SamplingParams, decode_handoff
from decode_gpu.engine import DecodeEngine
from decode_gpu.kv.kv_return import KVReturn
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from edge.check_model.command import MAX_KL
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
TURN1 = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat should an operator "
         "check first when an on-prem appliance answers slowly?<|im_end|>\n<|im_start|>assistant\n")
TURN2 = "<|im_end|>\n<|im_start|>user\nAnd after that?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)


def _answer_kv(prefiller, model, prompt: list[int]):
    """Turn 1 prefilled by the worker and decoded by the engine; the KV the engine returns, decoded."""
    out = prefiller.prefill(PrefillRequest("turn1", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=40,
                                                                                  ignore_eos=True)))
    engine = DecodeEngine(ModelRunner(model, prefiller.identity, RunnerConfig(kv_cache_tokens=1024), CPU))
    returned = []
    engine.kv_return = KVReturn(lambda rid, data: returned.append((rid, data)))
    generated = [out.handoff.first_token]
    engine.add(out.handoff)  # its first token is the worker's, generated[0]
    while engine.has_work:
        for event in engine.step():
            generated += event.token_ids
    engine.kv_return.flush()
    engine.kv_return.close()
    assert [rid for rid, _ in returned] == ["turn1"]
    return decode_handoff(returned[0][1]), generated


def _greedy(prefiller, tokens: list[int], n: int, name: str) -> tuple[list[int], list, list[int]]:
    """n greedy tokens drawn by prefilling the growing conversation; each one's log-softmax; tokens cached."""
    drawn, logps, cached = [], [], []
    for i in range(n):
        out = prefiller.prefill(PrefillRequest(f"{name}{i}", tuple(tokens + drawn), GREEDY))
        drawn.append(out.handoff.first_token)
        logits = torch.from_numpy(prefiller._last_logits().copy())  # each prompt is new: its last token was computed
        logps.append(torch.log_softmax(logits.double(), dim=-1))
        cached.append(out.cached_tokens)
    return drawn, logps, cached


# mean KL bound per KV type: f16 within check-model's (MAX_KL; measured 0.0039, largest 0.017 over 8 positions); q8_0
# measured 0.040 mean, one position of 8 at 0.30: the answer's KV is the engine's float32 computation quantized
# again, against llama.cpp's own (its matmuls quantize activations to q8); wrong KV (a bad rotation or permutation)
# gives several nats and other tokens
@pytest.mark.parametrize("kv_type, max_mean_kl", [("f16", MAX_KL), ("q8_0", 0.1)])
def test_the_next_turn_prefills_only_its_new_tokens(kv_type, max_mean_kl, embedded_model_path, embedded_float32):
    config = PrefillConfig(embedded_model_path, n_ctx=1024, n_threads=2, kv_type=kv_type, prefix_cache_tokens=2048)
    worker = Prefiller(config)
    fresh = Prefiller(replace(config, prefix_cache_tokens=0), model=worker.llm)  # no cache: a full prefill each time
    try:
        prompt = worker.tokenize(TURN1)
        handoff, generated = _answer_kv(worker, embedded_float32, prompt)
        # every token whose KV the engine held: the prompt and the answer but its last token (never fed)
        assert handoff.prompt_tokens == tuple(prompt + generated[:-1]) and handoff.first_token == generated[-1]
        assert handoff.layout.k_dtype == kv_type and handoff.cache_salt == ""
        assert worker.keep_returned(handoff) == len(handoff.prompt_tokens)
        assert worker.keep_returned(replace(handoff, model_fingerprint="sha256:other")) == 0  # another model's
        conversation = prompt + generated + worker.tokenize(TURN2, add_special=False)
        ours, our_logps, cached = _greedy(worker, conversation, 8, "ours")
        theirs, their_logps, _ = _greedy(fresh, conversation, 8, "full")
        # turn 2 computed only what follows the answer's KV: its last token and the new message
        assert cached[0] >= len(handoff.prompt_tokens)
        assert ours == theirs
        # KL(full prefill || resumed) per drawn position, nats: within edge check-model's bound (MAX_KL)
        kls = [float((theirs_lp.exp() * (theirs_lp - ours_lp)).sum()) for ours_lp, theirs_lp in
               zip(our_logps, their_logps)]
        print(f"{kv_type}: mean KL {np.mean(kls):.5f}, largest {max(kls):.5f}, cached {cached}")
        assert np.mean(kls) <= max_mean_kl
    finally:
        fresh.close()
        worker.close()
