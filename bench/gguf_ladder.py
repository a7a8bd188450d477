"""GGUFs of real model shapes with random weights: real memory and compute costs, nonsense text (DESIGN.md, "Memory
is the budget"). `python -m bench.gguf_ladder --out DIR --sizes 1b,3b,8b --types q4_k_m,f16`.

The f16 file is written tensor by tensor (gguf's GGUFWriter: tensor infos first, then each tensor's data as it is
made), so the writer holds one tensor at a time, not the model: the largest is the embedding (8B: 1 GiB in f16).
Q4_K_M is then made from it by llama.cpp's own quantizer, as llama.cpp's tools would. The tokenizer is the embedded
SmolLM2's (its tokenizer.* metadata and chat template) padded to the shape's vocabulary with unused tokens.

Weights are normal x 0.02, norms 1, biases 0.02 x normal: activations stay finite through any depth (no NaN, a
usable logits row), which is all a size and speed measurement needs.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

log = logging.getLogger("bench.gguf_ladder")
TYPES = ("f16", "q4_k_m")
WEIGHT_SCALE = 0.02
CHUNK_ELEMENTS = 1 << 24  # random values made at once (64 MiB of float32): bounds the generator's own memory
PAD_TOKEN = "<|ladder_unused_{}|>"


@dataclass(frozen=True)
class LadderShape:
    """One rung: a published model's shape (its config.json), nothing of its weights."""
    label: str  # the model whose shape this is
    arch: str  # GGUF general.architecture: "llama" or "qwen2"
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_kv_head: int
    n_vocab: int
    rope_theta: float
    context_length: int
    rms_eps: float
    tied: bool  # output matrix shared with the token embedding (no output.weight)
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low_freq_factor, high_freq_factor, orig ctx

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(GGUF name, numpy shape [out, in], kind) in the order they are written; kind: matrix, norm, bias, freqs."""
        q, kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (self.n_vocab, self.n_embd), "matrix")]
        if self.llama3_rope is not None:
            out.append(("rope_freqs.weight", (self.head_dim // 2,), "freqs"))
        for il in range(self.n_layer):
            blk = f"blk.{il}"
            out += [(f"{blk}.attn_norm.weight", (self.n_embd,), "norm"),
                    (f"{blk}.attn_q.weight", (q, self.n_embd), "matrix"),
                    (f"{blk}.attn_k.weight", (kv, self.n_embd), "matrix"),
                    (f"{blk}.attn_v.weight", (kv, self.n_embd), "matrix")]
            if self.qkv_bias:
                out += [(f"{blk}.attn_q.bias", (q,), "bias"), (f"{blk}.attn_k.bias", (kv,), "bias"),
                        (f"{blk}.attn_v.bias", (kv,), "bias")]
            out += [(f"{blk}.attn_output.weight", (self.n_embd, q), "matrix"),
                    (f"{blk}.ffn_norm.weight", (self.n_embd,), "norm"),
                    (f"{blk}.ffn_gate.weight", (self.n_ff, self.n_embd), "matrix"),
                    (f"{blk}.ffn_up.weight", (self.n_ff, self.n_embd), "matrix"),
                    (f"{blk}.ffn_down.weight", (self.n_embd, self.n_ff), "matrix")]
        out.append(("output_norm.weight", (self.n_embd,), "norm"))
        if not self.tied:
            out.append(("output.weight", (self.n_vocab, self.n_embd), "matrix"))
        return out

    def n_params(self) -> int:
        return sum(int(np.prod(dims)) for _, dims, kind in self.tensors() if kind != "freqs")

    def f16_bytes(self) -> int:
        """The f16 file's tensor data: matrices in f16, vectors in f32 (header and padding not counted)."""
        return sum(int(np.prod(dims)) * (2 if kind == "matrix" else 4) for _, dims, kind in self.tensors())


SHAPES: dict[str, LadderShape] = {
    "1b": LadderShape("Llama-3.2-1B", "llama", n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_kv_head=8,
                      n_vocab=128256, rope_theta=500000.0, context_length=131072, rms_eps=1e-5, tied=True,
                      llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "3b": LadderShape("Qwen2.5-3B", "qwen2", n_layer=36, n_embd=2048, n_ff=11008, n_head=16, n_kv_head=2,
                      n_vocab=151936, rope_theta=1e6, context_length=32768, rms_eps=1e-6, tied=True, qkv_bias=True),
    "8b": LadderShape("Llama-3.1-8B", "llama", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_kv_head=8,
                      n_vocab=128256, rope_theta=500000.0, context_length=131072, rms_eps=1e-5, tied=False,
                      llama3_rope=(8.0, 1.0, 4.0, 8192)),
}
# a rung for tests and smoke runs: the 1B's code path (llama3 RoPE, tied) at a few MB; rows of 256 so Q4_K applies
SHAPES["tiny"] = dataclasses.replace(SHAPES["1b"], label="tiny Llama-3.2-shaped", n_layer=2, n_embd=256, n_ff=512,
                                     n_head=4, n_kv_head=2, n_vocab=49408)


# llama.cpp's K-quant blocks: bytes per 256 weights
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
FILE_TYPES = {"f16": 1, "q4_k_m": 15}  # general.file_type (llama_ftype)


def q4_k_m_type(shape: LadderShape, name: str) -> str:
    """The type llama.cpp's Q4_K_M gives a matrix (llama-quant.cpp): Q6_K for the output matrix (the embedding when
    tied) and for attn_v and ffn_down in the layers use_more_bits picks (the first and last eighth, every third
    between), Q4_K for the rest."""
    if name == "output.weight" or (name == "token_embd.weight" and shape.tied):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer, n = int(name.split(".")[1]), shape.n_layer
        if layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def ladder_sizes(size: str, kind: str):
    """The rung's contracts.model_sizes.ModelSizes, projected without writing it: tensor data as llama.cpp's Q4_K_M
    rule or f16 lays it out (the header, a few MB of tokenizer, not counted)."""
    from contracts.model_sizes import REPACKED, Matrix, ModelSizes, engine_repackable
    shape = SHAPES[size]
    types, data, repacked, engine_repacked = {}, 0, 0, 0
    for name, dims, tensor_kind in shape.tensors():
        elements = int(np.prod(dims))
        if tensor_kind != "matrix":
            data += 4 * elements
            continue
        types[name] = "F16" if kind == "f16" else q4_k_m_type(shape, name)
        held = 2 * elements if kind == "f16" else elements // 256 * BLOCK_BYTES[types[name]]
        data += held
        repacked += held if types[name] in REPACKED and name != "token_embd.weight" else 0
        # the engine multiplies every matrix but the embedding, and the embedding too as a tied head
        multiplied = name != "token_embd.weight" or shape.tied
        engine_repacked += held if multiplied and engine_repackable(types[name], dims[0]) else 0
    layers = [Matrix(*dims) for name, dims, k in shape.tensors() if k == "matrix" and name.startswith("blk.")]
    return ModelSizes(
        name=ladder_path(Path("."), size, kind).name, file_bytes=data, file_type=FILE_TYPES[kind],
        n_layer=shape.n_layer, n_embd=shape.n_embd, n_ff=shape.n_ff, n_vocab=shape.n_vocab,
        num_kv_heads=shape.n_kv_head, head_dim_k=shape.head_dim, head_dim_v=shape.head_dim,
        embedding=Matrix(shape.n_vocab, shape.n_embd), head=None if shape.tied else Matrix(shape.n_vocab, shape.n_embd),
        layers=tuple(layers), vector_elements=sum(int(np.prod(d)) for _, d, k in shape.tensors() if k != "matrix"),
        layer_types=frozenset(t for n, t in types.items() if n.startswith("blk.")),
        head_type=types["output.weight" if not shape.tied else "token_embd.weight"], repacked_bytes=repacked,
        engine_repacked_bytes=engine_repacked)


def ladder_path(out: Path, size: str, kind: str) -> Path:
    return out / f"ladder-{size}-{kind}.gguf"


def llama3_rope_freqs(shape: LadderShape) -> np.ndarray:
    """The divisor of each RoPE frequency, as llama.cpp's converter writes `rope_freqs` for Meta's llama3 scaling.
    # [head_dim / 2] float32"""
    factor, low, high, original = shape.llama3_rope
    inv_freq = shape.rope_theta ** -(np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    divisors = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return divisors.astype(np.float32)


def random_matrix(rng: np.random.Generator, dims: tuple[int, ...]) -> np.ndarray:
    """normal x WEIGHT_SCALE in f16, made CHUNK_ELEMENTS at a time into the one f16 array. # dims float16"""
    out = np.empty(dims, dtype=np.float16)
    flat = out.reshape(-1)
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = rng.standard_normal(min(CHUNK_ELEMENTS, flat.size - start), dtype=np.float32)
        chunk *= WEIGHT_SCALE
        flat[start:start + chunk.size] = chunk
    return out


def _tensor(shape: LadderShape, rng: np.random.Generator, dims: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "matrix":
        return random_matrix(rng, dims)
    if kind == "norm":
        return np.ones(dims, dtype=np.float32)
    if kind == "bias":
        return (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_SCALE).astype(np.float32)
    return llama3_rope_freqs(shape)


def embedded_tokenizer() -> dict[str, object]:
    """The embedded model's tokenizer.* metadata (its chat template included), as the header reader returns it."""
    from contracts.gguf_header import read_header
    from prefill_cpu.embedded_model import embedded_model_path
    fields = read_header(embedded_model_path()).fields
    return {name: field.contents() for name, field in fields.items() if name.startswith("tokenizer.")}


def padded_tokenizer(tokenizer: dict[str, object], n_vocab: int) -> dict[str, object]:
    """The tokenizer with unused tokens appended up to n_vocab (the embedding's rows); llama.cpp wants one a row."""
    tokens, types = list(tokenizer["tokenizer.ggml.tokens"]), list(tokenizer["tokenizer.ggml.token_type"])
    if n_vocab < len(tokens):
        raise ValueError(f"a vocabulary of {n_vocab} is smaller than the embedded tokenizer's {len(tokens)} tokens")
    pad = n_vocab - len(tokens)
    tokens += [PAD_TOKEN.format(i) for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    return {**tokenizer, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}


def _add_field(writer: gguf.GGUFWriter, name: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(name, value)
    elif isinstance(value, str):
        writer.add_string(name, value)
    elif isinstance(value, int):
        writer.add_uint32(name, value)
    elif isinstance(value, float):
        writer.add_float32(name, value)
    else:
        writer.add_array(name, list(value))


def _add_hparams(writer: gguf.GGUFWriter, shape: LadderShape, size: str) -> None:
    writer.add_name(f"edge-ladder-{size}")  # not a published name: llama.cpp keys no special cases on it
    writer.add_size_label(size.upper())
    writer.add_description(f"random weights in the shape of {shape.label} (bench/gguf_ladder.py)")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_kv_head)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_f16(shape: LadderShape, size: str, path: Path, seed: int = 0) -> Path:
    """Write the f16 GGUF to `path` (via a partial file, moved into place when whole), one tensor in memory at once."""
    rng = np.random.default_rng(seed)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), shape.arch)
    _add_hparams(writer, shape, size)
    for name, value in padded_tokenizer(embedded_tokenizer(), shape.n_vocab).items():
        _add_field(writer, name, value)
    plan = shape.tensors()
    for name, dims, kind in plan:
        dtype = np.dtype(np.float16 if kind == "matrix" else np.float32)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    started, written, group = time.perf_counter(), 0, None
    for name, dims, kind in plan:
        tensor = _tensor(shape, rng, dims, kind)
        writer.write_tensor_data(tensor)
        written += tensor.nbytes
        if _group(name) != group:
            group = _group(name)
            log.info("%s f16: %s ... (%.2f GB written, %.0f s)", size, group, written / 1e9,
                     time.perf_counter() - started)
        del tensor
    writer.close()
    os.replace(partial, path)
    log.info("%s f16: %s, %.2f GB in %.1f s", size, path, path.stat().st_size / 1e9, time.perf_counter() - started)
    return path


def _group(name: str) -> str:
    """A tensor's group for the progress log: its layer (blk.N), else its own name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blk" else name


def quantize(source: Path, target: Path, kind: str = "q4_k_m") -> Path:
    """llama.cpp's quantizer from the f16 file, as llama-quantize does; a line every 10 s on the bytes written."""
    import llama_cpp
    ftypes = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[kind]
    params.nthread = os.cpu_count() or 1
    partial = target.with_name(target.name + ".partial")
    done = threading.Event()
    started = time.perf_counter()

    def progress() -> None:
        while not done.wait(10.0):
            size = partial.stat().st_size if partial.exists() else 0
            log.info("%s: quantizing, %.2f GB written, %.0f s", target.name, size / 1e9, time.perf_counter() - started)

    watcher = threading.Thread(target=progress, daemon=True)
    watcher.start()
    try:
        if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
        os.replace(partial, target)
    finally:
        done.set()
        partial.unlink(missing_ok=True)
    log.info("%s: %.2f GB in %.1f s", target, target.stat().st_size / 1e9, time.perf_counter() - started)
    return target


def check_loads(path: Path, n_tokens: int = 8) -> float:
    """Load `path` in llama.cpp (n_ctx 256), evaluate a short prompt; the largest |logit| (ValueError if not
    finite): the file is whole and its activations are sane."""
    import llama_cpp
    model = llama_cpp.Llama(str(path), n_ctx=256, vocab_only=False, verbose=False, n_threads=os.cpu_count() or 1)
    try:
        tokens = model.tokenize(b"The quick brown fox jumps over the lazy dog", add_bos=False)[:n_tokens]
        model.eval(tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.ctx, -1), shape=(model.n_vocab(),))
        if not np.isfinite(logits).all():
            raise ValueError(f"{path}: llama.cpp computed non-finite logits")
        return float(np.abs(logits).max())
    finally:
        model.close()


def build(out: Path, size: str, kinds: tuple[str, ...], seed: int = 0, check: bool = True) -> dict[str, dict]:
    """Write one rung's files (f16 first, the quantized from it); the ones already there are kept. A temporary f16
    is removed when f16 was not asked for. Returns per kind: path, bytes, seconds, max |logit| when checked."""
    shape = SHAPES[size]
    out.mkdir(parents=True, exist_ok=True)
    f16 = ladder_path(out, size, "f16")
    results: dict[str, dict] = {}
    for kind in ("f16", *[k for k in kinds if k != "f16"]):
        path = ladder_path(out, size, kind)
        started = time.perf_counter()
        if path.exists():
            log.info("%s exists: kept", path)
        elif kind == "f16":
            write_f16(shape, size, path, seed)
        else:
            quantize(f16, path, kind)
        results[kind] = {"path": str(path), "bytes": path.stat().st_size, "seconds": time.perf_counter() - started}
    for kind in list(results):
        if kind not in kinds:
            Path(results.pop(kind)["path"]).unlink()
        elif check:
            results[kind]["max_logit"] = check_loads(Path(results[kind]["path"]))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for ladder-<size>-<type>.gguf")
    parser.add_argument("--sizes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--types", default="q4_k_m,f16", help=f"comma-separated, of {', '.join(TYPES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip loading each file in llama.cpp")
    parser.add_argument("--plan", action="store_true", help="print the files' projected sizes, write nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sizes, kinds = args.sizes.split(","), tuple(args.types.split(","))
    unknown = [s for s in sizes if s not in SHAPES] + [k for k in kinds if k not in TYPES]
    if unknown:
        parser.error(f"unknown sizes or types: {', '.join(unknown)}")
    print(f"{'size':5} {'shape':22} {'params':>9} {'type':7} {'GB':>7} {'seconds':>8} {'max|logit|':>10}")
    for size in sizes:
        shape = SHAPES[size]
        if args.plan:
            for kind in kinds:
                projected = ladder_sizes(size, kind).file_bytes
                print(f"{size:5} {shape.label:22} {shape.n_params() / 1e9:8.2f}B {kind:7} {projected / 1e9:7.2f}")
            continue
        for kind, row in build(args.out, size, kinds, args.seed, not args.no_check).items():
            logit = f"{row['max_logit']:10.2f}" if "max_logit" in row else ""
            print(f"{size:5} {shape.label:22} {shape.n_params() / 1e9:8.2f}B {kind:7} {row['bytes'] / 1e9:7.2f} "
                  f"{row['seconds']:8.1f} {logit}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
