"""Tiny random-weight LLaMA and Qwen2 models, written to GGUF with the `gguf` package.

F32/F16 weights make llama.cpp and torch compute nearly the same math, so the handoff can be held to
tight error bounds. Head size 64 so llama.cpp's Hadamard rotation of quantized KV is exercised.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_VOCAB = 3 + 256 + 61  # <unk> <s> </s>, 256 byte tokens, a few plain tokens
N_EMBD, N_HEAD, N_KV_HEAD, N_FF, N_LAYER = 256, 4, 2, 384, 3
HEAD_DIM = N_EMBD // N_HEAD


def write_tiny_gguf(path: Path, arch: str, weight_dtype: str = "f32", seed: int = 0) -> Path:
    """arch: "llama" (permuted q/k, interleaved RoPE) or "qwen2" (NEOX RoPE, q/k/v biases)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_hparams(writer, arch)
    _write_vocab(writer)
    np_dtype = np.float32 if weight_dtype == "f32" else np.float16
    for name, tensor in _tensors(arch, rng):
        is_matrix = tensor.ndim == 2
        writer.add_tensor(name, tensor.astype(np_dtype if is_matrix else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, arch: str) -> None:
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(2048)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(N_VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _write_vocab(writer: gguf.GGUFWriter) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581tok{i}" for i in range(N_VOCAB - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (N_VOCAB - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * N_VOCAB)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The LLaMA converter's q/k row permutation (HF NEOX halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(arch: str, rng: np.random.Generator):
    def mat(rows, cols, scale=1.0):  # HF layout [out, in]; scaled so activations stay O(1) and logits peaked
        return rng.standard_normal((rows, cols)).astype(np.float32) * scale / np.sqrt(cols)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    yield "token_embd.weight", rng.standard_normal((N_VOCAB, N_EMBD)).astype(np.float32)
    for il in range(N_LAYER):
        q = mat(N_HEAD * HEAD_DIM, N_EMBD)
        k = mat(N_KV_HEAD * HEAD_DIM, N_EMBD)
        if arch == "llama":
            q, k = _permute(q, N_HEAD), _permute(k, N_KV_HEAD)
        yield f"blk.{il}.attn_norm.weight", norm(N_EMBD)
        yield f"blk.{il}.attn_q.weight", q
        yield f"blk.{il}.attn_k.weight", k
        yield f"blk.{il}.attn_v.weight", mat(N_KV_HEAD * HEAD_DIM, N_EMBD)
        yield f"blk.{il}.attn_output.weight", mat(N_EMBD, N_HEAD * HEAD_DIM)
        if arch == "qwen2":
            yield f"blk.{il}.attn_q.bias", 0.1 * rng.standard_normal(N_HEAD * HEAD_DIM).astype(np.float32)
            yield f"blk.{il}.attn_k.bias", 0.1 * rng.standard_normal(N_KV_HEAD * HEAD_DIM).astype(np.float32)
            yield f"blk.{il}.attn_v.bias", 0.1 * rng.standard_normal(N_KV_HEAD * HEAD_DIM).astype(np.float32)
        yield f"blk.{il}.ffn_norm.weight", norm(N_EMBD)
        yield f"blk.{il}.ffn_gate.weight", mat(N_FF, N_EMBD)
        yield f"blk.{il}.ffn_up.weight", mat(N_FF, N_EMBD)
        yield f"blk.{il}.ffn_down.weight", mat(N_EMBD, N_FF)
    yield "output_norm.weight", norm(N_EMBD)
    yield "output.weight", mat(N_VOCAB, N_EMBD, 8.0)
