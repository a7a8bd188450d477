"""The native decoder forward (decode_gpu.model.native_decoder) against transformers, for every family fixture
(tests/tiny_gguf.py): the paged engine's greedy tokens equal the dense reference decoder's (transformers' own
forward over a DynamicCache) in float32 over a 64-token continuation, and its logits at every position of a
teacher-forced continuation are within LOGIT_BOUND of transformers'.

Both start from the same KV: the prompt's, computed by transformers and carried as an f16 handoff, imported into
the paged pool for the engine and into a dense cache for the reference. Gemma's prompts are shorter than its
sliding window (the dense cache then holds them whole), and the continuation runs past it, so the window cuts.
"""

import dataclasses

import pytest
import torch

from contracts.handoff import KVHandoff, KVLayout, SamplingParams
from contracts.identity import read_gguf_identity
from decode_gpu.engine import DecodeEngine
from decode_gpu.kv.importer import import_handoff
from decode_gpu.model.fused_projections import fuse_projections
from decode_gpu.model.loader import load_decode_model
from decode_gpu.model.native_decoder import NativeDecoder, resolve_forward
from decode_gpu.reference.dense_cache import DenseKVCache
from decode_gpu.reference.dense_decoder import decode, prompt_cache, teacher_forced_logits
from decode_gpu.runner.cost_probe import Probe
from decode_gpu.runner.memory_moves import PagedKVWriter
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from tiny_gguf import ARCHS, GEMMA_WINDOW, prompts

CPU = torch.device("cpu")
CONTINUATION = 64
# max |native - transformers| over a position's logits, relative to that position's largest |logit|: float32
# differences of summation order only (measured: under 1e-6 on every family)
LOGIT_BOUND = 1e-5


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tiny_gguf, conversion_cache):
    path = tiny_gguf(request.param)
    # the handoffs below carry transformers' own K, in its layout
    identity = dataclasses.replace(read_gguf_identity(str(path)), rope_layout="neox")
    model = load_decode_model(identity, CPU, torch.float32, conversion_cache)
    fuse_projections(model)  # as the engine loads it (load_weights): one q/k/v and one gate/up matrix a layer
    return request.param, identity, model


def _prompts(identity) -> list[list[int]]:
    short, long = prompts(2)
    chosen = [list(short), list(long[:GEMMA_WINDOW - 3])]
    return chosen if identity.swa_layers else [*chosen, list(long)]


def _handoff(model, identity, request_id: str, prompt: list[int]) -> KVHandoff:
    """transformers' prompt KV as an f16 handoff (what a prefill worker would send)."""
    cache, logits = prompt_cache(model, prompt)
    to_bytes = lambda x: x[0].transpose(0, 1).to(torch.float16).contiguous().numpy().tobytes()  # noqa: E731
    layout = KVLayout(n_layer=identity.n_layer, num_kv_heads=identity.num_kv_heads, head_dim_k=identity.head_dim_k,
                      head_dim_v=identity.head_dim_v, k_dtype="f16", v_dtype="f16", v_transposed=False, k_rotation=0,
                      v_rotation=0, rope_layout="neox", swa_layers=identity.swa_layers)
    return KVHandoff(request_id=request_id, model_fingerprint=identity.fingerprint, layout=layout,
                     positions=tuple(range(len(prompt))), prompt_tokens=tuple(prompt),
                     first_token=int(logits.argmax()), k_layers=tuple(to_bytes(la.keys) for la in cache.layers),
                     v_layers=tuple(to_bytes(la.values) for la in cache.layers),
                     sampling=SamplingParams(temperature=0.0, max_tokens=CONTINUATION))


def _dense(model, identity, handoff: KVHandoff) -> DenseKVCache:
    cache = DenseKVCache(model.config, torch.float32)
    import_handoff(handoff, identity, cache, CPU)
    return cache


def _engine_tokens(model, identity, handoffs, forward: str, **config) -> dict[str, list[int]]:
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=1024, kv_storage="float32", forward=forward,
                                                       max_model_len=512, **config), CPU)
    engine = DecodeEngine(runner)
    outputs: dict[str, list[int]] = {}
    for event in [e for h in handoffs for e in engine.add(h)]:
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
    while engine.has_work:
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    return outputs


@pytest.mark.slow  # 20-80 s a family on 2 shared cores
def test_native_engine_decodes_what_transformers_decodes_for_64_tokens(family):
    arch, identity, model = family
    handoffs = [_handoff(model, identity, f"r{i}", p) for i, p in enumerate(_prompts(identity))]
    got = _engine_tokens(model, identity, handoffs, "native")
    for handoff in handoffs:
        want = decode(model, _dense(model, identity, handoff).cache, handoff.first_token, CONTINUATION)
        assert len(want) == CONTINUATION
        assert got[handoff.request_id] == want, arch


def test_native_logits_are_within_the_bound_of_transformers(family):
    """Teacher-forced: one verify step feeds a sequence's next 24 tokens at once (a multi-token query)."""
    arch, identity, model = family
    prompt = _prompts(identity)[1]
    handoff = _handoff(model, identity, "t", prompt)
    fed = [handoff.first_token, *[(7 * i) % 300 + 3 for i in range(23)]]
    want = teacher_forced_logits(model, _dense(model, identity, handoff).cache, fed)  # [24, vocab]
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=256, kv_storage="float32", forward="native",
                                                       max_model_len=256), CPU)
    blocks = list(range(-(-(len(prompt) + len(fed)) // runner.pool.shape.block_size)))
    import_handoff(handoff, identity, PagedKVWriter(runner.pool, blocks, len(prompt), CPU), CPU)
    probe = Probe("t", [*prompt, *fed], len(prompt))
    got = runner.verify([probe], {"t": blocks}, [fed[1:]])  # [24, vocab]
    error = ((got - want).abs().amax(dim=-1) / want.abs().amax(dim=-1)).max().item()
    assert error < LOGIT_BOUND, (arch, error)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_native_and_transformers_forwards_agree_in_bfloat16_with_the_torch_path(tiny_gguf, conversion_cache):
    """bfloat16 through both forwards of the paged engine (the same norms' rounding order as transformers'): the same
    greedy tokens on the tiny Qwen3 (q/k norms, biases off) and Gemma 3 (Gemma norms, two rotary tables)."""
    for arch in ("qwen3", "gemma3"):
        identity = dataclasses.replace(read_gguf_identity(str(tiny_gguf(arch))), rope_layout="neox")
        model = load_decode_model(identity, CPU, torch.bfloat16, conversion_cache)
        handoffs = [_handoff(model.float(), identity, f"r{i}", p) for i, p in enumerate(_prompts(identity))]
        model.to(torch.bfloat16)
        native = _engine_tokens(model, identity, handoffs, "native", block_size=16)
        theirs = _engine_tokens(model, identity, handoffs, "transformers", block_size=16)
        agree = sum(a == b for h in handoffs for a, b in zip(native[h.request_id], theirs[h.request_id]))
        assert agree >= 0.9 * sum(len(v) for v in theirs.values()), arch


def test_the_rotary_table_is_transformers_rotary_at_every_position(family):
    arch, identity, model = family
    native = NativeDecoder(model, 300)
    positions = torch.arange(300)[None]
    probe = torch.zeros(1)
    rotary = model.model.rotary_emb
    layer_types = list(dict.fromkeys(model.config.layer_types)) if arch == "gemma3" else [""]  # in layer order
    tables = [rotary(probe, positions, t) if arch == "gemma3" else rotary(probe, positions) for t in layer_types]
    assert len(native.cos) == len(tables)
    for (cos, sin), c, s in zip(tables, native.cos, native.sin):
        assert torch.equal(c, cos[0]) and torch.equal(s, sin[0])


def test_the_forward_is_chosen_by_name_or_environment(monkeypatch):
    monkeypatch.delenv("EDGE_DECODE_FORWARD", raising=False)
    assert resolve_forward() == "native"
    assert resolve_forward("transformers") == "transformers"
    monkeypatch.setenv("EDGE_DECODE_FORWARD", "transformers")
    assert resolve_forward() == "transformers"
    with pytest.raises(ValueError, match="forward must be one of native, transformers, not 'eager'"):
        resolve_forward("eager")


@pytest.mark.gpu
def test_cuda_graphs_hold_the_native_step_and_give_the_eager_tokens():
    """On CUDA the native forward is captured whole (a graph per batch bucket); in deterministic mode its tokens
    equal the eager path's, and the default graphs decode too."""
    from tiny_llama import tiny_engine_setup
    model, identity, handoffs = tiny_engine_setup("cuda")
    fuse_projections(model)
    model.to(torch.bfloat16)
    got = {}
    for name, options in {"graphs": {}, "eager": {"enforce_eager": True}}.items():
        runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=256, max_num_seqs=4, deterministic=True,
                                                           **options), torch.device("cuda"))
        assert (runner.graphs is not None) == (name == "graphs")
        engine = DecodeEngine(runner)
        out: dict[str, list[int]] = {}
        for event in [e for h in handoffs for e in engine.add(h)]:
            out.setdefault(event.request_id, []).extend(event.token_ids)
        while engine.has_work:
            for event in engine.step():
                out.setdefault(event.request_id, []).extend(event.token_ids)
        got[name] = out
    assert got["graphs"] == got["eager"]


def test_gemmas_embedding_scale_survives_an_int8_embedding_table(tiny_gguf, conversion_cache):
    """quantize_model replaces the embedding by an int8 table, which drops transformers' Gemma scaling (its scaled
    embedding module is gone); the native forward applies the scale as a family setting, so the int8 model stays
    near the float one."""
    import copy

    from decode_gpu.attention.paged_batch import build_paged_batch
    from decode_gpu.kv.pool import KVPool, PoolShape
    from decode_gpu.model.weight_quant import quantize_model
    identity = read_gguf_identity(str(tiny_gguf("gemma2")))
    model = load_decode_model(identity, CPU, torch.float32, conversion_cache)
    fuse_projections(model)
    quantized = copy.deepcopy(model)
    quantize_model(quantized, "int8", CPU, torch.float32)
    ids, positions = torch.tensor([5, 9, 33]), torch.zeros(3, dtype=torch.long)

    def logits(m):
        pool = KVPool(PoolShape(identity.n_layer, 4, 16, identity.num_kv_heads, identity.head_dim_k, "float32"), CPU)
        paged = build_paged_batch(pool, [[0], [1], [2]], [1, 1, 1], [1, 1, 1], CPU, "torch")
        return NativeDecoder(m, 32)(ids, positions, paged)

    want, got = logits(model), logits(quantized)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.1


def test_the_engine_process_builds_on_the_native_forward_and_logs_its_memory(tiny_gguf, tmp_path, monkeypatch,
                                                                               caplog):
    """build_engine (what `edge serve` starts) on a tiny GGUF: the native forward by default, the transformers one
    when asked; deterministic keeps one weight precision; the memory line is logged."""
    import logging

    from contracts.process_config import EngineProcessConfig
    from decode_gpu.service.server import build_engine
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    wiring = {"model": str(tiny_gguf("qwen2")), "listen": "unix:/tmp/unused.sock", "device": "cpu",
              "weight_dtype": "float32", "kv_cache_tokens": 256, "max_num_seqs": 4, "max_model_len": 256}
    with caplog.at_level(logging.INFO, logger="decode_gpu.service.server"):
        engine = build_engine(EngineProcessConfig(**wiring))
    assert engine.runner.native is not None and not engine.runner.config.deterministic
    assert "engine memory (RSS, MiB)" in caplog.text
    engine = build_engine(EngineProcessConfig(**wiring, decode_forward="transformers"))
    assert engine.runner.native is None
    engine = build_engine(EngineProcessConfig(**wiring, deterministic=True, decode_forward="transformers",
                                              speculative="ngram"))
    assert engine.runner.native is not None and engine.runner.config.deterministic
    assert not engine.config.speculative.enabled
