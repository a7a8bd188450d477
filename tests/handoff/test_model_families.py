"""Every supported model family, end to end on a tiny random-weight GGUF: llama.cpp prefills, the handoff carries
its KV, torch imports it, and both the reference decoder and the paged engine continue exactly as transformers'
own prefill of the same weights does.

What each family adds (tests/tiny_gguf.py): Llama 3.x RoPE frequency divisors, Qwen3's q/k norms, Phi-3's fused
projections and partial rotary, Gemma 2's soft-capping and sliding windows (shorter than the prompts here, so the
window really cuts), Gemma 3's local RoPE base and 5:1 layer pattern. The negative controls show the checks bite:
without the family's own setting the KV or the tokens differ.
"""

import dataclasses

import pytest
import torch
from test_handoff_tiny_models import relative_error
from transformers import LlamaConfig, LlamaForCausalLM

from contracts.handoff import SamplingParams, decode_handoff, encode_handoff
from contracts.identity import UnsupportedModelError, check_supported, read_gguf_identity
from decode_gpu.kv.importer import import_handoff
from decode_gpu.model.family_config import ROPE_FREQS_KEY
from decode_gpu.model.loader import load_decode_model
from decode_gpu.reference.dense_cache import DenseKVCache
from decode_gpu.reference.dense_decoder import decode, prompt_cache
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
from tiny_gguf import GEMMA_WINDOW, LLAMA3_ROPE, prompts, write_tiny_gguf
from tiny_llama import greedy_tokens

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
FAMILIES = ["llama3", "qwen3", "phi3", "gemma2", "gemma3"]
KV_BOUNDS = {"f16": 0.01, "q8_0": 0.03}  # per-layer relative error of K and V, as for llama and qwen2
CONTINUATION = 24


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_gguf, conversion_cache):
    path = tiny_gguf(request.param)
    identity = read_gguf_identity(str(path))
    return request.param, path, identity, load_decode_model(identity, CPU, torch.float32, conversion_cache)


def _handoffs(path, kv_type: str, max_tokens: int = CONTINUATION):
    prefiller = Prefiller(PrefillConfig(str(path), n_ctx=256, n_batch=32, n_threads=2, kv_type=kv_type,
                                        flash_attn=True))
    try:
        return [decode_handoff(encode_handoff(prefiller.prefill(PrefillRequest(
            f"r{i}", tokens, dataclasses.replace(GREEDY, max_tokens=max_tokens))).handoff))
            for i, tokens in enumerate(prompts())]
    finally:
        prefiller.close()


def _engine_tokens(model, identity, handoffs) -> dict[str, list[int]]:
    """The paged engine's greedy tokens; the model's own attention is restored after (the engine swaps it)."""
    attention = model.config._attn_implementation
    try:
        return greedy_tokens(model, identity, handoffs, "cpu", "float32")
    finally:
        model.set_attn_implementation(attention)


def _imported(handoff, identity, model) -> DenseKVCache:
    cache = DenseKVCache(model.config, torch.float32)
    import_handoff(handoff, identity, cache, CPU)
    return cache


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_handoff_matches_transformers_prefill(family, kv_type):
    """Per-layer K/V within bounds of transformers' own prompt KV (a sliding layer's cache keeps its window, in
    both), the same first token, and with f16 the same greedy continuation from both caches."""
    arch, path, identity, model = family
    for tokens, handoff in zip(prompts(), _handoffs(path, kv_type)):
        if identity.swa_layers:
            assert handoff.layout.swa_layers == identity.swa_layers
            # llama.cpp exports the window's cells only: the last GEMMA_WINDOW positions of a longer prompt
            assert handoff.layout.swa_start == max(0, len(tokens) - GEMMA_WINDOW)
        imported = _imported(handoff, identity, model)
        reference, last_logits = prompt_cache(model, list(tokens))
        for layer in range(identity.n_layer):
            ref, got = reference.layers[layer], imported.cache.layers[layer]
            assert relative_error(got.keys, ref.keys) < KV_BOUNDS[kv_type], f"K of layer {layer}"
            assert relative_error(got.values, ref.values) < KV_BOUNDS[kv_type], f"V of layer {layer}"
        assert handoff.first_token == int(last_logits.argmax())
        if kv_type == "f16":  # q8_0's noise may flip a near tie of random weights: its bound above is the check
            assert decode(model, imported.cache, handoff.first_token, CONTINUATION) == \
                decode(model, reference, handoff.first_token, CONTINUATION)


def test_the_paged_engine_decodes_what_transformers_decodes(family):
    """The engine's paged attention (sliding windows and soft-capping included) gives the tokens transformers'
    own decoder gives after its own prefill."""
    arch, path, identity, model = family
    handoffs = _handoffs(path, "f16")
    got = _engine_tokens(model, identity, handoffs)
    for tokens, handoff in zip(prompts(), handoffs):
        reference, _ = prompt_cache(model, list(tokens))
        assert got[handoff.request_id] == decode(model, reference, handoff.first_token, CONTINUATION), arch


def test_llama3_rope_scaling_equals_transformers_own_llama3_rope(tiny_gguf, conversion_cache):
    """The RoPE divisors from the GGUF's rope_freqs give the logits of transformers' own `llama3` RoPE scaling with
    the parameters that made them; without them (what transformers' GGUF loader does) the logits differ."""
    identity = read_gguf_identity(str(tiny_gguf("llama3")))
    ours = load_decode_model(identity, CPU, torch.float32, conversion_cache)
    assert getattr(ours.config, ROPE_FREQS_KEY)
    config = LlamaConfig(**{k: v for k, v in ours.config.to_dict().items() if k != ROPE_FREQS_KEY})
    config.rope_parameters = {**LLAMA3_ROPE, "rope_theta": 10000.0}
    theirs = LlamaForCausalLM(config).eval()
    theirs.load_state_dict(ours.state_dict())
    unscaled = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in ours.config.to_dict().items() if k != ROPE_FREQS_KEY}))
    unscaled.load_state_dict(ours.state_dict())
    ids = torch.tensor([prompts()[2]])  # 75 tokens: past the 32-token original context the scaling acts on
    with torch.inference_mode():
        want = theirs(ids).logits
        assert relative_error(ours(ids).logits, want) < 1e-5
        assert relative_error(unscaled.eval()(ids).logits, want) > 0.01


def test_phi3_rotates_only_part_of_each_head(family):
    """Negative control for partial rotary: with RoPE over the whole head the imported K no longer matches."""
    arch, path, identity, model = family
    if arch != "phi3":
        pytest.skip("partial rotary is Phi-3's")
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.5
    full = type(model)(type(model.config)(**{**model.config.to_dict(),
                                            "rope_parameters": {**model.config.rope_parameters,
                                                                "partial_rotary_factor": 1.0}})).eval()
    full.load_state_dict(model.state_dict())
    tokens = prompts()[1]
    imported = _imported(_handoffs(path, "f16")[1], identity, model)
    reference, _ = prompt_cache(full, list(tokens))
    assert relative_error(imported.cache.layers[0].keys, reference.layers[0].keys) > 0.1


def test_sliding_window_layers_are_really_windowed(family):
    """Negative control for the sliding window: the engine without it (every layer global) decodes other tokens
    than transformers for a prompt longer than the window."""
    arch, path, identity, model = family
    if not identity.swa_layers:
        pytest.skip("no sliding-window layers")
    handoff = _handoffs(path, "f16")[2]  # 75 tokens, window 16
    reference, _ = prompt_cache(model, list(prompts()[2]))
    want = decode(model, reference, handoff.first_token, CONTINUATION)
    windows = {i: layer.self_attn.sliding_window for i, layer in enumerate(model.model.layers)}
    try:
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        # the zeros before the window must not be attended either: a global read of them changes the tokens
        assert _engine_tokens(model, identity, [handoff])[handoff.request_id] != want
    finally:
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.sliding_window = windows[i]


def test_unsupported_architectures_and_features_are_refused_by_name(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3")
    data = path.read_bytes().replace(b"qwen3", b"qwen9")  # the architecture name and every key under it
    (tmp_path / "qwen9.gguf").write_bytes(data)
    with pytest.raises(UnsupportedModelError, match=r"architecture 'qwen9' is not supported; supported: "):
        check_supported(str(tmp_path / "qwen9.gguf"))


def _with_metadata(tmp_path, arch: str, extra) -> str:
    """A copy of the tiny GGUF with more metadata or tensors, written by `extra(writer)`."""
    import gguf
    import numpy as np
    source = gguf.GGUFReader(str(write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)))
    path = tmp_path / f"{arch}-changed.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("arch,extra,message", [
    ("phi3", lambda w: w.add_tensor("rope_factors_long.weight", torch.ones(16).numpy()), "LongRoPE factors"),
    ("llama", lambda w: w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN), "RoPE scaling 'yarn'"),
    ("gemma2", lambda w: w.add_value_length(128), "K head size 256 and V head size 128"),
], ids=["phi3-longrope", "yarn", "k-v-head-sizes"])
def test_unsupported_features_of_supported_families_are_refused_by_name(tmp_path, arch, extra, message):
    with pytest.raises(UnsupportedModelError, match=f"{arch} with {message}"):
        check_supported(_with_metadata(tmp_path, arch, extra))


def test_edge_serve_refuses_an_unsupported_architecture_with_check_models_message(tmp_path, capsys):
    """Before anything starts: the same one-line reason `edge check-model` prints, and a non-zero exit."""
    from edge.cli import main
    data = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3").read_bytes().replace(b"qwen3", b"qwen9")
    path = tmp_path / "qwen9.gguf"
    path.write_bytes(data)
    with pytest.raises(UnsupportedModelError) as refused:
        check_supported(str(path))
    with pytest.raises(SystemExit) as served:
        main(["serve", "--model", str(path)])
    assert served.value.code == f"edge: {refused.value}"
    with pytest.raises(SystemExit) as checked:
        main(["check-model", str(path), "--no-fidelity"])
    assert checked.value.code == 1 and str(refused.value) in capsys.readouterr().out
