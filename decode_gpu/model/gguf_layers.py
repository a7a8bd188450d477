"""The GGUF's own weight blocks as the decode model's layers (weight_dtype = "gguf"): a read-only mmap of the file,
each matrix multiplied where it lies by ggml's CPU kernels, each embedding row dequantized when it is looked up.

Why: the prefill workers' llama.cpp maps the same file. A page of a file mapping is the page cache's, shared by
every process that maps it, and counted once in their PSS; the weights the engine quantized itself (int8, int4,
q8_0) or converted (bfloat16) were a second copy beside it: on the 1B ladder model 1.5 GiB of the engine's 3.9 GB
(docs/sizes.md). Here nothing is copied, repacked or converted: the engine holds no weights of its own beyond the
norms.

What ggml's mul_mat reads is exactly what llama.cpp reads: the same blocks, the same dot products (the activations
quantized to the type's dot-product partner by ggml itself), so the engine's logits follow llama.cpp's own. The only
difference from the file is the row order of a LLaMA-family q and k: the GGUF stores their rows permuted for
llama.cpp's interleaved RoPE, and the engine computes in transformers' half-split layout, so the product's columns
are put back in transformers' order (`row_order`, one index_select of a small activation).
"""

from __future__ import annotations

import ctypes
import mmap
import warnings

import torch
from gguf import GGMLQuantizationType
from torch import nn

from contracts.gguf_header import read_header
from decode_gpu.model import ggml_linear
from decode_gpu.model.quantized_linear import QuantizedLinear

# the block types a GGUF's matrices may have that ggml's CPU mul_mat multiplies (and dequantizes row by row)
GGUF_LAYER_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                              "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"})


class MappedGGUF:
    """A GGUF file mapped read-only; its tensors as uint8 views of the mapping (no copy: torch.frombuffer)."""

    def __init__(self, path: str) -> None:
        header = read_header(path)
        self.path = path
        self.tensors = {t.name: t for t in header.tensors}
        self.data_start = header.data_start
        with open(path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only on purpose: a write would fault, never change the file's pages
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # [file bytes]

    def blocks(self, name: str) -> torch.Tensor:
        """The tensor's bytes as they lie in the file. # [n_bytes] uint8"""
        tensor = self.tensors[name]
        start = self.data_start + tensor.data_offset
        return self.bytes[start:start + tensor.n_bytes]

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """ggml's order: [in, out] for a matrix, [dim, vocab] for the embedding."""
        return tuple(self.tensors[name].shape)


def check_type(mapped: MappedGGUF, name: str) -> int:
    """The ggml_type id of a tensor the engine may multiply or look up; ValueError for another type."""
    kind = mapped.type_name(name)
    if kind not in GGUF_LAYER_TYPES:
        raise ValueError(f"weight_dtype gguf: {name} is {kind}, which the engine does not multiply in place "
                         f"({', '.join(sorted(GGUF_LAYER_TYPES))}); choose another weight_dtype")
    return GGMLQuantizationType[kind].value


class GGUFLinear(QuantizedLinear):
    """y = x @ W.T + b with W the GGUF's own blocks, where they lie in the mapped file, multiplied by ggml's CPU
    kernels with torch's current thread count; activations cross as float32. row_order: the model's output i is the
    file's row row_order[i] (a LLaMA GGUF's q and k)."""
    held_as = "gguf"

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, out_features: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, row_order: torch.Tensor | None = None,
                 repack: bool = False) -> None:
        super().__init__()
        lib = ggml_linear.library()
        if lib.row_size(ggml_type, in_features) * out_features != blocks.numel():
            raise ValueError(f"{blocks.numel()} bytes are not a [{out_features}, {in_features}] matrix of ggml type "
                             f"{ggml_type}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", blocks, persistent=False)  # [out * row bytes] uint8, the mapped file's pages
        self.ggml_type = ggml_type
        self.activation_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.row_order = row_order  # [out] int64, or None: the file's order is the model's
        self.keep_float(blocks, None)  # no float set: the file's blocks are the one set
        self._graphs: dict[tuple[int, int], object] = {}  # (rows, weight address) -> its ggml graph
        # repack: llama.cpp's interleaved layout in memory of its own (the memory plan made room for it), multiplied
        # instead of the mapped blocks where llama.cpp has one for this type, shape and CPU; else None
        self.repacked = ggml_linear.repack(blocks, ggml_type, in_features, out_features) if repack else None

    def __getstate__(self) -> dict:  # a copy builds graphs of its own, over the mapped blocks (the repack stays)
        return {**super().__getstate__(), "_graphs": {}, "repacked": None}

    def product(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        rows = x2.shape[0]
        key = (rows, self.qweight.data_ptr())
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = ggml_linear.matmul_graph(self.qweight, self.ggml_type, self.in_features,
                                                                 self.out_features, rows, self.repacked)
        x = x2.to(torch.float32).contiguous()  # [rows, in]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)  # [rows, out]
        graph(x, y)
        if self.row_order is not None:
            y = y.index_select(1, self.row_order)
        return y.to(x2.dtype)


class GGUFEmbedding(nn.Module):
    """The token embedding as the GGUF's blocks: a lookup dequantizes the looked-up rows only (ggml's own to_float
    of the type), never the whole [vocab, dim] table. # forward: ids [n] -> [n, dim] in dtype"""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, dim: int, vocab: int, dtype: torch.dtype) -> None:
        super().__init__()
        lib = ggml_linear.library()
        self.row_bytes = lib.row_size(ggml_type, dim)
        if self.row_bytes * vocab != blocks.numel():
            raise ValueError(f"{blocks.numel()} bytes are not a [{vocab}, {dim}] table of ggml type {ggml_type}")
        self.register_buffer("qweight", blocks, persistent=False)  # [vocab * row bytes] uint8, mapped
        self.dim, self.vocab, self.dtype = dim, vocab, dtype
        self.ggml_type = ggml_type
        self._to_float = None
        if ggml_type != GGMLQuantizationType.F32.value:
            traits = lib.get_type_traits(ggml_type).contents
            if traits.type_size != lib.type_size(ggml_type) or traits.blck_size != lib.blck_size(ggml_type) \
                    or not traits.to_float:
                raise RuntimeError("ggml's type traits are not laid out as in llama-cpp-python 0.3.36")
            self._to_float = traits.to_float

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).tolist()
        bad = [t for t in flat if not 0 <= t < self.vocab]
        if bad:
            raise IndexError(f"token ids {bad[:4]} are outside the vocabulary of {self.vocab}")
        if self._to_float is None:  # F32: the rows themselves
            table = self.qweight.view(torch.float32).view(self.vocab, self.dim)
            return table[ids.reshape(-1).long()].to(self.dtype).reshape(*ids.shape, self.dim)
        out = torch.empty(len(flat), self.dim, dtype=torch.float32)  # [n, dim]
        base, row_out = self.qweight.data_ptr(), self.dim * 4
        for i, token in enumerate(flat):
            self._to_float(ctypes.c_void_p(base + token * self.row_bytes),
                           ctypes.c_void_p(out.data_ptr() + i * row_out), self.dim)
        return out.to(self.dtype).reshape(*ids.shape, self.dim)
