"""A model's sizes as memory sees them, read from its GGUF header in milliseconds (no torch, no llama.cpp, no weight
read): its matrices and vectors, what the decode engine holds for each weight_dtype, a prefill copy's bytes, and the
KV bytes per token in llama.cpp's cache and in the decode pool. The planner (memory_plan.py) budgets with them.

The engine's quantized weights follow its own layers (decode_gpu/model: int8 per output channel, int4 in groups of
32, q8_0 in ggml blocks, the input embedding int8 either way); `edge check-model` sizes the same from the model built
on the meta device (edge/check_model/sizes.py), and tests/contracts/test_memory_plan.py holds the two to the same
bytes. The pool's formula is decode_gpu/kv/pool.py's bytes_per_token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from contracts.gguf_header import GGUFHeader, read_header
from contracts.kv_dtypes import KV_DTYPES

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZED = ("int8", "int4", "q8_0")
GGUF_EXACT_INT4 = {"Q4_0", "Q4_1", "Q4_K"}  # an int4 model's lm_head is int4 only if the GGUF's is one of these
COPY_BYTES_PER_WEIGHT = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
# types llama.cpp's CPU backend repacks at load into its own (anonymous, per process) buffer (CPU_REPACK, x86 with
# AVX2/AVX-512: q4_0_8x8, q4_K_8x8, iq4_nl_8x8): every layer matrix of these types, not the embedding (a row
# lookup). Measured: the 1B ladder's Q4_K_M, 445.5 MiB repacked beside its 753.8 MiB mapping; Q4_1, Q8_0 and F16 none
REPACKED = {"Q4_0", "Q4_K", "IQ4_NL"}
# ... but on a CPU with AVX-512 its Q4_K repack measured slower and larger than the mapped blocks as they lie (1B
# ladder Q4_K_M, 512-token prefill at n_batch 256, 2 threads: 154-155 against 214-219 tok/s, 1354 against 917 MiB
# RSS; docs/sizes.md), so a worker loads such a file without it. Q4_0 and IQ4_NL's repacks were not measured: kept.
UNREPACKED_ON_AVX512 = {"Q4_K"}
# What the decode engine's matrices may be repacked as on an x86 CPU with AVX2 (weight_repack, the memory plan;
# decode_gpu/model/ggml_linear.py repack): type -> the row count its interleaved layout groups (a matrix's output
# rows must divide by it). ggml-cpu's repack (llama-cpp-python 0.3.36) chose a layout on the AVX-512 box for these
# four and none for Q5_K, Q6_K and Q8_0 (their layouts are for ARM), tests/decode_gpu/test_gguf_repack.py; a matrix
# it has none for stays mapped (the engine logs how many were repacked).
ENGINE_REPACKED = {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "Q2_K": 8}


# ... and llama.cpp prefills a K-quant mix of these as they lie faster than from an f16 copy there: the 1B ladder's
# Q4_K_M measured by prefill_weights = "auto" at 2 threads, 16.0 against 7.7 tok/s (box loaded, 2026-12-06) and
# kept as given the round before; so the memory plan allows no copy for them (no conversion at a first start)
GIVEN_FASTER_ON_AVX512 = {"Q4_K", "Q6_K"}


def engine_repackable(type_name: str, out_features: int) -> bool:
    """Whether the engine's repack has a layout for a matrix of this GGUF type and output row count (on x86 AVX2)."""
    rows = ENGINE_REPACKED.get(type_name)
    return rows is not None and out_features % rows == 0


def engine_repacks(flags: frozenset[str]) -> bool:
    """Whether the decode engine may repack the GGUF's matrices for its decode steps on this CPU: x86 with AVX2, where
    the repacked Q4_K measured 1.4-1.6x the mapped blocks' speed at 1 and 16 rows (8B ladder, one thread;
    docs/sizes.md). Unknown flags (another CPU): no."""
    return "avx2" in flags


def copy_may_pay(layer_types: frozenset[str], flags: frozenset[str]) -> bool:
    """Whether a converted prefill copy (f16, q8_0) may prefill faster than these layer matrices as given: not on an
    AVX-512 CPU when they are all of GIVEN_FASTER_ON_AVX512."""
    return not (layer_types and "avx512f" in flags and layer_types <= GIVEN_FASTER_ON_AVX512)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.partition(":")[2].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def worker_repacks(layer_types: frozenset[str], flags: frozenset[str]) -> bool:
    """Whether a prefill worker lets llama.cpp repack these layer matrices (use_extra_bufts): not on an AVX-512 CPU
    when every repackable type among them is one measured slower there (UNREPACKED_ON_AVX512); its default
    otherwise."""
    repackable = layer_types & REPACKED
    return not (repackable and "avx512f" in flags and repackable <= UNREPACKED_ON_AVX512)


@dataclass(frozen=True)
class Matrix:
    out_features: int
    in_features: int


@dataclass(frozen=True)
class ModelSizes:
    """A model's shape as memory sees it, from its GGUF header."""
    name: str
    file_bytes: int  # the GGUF as given: what llama.cpp maps
    file_type: int | None  # general.file_type
    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    embedding: Matrix  # [vocab, embd]
    head: Matrix | None  # the output matrix; None: tied to the embedding
    layers: tuple[Matrix, ...]  # every other 2-D tensor: the decode model's linear layers
    vector_elements: int  # norms, biases, RoPE factors: held in the compute dtype
    layer_types: frozenset[str] = frozenset()  # GGUF storage types of the layer matrices
    head_type: str = ""  # of the output matrix (the embedding's when tied)
    repacked_bytes: int = 0  # of the matrices llama.cpp repacks at load (REPACKED): a copy in each worker
    engine_repacked_bytes: int = 0  # of the matrices the decode engine may repack (ENGINE_REPACKED, engine_repacks)

    @property
    def n_params(self) -> int:
        matrices = [self.embedding, *self.layers, *([self.head] if self.head else [])]
        return sum(m.out_features * m.in_features for m in matrices) + self.vector_elements

    def decode_weight_bytes(self, weight_dtype: str, dtype: str = "bfloat16") -> int:
        """What the engine holds for `weight_dtype` (a float dtype, int8, int4 or q8_0); `dtype`: the compute dtype
        (quantized layers' scales, norms). ValueError where a layer's inputs do not tile the format's block."""
        if weight_dtype in FLOAT_BYTES:
            return self.n_params * FLOAT_BYTES[weight_dtype]
        if weight_dtype not in QUANTIZED:
            raise ValueError(f"weight_dtype {weight_dtype!r}: one of {(*FLOAT_BYTES, *QUANTIZED)}")
        act = FLOAT_BYTES[dtype]
        table = _int8_bytes(self.embedding, act)  # the input embedding is int8 whatever the layers hold
        total = table + self.vector_elements * act + sum(_layer_bytes(m, weight_dtype, act) for m in self.layers)
        head, tied = self.head or self.embedding, self.head is None
        head_int8 = weight_dtype == "int8" or (weight_dtype == "int4" and self.head_type not in GGUF_EXACT_INT4)
        if not (tied and head_int8):  # a tied int8 head shares the embedding's int8 table
            total += _layer_bytes(head, "int8" if head_int8 else weight_dtype, act)
        return total

    @property
    def unconverted(self) -> bool:
        """16 or 32 bits a weight already (general.file_type ALL_F32, MOSTLY_F16, MOSTLY_BF16): a copy cannot help."""
        return self.file_type in (0, 1, 32)

    def copy_bytes(self, kind: str) -> int:
        """A prefill copy's bytes (f16, bf16, q8_0): llama.cpp keeps vectors in f32."""
        return int(self.n_params * COPY_BYTES_PER_WEIGHT[kind])

    def handoff_kv_bytes(self, kv_type: str) -> int:
        """Per token in llama.cpp's cache and on the wire: a K and a V row per layer in ggml blocks."""
        kv = KV_DTYPES[kv_type]
        return self.n_layer * (kv.row_bytes(self.num_kv_heads * self.head_dim_k) +
                               kv.row_bytes(self.num_kv_heads * self.head_dim_v))

    def pool_kv_bytes(self, storage: str) -> int:
        """Per token in the decode pool (decode_gpu/kv/pool.py bytes_per_token): int8 with a float16 scale per 32,
        int4 with a float16 scale and minimum per 32."""
        head_dim = self.head_dim_k
        if storage == "int8":
            per_head = head_dim + 2 * (head_dim // 32)
        elif storage == "int4":
            per_head = head_dim // 2 + 4 * (head_dim // 32)
        else:
            per_head = head_dim * FLOAT_BYTES[storage]
        return 2 * self.n_layer * self.num_kv_heads * per_head


def _int8_bytes(m: Matrix, act: int) -> int:
    return m.out_features * m.in_features + m.out_features * act  # int8 rows and a scale per row


def _layer_bytes(m: Matrix, weight_dtype: str, act: int) -> int:
    """One linear layer's bytes (its bias is among the vectors): int8 rows + a scale per row; int4 two codes a byte +
    a (scale, zero) pair per 32 inputs; q8_0 34 bytes per 32 weights."""
    if weight_dtype == "int8":
        return _int8_bytes(m, act)
    if m.in_features % 32:
        raise ValueError(f"{weight_dtype} needs layer inputs divisible by 32, a layer has {m.in_features}")
    if weight_dtype == "int4":
        return m.out_features * m.in_features // 2 + m.out_features * (m.in_features // 32) * 2 * act
    return m.out_features * m.in_features // 32 * 34


def model_sizes(path: str) -> ModelSizes:
    """A GGUF's ModelSizes from its header (milliseconds; no weights read)."""
    return sizes_from_header(read_header(path), os.path.getsize(path))


def sizes_from_header(header: GGUFHeader, file_bytes: int) -> ModelSizes:
    def value(key: str, default=None):
        found = header.get_field(key)
        return default if found is None else found.contents()

    arch = value("general.architecture")
    n_head, n_embd = int(value(f"{arch}.attention.head_count")), int(value(f"{arch}.embedding_length"))
    head_dim_k = int(value(f"{arch}.attention.key_length", n_embd // n_head))
    matrices = {t.name: t for t in header.tensors if len(t.shape) == 2}
    embedding = matrices.pop("token_embd.weight")
    head = matrices.pop("output.weight", None)
    layers = tuple(Matrix(t.shape[1], t.shape[0]) for t in matrices.values())  # ggml's shape is [in, out]
    vectors = sum(t.n_elements for t in header.tensors if len(t.shape) != 2)
    repacked = sum(t.n_bytes for t in [*matrices.values(), *([head] if head else [])]
                   if t.tensor_type.name in REPACKED)
    # the engine's head is the embedding's blocks when tied: a matrix it multiplies, so repacked too
    engine_repacked = sum(t.n_bytes for t in [*matrices.values(), head or embedding]
                          if engine_repackable(t.tensor_type.name, t.shape[1]))
    file_type = value("general.file_type")
    n_ff = value(f"{arch}.feed_forward_length", 0)
    return ModelSizes(
        name=os.path.basename(header.path), file_bytes=file_bytes,
        file_type=None if file_type is None else int(file_type), n_layer=int(value(f"{arch}.block_count")),
        n_embd=n_embd, n_ff=int(max(n_ff) if isinstance(n_ff, list) else n_ff), n_vocab=int(embedding.shape[1]),
        num_kv_heads=int(value(f"{arch}.attention.head_count_kv", n_head)), head_dim_k=head_dim_k,
        head_dim_v=int(value(f"{arch}.attention.value_length", head_dim_k)),
        embedding=Matrix(embedding.shape[1], embedding.shape[0]),
        head=None if head is None else Matrix(head.shape[1], head.shape[0]), layers=layers, vector_elements=vectors,
        layer_types=frozenset(t.tensor_type.name for t in matrices.values()),
        head_type=(head or embedding).tensor_type.name, repacked_bytes=repacked, engine_repacked_bytes=engine_repacked)
