"""The serving model (decode_gpu.model.serving_model): built from the converted weights without transformers' modeling
code, the native forward on it gives the same logits, bit for bit, as on transformers' own model, for every family
fixture (tests/tiny_gguf.py), through the engine's paged forward and the weight plan's quantized layers; and the
engine process that loads it never imports transformers' modeling code."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from contracts.handoff import KVHandoff, KVLayout, SamplingParams
from contracts.identity import read_gguf_identity
from decode_gpu.kv.importer import import_handoff
from decode_gpu.model.family_config import apply_rope_freqs
from decode_gpu.model.fused_projections import fuse_projections
from decode_gpu.model.loader import load_decode_model
from decode_gpu.model.native_decoder import NativeDecoder
from decode_gpu.model.serving_model import ServingModel, serving_model_from
from decode_gpu.model.weight_quant import quantize_model
from decode_gpu.reference.dense_decoder import prompt_cache
from decode_gpu.runner.cost_probe import Probe
from decode_gpu.runner.memory_moves import PagedKVWriter
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from tiny_gguf import ARCHS, prompts

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_gguf, conversion_cache):
    """(arch, identity, transformers' model, the serving model), both fused as the engine loads them."""
    identity = dataclasses.replace(read_gguf_identity(str(tiny_gguf(request.param))), rope_layout="neox")
    theirs = load_decode_model(identity, CPU, torch.float32, conversion_cache)
    ours = load_decode_model(identity, CPU, torch.float32, conversion_cache, serving=True)
    assert isinstance(ours, ServingModel)
    for model in (theirs, ours):
        fuse_projections(model)
    return request.param, identity, theirs, ours


def _handoff(model, identity, prompt: list[int]) -> KVHandoff:
    """transformers' prompt KV as an f16 handoff (what a prefill worker would send)."""
    cache, logits = prompt_cache(model, prompt)
    to_bytes = lambda x: x[0].transpose(0, 1).to(torch.float16).contiguous().numpy().tobytes()  # noqa: E731
    layout = KVLayout(n_layer=identity.n_layer, num_kv_heads=identity.num_kv_heads, head_dim_k=identity.head_dim_k,
                      head_dim_v=identity.head_dim_v, k_dtype="f16", v_dtype="f16", v_transposed=False, k_rotation=0,
                      v_rotation=0, rope_layout="neox", swa_layers=identity.swa_layers)
    return KVHandoff(request_id="t", model_fingerprint=identity.fingerprint, layout=layout,
                     positions=tuple(range(len(prompt))), prompt_tokens=tuple(prompt),
                     first_token=int(logits.argmax()), k_layers=tuple(to_bytes(la.keys) for la in cache.layers),
                     v_layers=tuple(to_bytes(la.values) for la in cache.layers),
                     sampling=SamplingParams(temperature=0.0, max_tokens=8))


def _verify_logits(model, identity, handoff: KVHandoff, fed: list[int]) -> torch.Tensor:
    """The native forward's logits at each of `fed`'s positions after the handoff's prompt (one verify step)."""
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=256, kv_storage="float32", forward="native",
                                                       max_model_len=256), CPU)
    prompt = list(handoff.prompt_tokens)
    blocks = list(range(-(-(len(prompt) + len(fed)) // runner.pool.shape.block_size)))
    import_handoff(handoff, identity, PagedKVWriter(runner.pool, blocks, len(prompt), CPU), CPU)
    return runner.verify([Probe("t", [*prompt, *fed], len(prompt))], {"t": blocks}, [fed[1:]])


def test_the_native_forward_on_the_serving_model_is_bit_for_bit_transformers_models(pair):
    arch, identity, theirs, ours = pair
    prompt = list(prompts(2)[0])
    handoff = _handoff(theirs, identity, prompt)
    fed = [handoff.first_token, *[(7 * i) % 300 + 3 for i in range(15)]]
    want = _verify_logits(theirs, identity, handoff, fed)
    got = _verify_logits(ours, identity, handoff, fed)
    assert torch.equal(got, want), (arch, (got - want).abs().max().item())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_serving_model_over_a_transformers_models_tensors_shares_them_and_gives_its_logits(arch, tiny_gguf,
                                                                                            conversion_cache):
    """What the GPU check serves (checks/gpu_forward.py): random transformers models, the native forward on a serving
    model over their storage."""
    identity = dataclasses.replace(read_gguf_identity(str(tiny_gguf(arch))), rope_layout="neox")
    theirs = load_decode_model(identity, CPU, torch.float32, conversion_cache)
    ours = serving_model_from(theirs.config, theirs.generation_config, dict(theirs.state_dict()))
    apply_rope_freqs(ours)  # as the loader does (Llama 3's GGUF RoPE divisors)
    assert isinstance(ours, ServingModel)
    mine, their = ours.model.layers[0].self_attn.o_proj.weight, theirs.model.layers[0].self_attn.o_proj.weight
    assert mine.data_ptr() == their.data_ptr()  # no copy
    if theirs.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    for model in (theirs, ours):
        fuse_projections(model)
    prompt = list(prompts(1)[0])
    handoff = _handoff(theirs, identity, prompt)
    fed = [handoff.first_token, *[(5 * i) % 300 + 3 for i in range(7)]]
    got, want = _verify_logits(ours, identity, handoff, fed), _verify_logits(theirs, identity, handoff, fed)
    assert torch.equal(got, want), (got - want).abs().max(-1).values


def test_each_layers_settings_are_what_transformers_sets(pair):
    """Scale, sliding window, soft-capping, norms' form and eps, rotary tables and the activation, layer by layer."""
    arch, _, theirs, ours = pair
    a, b = NativeDecoder(theirs, 300), NativeDecoder(ours, 300)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert (x.scale, x.extras, x.rotary) == (y.scale, y.extras, y.rotary), arch
        for name in ("attn_norm", "qk_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm"):
            n, m = getattr(x, name), getattr(y, name)
            assert (n is None) == (m is None), (arch, name)
            if n is not None:
                assert (n.eps, n.in_float) == (m.eps, m.in_float) and torch.equal(n.weight, m.weight), (arch, name)
        probe = torch.linspace(-4, 4, 64)
        assert torch.equal(x.act(probe), y.act(probe)), arch
    assert all(torch.equal(c, d) for c, d in zip(a.cos + a.sin, b.cos + b.sin, strict=True)), arch
    assert (a.embed_scale is None) == (b.embed_scale is None) or arch.startswith("gemma"), arch
    assert theirs.generation_config.eos_token_id == ours.generation_config.eos_token_id
    # every linear layer's sizes are its weight's (the weight plan sizes its inputs by in_features), tied head included
    linears = {name: m for name, m in ours.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head" in linears and all((m.out_features, m.in_features) == tuple(m.weight.shape)
                                        for m in linears.values()), arch
    tied = theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight
    assert (ours.lm_head.weight is ours.get_input_embeddings().weight) == tied, arch


def test_quantized_layers_of_the_serving_model_give_transformers_logits(tiny_gguf, conversion_cache):
    """The weight plan replaces the serving model's linear layers and embedding as it does transformers' (int8, the
    head tied or not): the same logits."""
    identity = dataclasses.replace(read_gguf_identity(str(tiny_gguf("qwen3"))), rope_layout="neox")
    handoff = None
    logits = []
    for serving in (False, True):
        model = load_decode_model(identity, CPU, torch.float32, conversion_cache, serving=serving)
        handoff = handoff or _handoff(model, identity, list(prompts(2)[0]))
        fuse_projections(model)
        quantize_model(model, "int8", CPU, torch.float32)
        logits.append(_verify_logits(model, identity, handoff, [handoff.first_token, 5, 9, 17]))
    assert torch.equal(*logits)


def test_the_engine_process_never_imports_transformers_modeling_code(tiny_gguf, conversion_cache):
    """What the serving model is for: an engine on the native forward loads, fuses, quantizes and builds its runner
    without transformers.modeling_utils (and so without torch._dynamo: about 165 MB and 1.3-2 s)."""
    path = tiny_gguf("llama")
    load_decode_model(read_gguf_identity(str(path)), CPU, torch.float32, conversion_cache)  # converted here
    script = textwrap.dedent(f"""
        import pathlib
        import sys
        import torch
        import decode_gpu.service.server  # the engine process's entry
        from contracts.identity import read_gguf_identity
        from decode_gpu.model import loader
        from decode_gpu.model.weight_quant import load_weights
        from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
        real = loader.load_decode_model
        loader.load_decode_model = lambda *a, **k: real(*a[:3], pathlib.Path({str(conversion_cache)!r}), **k)
        identity = read_gguf_identity({str(path)!r})
        model, _ = load_weights(identity, torch.device("cpu"), torch.float32, "int8", 8, serving=True)
        ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=256, kv_storage="float32"), torch.device("cpu"))
        heavy = sorted(m for m in ("transformers.modeling_utils", "torch._dynamo") if m in sys.modules)
        print("imported:", heavy)
        sys.exit(1 if heavy else 0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
