"""Tiny random-weight models of each supported family, written to GGUF with the `gguf` package.

F32/F16 weights make llama.cpp and torch compute nearly the same math, so the handoff can be held to
tight error bounds. Head size 64 (Gemma: 256) so llama.cpp's Hadamard rotation of quantized KV is exercised.

Families ("arch" below) and what each adds to the plain LLaMA layout:
- llama: q/k rows permuted by the converter (interleaved RoPE);
- llama3: llama plus a `rope_freqs` tensor (Llama 3.x RoPE scaling, LLAMA3_ROPE below);
- qwen2: NEOX RoPE, q/k/v biases;
- qwen3: NEOX RoPE, RMS norms of q and k per head before RoPE;
- phi3: fused qkv and gate/up matrices, RoPE on the first half of each head only (PHI3_ROTARY_DIM);
- gemma2: head size 256, sliding-window layers every other layer, attention and final logit soft-capping,
  norms after attention and MLP, embeddings scaled by sqrt(n_embd), tied output;
- gemma3: gemma2's layout without soft-capping, q/k norms, 5 sliding layers to 1 global, local RoPE base.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_VOCAB = 3 + 256 + 61  # <unk> <s> </s>, 256 byte tokens, a few plain tokens
N_EMBD, N_HEAD, N_KV_HEAD, N_FF, N_LAYER = 256, 4, 2, 384, 3
HEAD_DIM = N_EMBD // N_HEAD
ARCHS = ("llama", "llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# Llama 3.x RoPE scaling as Meta defines it, with a tiny original context so most frequencies are scaled
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
PHI3_ROTARY_DIM = HEAD_DIM // 2  # Phi-4-mini's partial_rotary_factor is 0.75; half is as good a test
GEMMA_HEAD_DIM = 256
GEMMA_WINDOW = 16  # shorter than the test prompts, so the window really cuts
GEMMA_LAYERS = 6  # gemma3: five sliding layers, then a global one
GEMMA3_LOCAL_BASE = 10000.0
GEMMA3_GLOBAL_BASE = 1000000.0


def prompts(n_prompts: int = 3, seed: int = 0) -> list[tuple[int, ...]]:
    """Up to three random prompts in the tiny vocabulary, 7, 40 and 75 tokens long (the same on every call)."""
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(3, N_VOCAB, size=n)) for n in (7, 40, 75)[:n_prompts]]


def _shape(arch: str) -> tuple[int, int, int, int]:
    """(n_layer, n_head, num_kv_heads, head_dim) of a family's tiny model."""
    if arch.startswith("gemma"):
        return GEMMA_LAYERS if arch == "gemma3" else 4, 2, 1, GEMMA_HEAD_DIM
    return N_LAYER, N_HEAD, N_KV_HEAD, HEAD_DIM


def write_tiny_gguf(path: Path, arch: str, weight_dtype: str = "f32", seed: int = 0) -> Path:
    """arch: one of ARCHS (the module docstring says what each one exercises)."""
    if arch not in ARCHS:
        raise ValueError(f"tiny GGUF families: {ARCHS}, not {arch!r}")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama" if arch == "llama3" else arch)
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
    n_layer, n_head, n_kv_head, head_dim = _shape(arch)
    writer.add_name("tiny")  # not "phi3": llama.cpp would then expect Phi-3's own special tokens
    writer.add_context_length(2048)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(GEMMA3_GLOBAL_BASE if arch == "gemma3" else 10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(PHI3_ROTARY_DIM if arch == "phi3" else head_dim)
    writer.add_vocab_size(N_VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(GEMMA_WINDOW)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if arch == "gemma3":
        writer.add_float32(gguf.Keys.Rope.FREQ_BASE_SWA.format(arch=arch), GEMMA3_LOCAL_BASE)


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


def llama3_rope_freqs(head_dim: int = HEAD_DIM, base: float = 10000.0) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for LLAMA3_ROPE: the divisor of each RoPE frequency.
    # [head_dim / 2] float32"""
    p = LLAMA3_ROPE
    inv_freq = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"])
    factors = np.where(wavelen < high_wavelen, 1.0,
                       np.where(wavelen > low_wavelen, p["factor"], 1 / ((1 - smooth) / p["factor"] + smooth)))
    return factors.astype(np.float32)


def _tensors(arch: str, rng: np.random.Generator):
    n_layer, n_head, n_kv_head, head_dim = _shape(arch)
    gemma = arch.startswith("gemma")

    def mat(rows, cols, scale=1.0):  # HF layout [out, in]; scaled so activations stay O(1) and logits peaked
        return rng.standard_normal((rows, cols)).astype(np.float32) * scale / np.sqrt(cols)

    def norm(n):  # llama.cpp's Gemma converter stores 1 + w, as llama.cpp multiplies by the stored weight
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Gemma scales embeddings by sqrt(n_embd): small ones keep the residual from being mostly the input token's,
    # which with gemma2's tied output would make each token predict itself; its final norm sharpens the logits
    yield "token_embd.weight", rng.standard_normal((N_VOCAB, N_EMBD)).astype(np.float32) * (0.02 if gemma else 1.0)
    if arch == "llama3":
        yield "rope_freqs.weight", llama3_rope_freqs()
    for il in range(n_layer):
        q = mat(n_head * head_dim, N_EMBD)
        k = mat(n_kv_head * head_dim, N_EMBD)
        v = mat(n_kv_head * head_dim, N_EMBD)
        if arch in ("llama", "llama3"):
            q, k = _permute(q, n_head), _permute(k, n_kv_head)
        yield f"blk.{il}.attn_norm.weight", norm(N_EMBD)
        if arch == "phi3":
            yield f"blk.{il}.attn_qkv.weight", np.concatenate([q, k, v])
        else:
            yield f"blk.{il}.attn_q.weight", q
            yield f"blk.{il}.attn_k.weight", k
            yield f"blk.{il}.attn_v.weight", v
        yield f"blk.{il}.attn_output.weight", mat(N_EMBD, n_head * head_dim)
        if arch == "qwen2":
            yield f"blk.{il}.attn_q.bias", 0.1 * rng.standard_normal(n_head * head_dim).astype(np.float32)
            yield f"blk.{il}.attn_k.bias", 0.1 * rng.standard_normal(n_kv_head * head_dim).astype(np.float32)
            yield f"blk.{il}.attn_v.bias", 0.1 * rng.standard_normal(n_kv_head * head_dim).astype(np.float32)
        if arch in ("qwen3", "gemma3"):
            yield f"blk.{il}.attn_q_norm.weight", norm(head_dim)
            yield f"blk.{il}.attn_k_norm.weight", norm(head_dim)
        if gemma:
            yield f"blk.{il}.post_attention_norm.weight", norm(N_EMBD)
            yield f"blk.{il}.post_ffw_norm.weight", norm(N_EMBD)
        yield f"blk.{il}.ffn_norm.weight", norm(N_EMBD)
        if arch == "phi3":
            yield f"blk.{il}.ffn_up.weight", np.concatenate([mat(N_FF, N_EMBD), mat(N_FF, N_EMBD)])  # gate, up
        else:
            yield f"blk.{il}.ffn_gate.weight", mat(N_FF, N_EMBD)
            yield f"blk.{il}.ffn_up.weight", mat(N_FF, N_EMBD)
        yield f"blk.{il}.ffn_down.weight", mat(N_EMBD, N_FF)
    yield "output_norm.weight", norm(N_EMBD) * (40.0 if arch == "gemma2" else 1.0)
    if arch != "gemma2":  # gemma2 always ties its output to the embeddings
        yield "output.weight", mat(N_VOCAB, N_EMBD, 8.0)
