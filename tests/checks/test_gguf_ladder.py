"""bench/gguf_ladder.py: a rung of real shape, random weights, written tensor by tensor; checked on the tiny rung
(the 1B's code path: llama3 RoPE, tied output), a tiny Qwen2 (biases) and a tiny untied Llama (the 8B's output)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench import gguf_ladder
from bench.gguf_ladder import SHAPES, ladder_sizes, q4_k_m_type
from contracts.gguf_header import read_header
from contracts.model_sizes import model_sizes

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, dict]:
    return gguf_ladder.build(tmp_path_factory.mktemp("ladder"), "tiny", ("f16", "q4_k_m"))


def _field(header, key):
    return header.get_field(key).contents()


def test_tiny_rung_has_the_shape_its_metadata_says(tiny) -> None:
    shape = SHAPES["tiny"]
    header = read_header(tiny["f16"]["path"])
    assert _field(header, "general.architecture") == "llama"
    assert [_field(header, f"llama.{k}") for k in ("block_count", "embedding_length", "feed_forward_length",
                                                    "attention.head_count", "attention.head_count_kv", "vocab_size")] \
        == [shape.n_layer, shape.n_embd, shape.n_ff, shape.n_head, shape.n_kv_head, shape.n_vocab]
    assert _field(header, "llama.rope.freq_base") == shape.rope_theta
    assert _field(header, "general.file_type") == 1  # MOSTLY_F16
    # every tensor, in the written order, with ggml's reversed shape; matrices f16, vectors f32
    written = [(t.name, t.shape, t.tensor_type.name) for t in header.tensors]
    assert written == [(name, tuple(reversed(dims)), "F16" if kind == "matrix" else "F32")
                       for name, dims, kind in shape.tensors()]
    assert "output.weight" not in {t.name for t in header.tensors}  # tied


def test_tokenizer_is_the_embedded_one_padded_to_the_vocabulary(tiny) -> None:
    embedded = gguf_ladder.embedded_tokenizer()
    header = read_header(tiny["f16"]["path"])
    tokens, types = _field(header, "tokenizer.ggml.tokens"), _field(header, "tokenizer.ggml.token_type")
    n_embedded = len(embedded["tokenizer.ggml.tokens"])
    assert len(tokens) == len(types) == SHAPES["tiny"].n_vocab > n_embedded
    assert tokens[:n_embedded] == embedded["tokenizer.ggml.tokens"]
    assert tokens[n_embedded:] == [gguf_ladder.PAD_TOKEN.format(i) for i in range(len(tokens) - n_embedded)]
    assert set(types[n_embedded:]) == {5}  # gguf.TokenType.UNUSED
    assert _field(header, "tokenizer.chat_template") == embedded["tokenizer.chat_template"]
    assert _field(header, "tokenizer.ggml.merges") == embedded["tokenizer.ggml.merges"]


def _tensor_data(path: str) -> dict[str, np.ndarray]:
    """Each tensor's values, found from the end of the file: the data section ends with the last tensor, padded to
    the GGUF alignment (32). (gguf's own reader takes seconds over the 49k-token vocabulary.)"""
    import os
    header = read_header(path)
    last = max(header.tensors, key=lambda t: t.data_offset)
    start = os.path.getsize(path) - -(-(last.data_offset + last.n_bytes) // 32) * 32
    types = {"F16": np.float16, "F32": np.float32}
    return {t.name: np.fromfile(path, types[t.tensor_type.name], t.n_elements, offset=start + t.data_offset)
            .reshape(tuple(reversed(t.shape))) for t in header.tensors}


def test_weights_are_random_at_the_set_scale_and_rope_freqs_are_llama3s(tiny) -> None:
    by_name = _tensor_data(tiny["f16"]["path"])
    q = by_name["blk.0.attn_q.weight"].astype(np.float32)
    assert abs(q.std() - gguf_ladder.WEIGHT_SCALE) < 0.002 and abs(q.mean()) < 0.002
    assert not np.array_equal(by_name["blk.0.attn_q.weight"], by_name["blk.1.attn_q.weight"])
    assert np.all(by_name["blk.1.ffn_norm.weight"] == 1.0)
    freqs = by_name["rope_freqs.weight"]
    assert np.array_equal(freqs, gguf_ladder.llama3_rope_freqs(SHAPES["tiny"]))
    assert freqs[0] == 1.0 and freqs[-1] == SHAPES["tiny"].llama3_rope[0]  # high frequencies kept, low ones divided


def test_q4_k_m_is_llama_cpps_and_its_projection_is_exact(tiny) -> None:
    header = read_header(tiny["q4_k_m"]["path"])
    matrices = {t.name: t.tensor_type.name for t in header.tensors if len(t.shape) == 2}
    assert matrices == {name: q4_k_m_type(SHAPES["tiny"], name) for name in matrices}
    assert {"Q4_K", "Q6_K"} <= set(matrices.values())
    projected, read = ladder_sizes("tiny", "q4_k_m"), model_sizes(tiny["q4_k_m"]["path"])
    assert projected.file_bytes == sum(t.n_bytes for t in header.tensors)
    assert dataclasses.replace(projected, name=read.name, file_bytes=read.file_bytes, layers=()) == \
        dataclasses.replace(read, layers=())
    assert sorted(map(str, projected.layers)) == sorted(map(str, read.layers))


def test_both_files_load_in_llama_cpp_with_finite_logits(tiny) -> None:
    for kind in ("f16", "q4_k_m"):
        assert 0 < tiny[kind]["max_logit"] < 100  # build() checked them: llama.cpp loaded each and evaluated


@pytest.mark.parametrize("family", ["qwen2", "untied"])
def test_other_families_write_and_load(tmp_path, monkeypatch, family: str) -> None:
    tiny = SHAPES["tiny"]
    shape = (dataclasses.replace(SHAPES["3b"], n_layer=2, n_embd=256, n_ff=512, n_head=4, n_kv_head=2,
                                 n_vocab=tiny.n_vocab) if family == "qwen2" else
             dataclasses.replace(tiny, tied=False))
    monkeypatch.setitem(SHAPES, "probe", shape)
    built = gguf_ladder.build(tmp_path, "probe", ("f16",))
    header = read_header(built["f16"]["path"])
    names = {t.name for t in header.tensors}
    assert set(built) == {"f16"} and np.isfinite(built["f16"]["max_logit"])
    if family == "qwen2":
        assert _field(header, "general.architecture") == "qwen2" and "blk.1.attn_k.bias" in names
        assert "rope_freqs.weight" not in names
    else:
        assert "output.weight" in names


def test_a_quantized_only_request_leaves_no_f16_behind(tmp_path) -> None:
    built = gguf_ladder.build(tmp_path, "tiny", ("q4_k_m",), check=False)
    assert set(built) == {"q4_k_m"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ladder-tiny-q4_k_m.gguf"]


def test_the_ladder_shapes_are_the_published_models() -> None:
    # parameter counts of Llama-3.2-1B, Qwen2.5-3B and Llama-3.1-8B as published (1.24B, 3.09B, 8.03B)
    assert [round(SHAPES[s].n_params() / 1e9, 2) for s in ("1b", "3b", "8b")] == [1.24, 3.09, 8.03]
    assert [SHAPES[s].head_dim for s in ("1b", "3b", "8b")] == [64, 128, 128]
