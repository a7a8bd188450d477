"""weight_dtype gguf: the decode engine multiplies the GGUF's own blocks where they lie in a read-only mapping of the
file (decode_gpu/model/gguf_layers.py, gguf_weights.py). Its logits, teacher-forced through the engine's paged
forward, stay within check-model's fidelity bounds (top-1 >= 0.95, mean KL <= 0.01) of the converted float32 model,
for every family fixture in f16 and for Q4_0/Q8_0 blocks written with gguf-py; the matrices are not copied (their
pages are the file's), the embedding is looked up row by row, and auto takes the file's blocks without loading a
float model where the memory plan leaves room for one set only."""

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tiny_gguf
from contracts.handoff import KVHandoff, KVLayout, SamplingParams
from contracts.identity import read_gguf_identity
from decode_gpu.kv.importer import import_handoff
from decode_gpu.model import ggml_linear, gguf_plan, loader
from decode_gpu.model.gguf_layers import GGUFEmbedding, GGUFLinear
from decode_gpu.model.gguf_weights import load_gguf_model
from decode_gpu.model.loader import load_decode_model
from decode_gpu.model.weight_quant import held_weight_dtype, load_weights
from decode_gpu.reference.dense_decoder import prompt_cache
from decode_gpu.runner.cost_probe import Probe
from decode_gpu.runner.memory_moves import PagedKVWriter
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig

CPU = torch.device("cpu")
MIN_TOP1, MAX_KL = 0.95, 0.01  # edge/check_model/command.py's fidelity bounds
pytestmark = pytest.mark.skipif(not ggml_linear.available(), reason="llama-cpp-python's ggml libraries not found")


def write_quantized_gguf(path: Path, arch: str, layers: str, table: str) -> Path:
    """tiny_gguf's model with its matrices in `layers` blocks and the embedding in `table` blocks (gguf-py's own
    quantizer), as the embedded SmolLM2 holds Q4_1 layers and a Q8_0 table."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama" if arch == "llama3" else arch)
    tiny_gguf._write_hparams(writer, arch)
    tiny_gguf._write_vocab(writer)
    for name, tensor in tiny_gguf._tensors(arch, rng):
        if tensor.ndim == 2:
            kind = gguf.GGMLQuantizationType[table if name == "token_embd.weight" else layers]
            writer.add_tensor(name, gguf.quants.quantize(tensor.astype(np.float32), kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def handoff_of(model, identity, prompt: list[int]) -> KVHandoff:
    """The float model's prompt KV as an f16 handoff: both models decode from the same KV."""
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


def verify_logits(model, identity, handoff: KVHandoff, fed: list[int]) -> torch.Tensor:
    """The engine's paged native forward at each of `fed`'s positions after the handoff's prompt. # [len(fed), vocab]"""
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=256, kv_storage="float32", forward="native",
                                                       max_model_len=256), CPU)
    prompt = list(handoff.prompt_tokens)
    blocks = list(range(-(-(len(prompt) + len(fed)) // runner.pool.shape.block_size)))
    import_handoff(handoff, identity, PagedKVWriter(runner.pool, blocks, len(prompt), CPU), CPU)
    return runner.verify([Probe("t", [*prompt, *fed], len(prompt))], {"t": blocks}, [fed[1:]])


def fidelity(want: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(want || got) in nats) over the positions."""
    top1 = float((want.argmax(-1) == got.argmax(-1)).float().mean())
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    return top1, float(kl.sum(-1).mean())


def compare(path: Path, cache: Path, arch: str = "llama") -> tuple[float, float]:
    identity = read_gguf_identity(str(path))
    identity = dataclasses.replace(identity, rope_layout="neox")
    reference = load_decode_model(identity, CPU, torch.float32, cache)  # transformers' model: the prompt's KV
    floats = load_decode_model(identity, CPU, torch.float32, cache, serving=True)
    mapped = load_gguf_model(identity, torch.float32, cache)
    prompt = list(tiny_gguf.prompts(2)[0])
    handoff = handoff_of(reference, identity, prompt)
    fed = [handoff.first_token, *[(7 * i) % 300 + 3 for i in range(15)]]
    return fidelity(verify_logits(floats, identity, handoff, fed), verify_logits(mapped, identity, handoff, fed))


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "phi3", "gemma2"])
def test_the_files_own_f16_blocks_decode_within_the_fidelity_bounds(arch, tiny_gguf, tmp_path):
    top1, kl = compare(tiny_gguf(arch, "f16"), tmp_path, arch)
    assert top1 >= MIN_TOP1 and kl <= MAX_KL, (arch, top1, kl)


@pytest.mark.parametrize("layers, table", [("Q4_0", "Q8_0"), ("Q8_0", "Q5_0")])
def test_quantized_blocks_decode_within_the_fidelity_bounds_of_their_dequantized_floats(layers, table, tmp_path):
    path = write_quantized_gguf(tmp_path / f"tiny-{layers}.gguf", "llama", layers, table)
    top1, kl = compare(path, tmp_path / "cache")
    assert top1 >= MIN_TOP1 and kl <= MAX_KL, (layers, top1, kl)


def test_the_matrices_are_the_files_pages_and_the_embedding_dequantizes_rows(tmp_path):
    path = write_quantized_gguf(tmp_path / "tiny.gguf", "llama", "Q4_0", "Q8_0")
    identity = read_gguf_identity(str(path))
    model = load_gguf_model(identity, torch.float32, tmp_path / "cache")
    mapped = loader._mapped_ranges(".gguf")
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    table = model.model.embed_tokens
    assert len(layers) == 7 * tiny_gguf.N_LAYER + 1  # q, k, v, o, gate, up, down per layer, and the head
    for layer in [*layers, table]:  # every matrix a view of the file's mapping, not a copy
        assert any(a <= layer.qweight.data_ptr() < b for a, b in mapped)
    assert isinstance(table, GGUFEmbedding)
    reader = gguf.GGUFReader(str(path))
    dense = gguf.quants.dequantize(next(t for t in reader.tensors if t.name == "token_embd.weight").data,
                                   gguf.GGMLQuantizationType.Q8_0)  # [vocab, dim]
    ids = torch.tensor([[0, 17], [319, 17]])
    assert torch.equal(table(ids), torch.from_numpy(dense[ids.numpy()]))
    with pytest.raises(IndexError, match="outside the vocabulary"):
        table(torch.tensor([tiny_gguf.N_VOCAB]))
    assert held_weight_dtype(model) == "gguf"


def test_auto_with_room_for_one_set_serves_the_files_blocks_without_loading_floats(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    identity = read_gguf_identity(str(tiny_gguf("llama", "f16")))
    monkeypatch.setattr(loader, "_convert", lambda *a: pytest.fail("converted to floats"))
    model, report = load_weights(identity, CPU, torch.float32, "auto", 8, serving=True, second_set=False)
    assert held_weight_dtype(model) == "gguf" and "room for one weight set" in report.why
    with pytest.raises(ValueError, match="transformers forward"):
        load_weights(identity, CPU, torch.float32, "gguf", 8, serving=False)
    with pytest.raises(ValueError, match="CPU kernels only"):
        load_weights(identity, torch.device("meta"), torch.float32, "gguf", 8, serving=True)


def test_auto_with_room_for_both_takes_the_files_blocks_only_where_they_measure_as_fast(tiny_gguf, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    identity = read_gguf_identity(str(tiny_gguf("llama", "f16")))
    for gguf_s, expected in ((1.0, "gguf"), (1.2, "not gguf")):
        monkeypatch.setattr(gguf_plan, "_turns", lambda theirs, ours, inputs, s=gguf_s: (1.0, s))
        model, report = load_weights(identity, CPU, torch.float32, "auto", 8, serving=True)
        assert (held_weight_dtype(model) == "gguf") == (expected == "gguf"), report.why


@pytest.mark.slow
def test_the_embedded_models_own_blocks_decode_within_the_fidelity_bounds(embedded_identity, embedded_float32,
                                                                          embedded_greedy_runs, tmp_path, monkeypatch):
    """The embedded SmolLM2 (Q4_1 layers, a tied Q8_0 table) on its own blocks against its float32 conversion, both
    decoding from the float model's prompt KV over the float model's own greedy continuations (the teacher-forced
    fidelity tests' inputs): check-model's bounds over every position."""
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    identity = dataclasses.replace(embedded_identity, rope_layout="neox")
    from decode_gpu.model.serving_model import serving_model_from
    floats = serving_model_from(embedded_float32.config, embedded_float32.generation_config,
                                dict(embedded_float32.state_dict()))
    mapped = load_gguf_model(identity, torch.float32)
    want, got = [], []
    for run in embedded_greedy_runs:
        tokens = run[0].tolist()
        prompt, fed = tokens[:-32], tokens[-32:]
        handoff = handoff_of(embedded_float32, identity, prompt)
        want.append(verify_logits(floats, identity, handoff, fed))
        got.append(verify_logits(mapped, identity, handoff, fed))
    top1, kl = fidelity(torch.cat(want), torch.cat(got))
    assert top1 >= MIN_TOP1 and kl <= MAX_KL, (top1, kl)
