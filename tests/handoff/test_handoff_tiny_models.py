"""Exactness of the handoff on tiny F32/F16-weight models, for both RoPE families and both V layouts.

llama.cpp prefills, its KV crosses the wire, torch imports it; the result must match torch's own prompt
KV layer by layer, and greedy continuations from the two must be identical.
"""

import dataclasses

import llama_cpp
import pytest
import torch

from contracts.handoff import SamplingParams, decode_handoff, encode_handoff
from decode_gpu.kv.importer import import_handoff
from decode_gpu.model.loader import load_decode_model
from decode_gpu.reference.dense_cache import DenseKVCache
from decode_gpu.reference.dense_decoder import decode, prompt_cache
from prefill_cpu.prefiller import PrefillCancelledError, PrefillConfig, Prefiller, PrefillRequest
from tiny_gguf import prompts

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
# (kv type, flash attention, per-layer relative error bound); f16 without flash attention stores V transposed
KV_CASES = [("f16", False, 0.01), ("f16", True, 0.01), ("q8_0", True, 0.03), ("q4_0", True, 0.15)]
MODELS = [("llama", "f32"), ("qwen2", "f32"), ("llama", "f16"), ("qwen2", "f16")]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-{m[1]}")
def tiny_model(request, tiny_gguf, conversion_cache):
    arch, weights = request.param
    path = tiny_gguf(arch, weights)
    from contracts.identity import read_gguf_identity
    identity = read_gguf_identity(str(path))
    return path, identity, load_decode_model(identity, CPU, torch.float32, conversion_cache)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def assert_matches_torch(handoff, tokens, identity, model, bound: float, continuation: int) -> None:
    """Imported K/V within `bound` of torch's own prompt KV, layer by layer; with continuation > 0, the same
    first token and the same greedy continuation of that many tokens from both caches."""
    imported = DenseKVCache(model.config, torch.float32)
    import_handoff(handoff, identity, imported, CPU)
    reference, last_logits = prompt_cache(model, list(tokens))
    for layer in range(identity.n_layer):
        ref, got = reference.layers[layer], imported.cache.layers[layer]
        assert relative_error(got.keys, ref.keys) < bound, f"K of layer {layer}"
        assert relative_error(got.values, ref.values) < bound, f"V of layer {layer}"
    if continuation:
        assert handoff.first_token == int(last_logits.argmax())
        assert decode(model, imported.cache, handoff.first_token, continuation) == \
            decode(model, reference, handoff.first_token, continuation)


@pytest.mark.parametrize("kv_type,flash_attn,bound", KV_CASES, ids=[f"{c[0]}-fa{int(c[1])}" for c in KV_CASES])
def test_import_matches_torch_prompt_kv(tiny_model, kv_type, flash_attn, bound):
    path, identity, model = tiny_model
    # n_batch 32 so the longer prompts are prefilled in several chunks
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_batch=32, n_threads=2, kv_type=kv_type,
                                        flash_attn=flash_attn))
    try:
        for i, tokens in enumerate(prompts()):
            handoff = decode_handoff(encode_handoff(
                prefiller.prefill(PrefillRequest(f"r{i}", tokens, GREEDY)).handoff))
            assert handoff.layout.v_transposed == (not flash_attn)
            assert (handoff.layout.k_rotation > 0) == (kv_type != "f16")
            # 4-bit KV is allowed to drift: its bound is the check, not the continuation
            assert_matches_torch(handoff, tokens, identity, model, bound, continuation=0 if kv_type == "q4_0" else 32)
    finally:
        prefiller.close()


@pytest.mark.parametrize("kv_type,flash_attn,bound", [KV_CASES[0], KV_CASES[2]], ids=["f16-fa0", "q8_0-fa1"])
def test_prompts_that_reuse_cached_cells_still_match_torch(tiny_model, kv_type, flash_attn, bound):
    """With the prompt cache, a prompt sharing 50 tokens with an earlier one copies those cells and
    prefills 25; a prompt preempted after its first chunk resumes from it. Both exports match torch."""
    path, identity, model = tiny_model
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_batch=32, n_threads=2, kv_type=kv_type,
                                        flash_attn=flash_attn, prefix_cache_tokens=512, prefix_cache_entries=2))
    try:
        _, other, base = prompts()
        first = prefiller.prefill(PrefillRequest("base", base, GREEDY))
        assert first.cached_tokens == 0
        branch = base[:50] + other[:25]
        outcomes = [prefiller.prefill(PrefillRequest("branch", branch, GREEDY))]
        assert outcomes[0].cached_tokens == 50
        resumed = other[:20] + base[:60]
        memory = llama_cpp.llama_get_memory(prefiller.ctx)
        # cancelled while the second chunk computes (its cells are placed by then): the first chunk is kept
        with pytest.raises(PrefillCancelledError, match="within the chunk at 32 of 80"):
            prefiller.prefill(PrefillRequest("resumed", resumed, GREEDY),
                              should_cancel=lambda: llama_cpp.llama_memory_seq_pos_max(memory, 0) >= 63)
        outcomes.append(prefiller.prefill(PrefillRequest("resumed", resumed, GREEDY)))
        assert outcomes[1].cached_tokens == 32
        for tokens, outcome in zip((branch, resumed), outcomes):
            handoff = decode_handoff(encode_handoff(outcome.handoff))
            assert_matches_torch(handoff, tokens, identity, model, bound, continuation=16)
    finally:
        prefiller.close()


def test_second_prompt_in_the_same_context_is_independent(tiny_model):
    """The sequence is freed after export: prefilling B after A exports exactly what B alone exports."""
    path, _, _ = tiny_model
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_batch=32, n_threads=2, kv_type="q8_0"))
    try:
        first, second, _ = prompts()
        alone = prefiller.prefill(PrefillRequest("b", second, GREEDY)).handoff
        prefiller.prefill(PrefillRequest("a", first, GREEDY))
        after = prefiller.prefill(PrefillRequest("b", second, GREEDY)).handoff
        assert after.k_layers == alone.k_layers and after.v_layers == alone.v_layers
    finally:
        prefiller.close()


def test_a_cancel_inside_one_chunk_stops_it_and_the_context_stays_usable(tiny_model):
    """llama.cpp's abort callback sees the cancel mid-chunk (the 75-token prompt is one 128-token chunk),
    and the next prompt in the same context exports exactly what it exports alone."""
    path, _, _ = tiny_model
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_batch=128, n_threads=2, kv_type="q8_0"))
    try:
        first, second, third = prompts()
        alone = prefiller.prefill(PrefillRequest("b", second, GREEDY)).handoff
        asked = []

        def cancel_after_the_chunk_started() -> bool:
            asked.append(True)
            return len(asked) > 1  # the first question comes before the chunk, the rest from inside it

        with pytest.raises(PrefillCancelledError, match="within the chunk"):
            prefiller.prefill(PrefillRequest("c", third, GREEDY), should_cancel=cancel_after_the_chunk_started)
        assert len(asked) == 2
        after = prefiller.prefill(PrefillRequest("b", second, GREEDY)).handoff
        assert after.k_layers == alone.k_layers and after.v_layers == alone.v_layers
    finally:
        prefiller.close()


@pytest.mark.parametrize("wrong", [dict(k_rotation=0, v_rotation=0), dict(rope_layout="neox")],
                         ids=["no-unrotation", "no-unpermutation"])
def test_a_missing_inverse_transform_is_caught(tiny_model, wrong):
    """Negative control: the error bounds above do fail when one inverse transform is skipped."""
    path, identity, model = tiny_model
    if "rope_layout" in wrong and identity.rope_layout == "neox":
        pytest.skip("NEOX models are not permuted")
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_threads=2, kv_type="q8_0"))
    try:
        tokens = prompts()[1]
        handoff = prefiller.prefill(PrefillRequest("r", tokens, GREEDY)).handoff
    finally:
        prefiller.close()
    broken = dataclasses.replace(handoff, layout=dataclasses.replace(handoff.layout, **wrong))
    imported = DenseKVCache(model.config, torch.float32)
    import_handoff(broken, dataclasses.replace(identity, rope_layout=broken.layout.rope_layout), imported, CPU)
    reference, _ = prompt_cache(model, list(tokens))
    assert relative_error(imported.cache.layers[0].keys, reference.layers[0].keys) > 0.3


def test_threads_follow_the_cpu_share_file_between_chunks(tiny_model, tmp_path):
    """A worker next to a decoding engine halves its threads from the next chunk on, unless its prompt outranks
    everything that decodes (that decode yields to it); the KV is the same either way."""
    from contracts.cpu_share import CpuShare
    path, _, _ = tiny_model
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_batch=32, n_threads=2, kv_type="q8_0"))
    engine, worker = CpuShare(str(tmp_path / "cpu-share")), CpuShare(str(tmp_path / "cpu-share"))
    try:
        first, _, _ = prompts()
        alone = prefiller.prefill(PrefillRequest("a", first, GREEDY)).handoff
        asked = []
        prefiller.threads_now = lambda priority: asked.append(priority) or worker.threads_for(priority, 2)
        assert worker.decoding() is None  # no file yet: idle
        engine.set_decoding(5)  # the engine decodes sequences of priority 5 and worse
        shared = prefiller.prefill(PrefillRequest("a", first, GREEDY, priority=5)).handoff
        assert prefiller._threads_in_use == 1 and asked and set(asked) == {5}
        prefiller.prefill(PrefillRequest("a", first, GREEDY, priority=0))  # outranks decode: all threads
        assert prefiller._threads_in_use == 2
        engine.set_decoding(None)
        assert worker.decoding() is None and worker.threads_for(9, 2) == 2
        assert shared.k_layers == alone.k_layers and shared.v_layers == alone.v_layers
    finally:
        prefiller.close()
        engine.close()
        worker.close()


class _Rows:
    """KVWriter that keeps what it is given."""

    def __init__(self):
        self.layers = {}

    def write_layer(self, layer, keys, values):
        self.layers[layer] = (keys, values)


@pytest.mark.parametrize("kv_type,flash_attn", [("f16", False), ("q8_0", True)], ids=["f16-transposed-v", "q8_0"])
def test_an_import_from_a_cached_prefix_writes_exactly_the_remaining_rows(tiny_model, kv_type, flash_attn):
    """Prefix caching imports positions start..n-1 only: the same rows a whole import gives for them."""
    path, identity, _ = tiny_model
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_threads=2, kv_type=kv_type, flash_attn=flash_attn))
    try:
        handoff = prefiller.prefill(PrefillRequest("r", prompts()[1], GREEDY)).handoff  # 40 tokens
    finally:
        prefiller.close()
    whole, tail = _Rows(), _Rows()
    import_handoff(handoff, identity, whole, CPU)
    import_handoff(handoff, identity, tail, CPU, start=32)
    for layer in range(identity.n_layer):
        assert tail.layers[layer][0].shape[0] == 8
        assert torch.equal(tail.layers[layer][0], whole.layers[layer][0][32:])
        assert torch.equal(tail.layers[layer][1], whole.layers[layer][1][32:])
