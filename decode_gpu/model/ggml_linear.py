"""Linear layers on ggml's CPU kernels: the weight stored in a llama.cpp block type (Q8_0), multiplied by ggml's
own mul_mat, called through ctypes from the ggml libraries llama-cpp-python ships.

Why: torch's packed int8/int4 CPU kernels are fast only where the CPU has AVX-512 (VNNI/BF16/AMX). On an AVX2 CPU
(the AMD EPYC Zen 3 development machine of 2026-12-02) they ran 2.6-20x slower than float32 over the embedded
model's layers, so `auto` kept float32 weights and a decode step read 538 MB. ggml's quantized dot products are
written for every x86 and ARM ISA (llama.cpp's decode runs on them): over the layers at one row Q8_0 took 29 ms
against float32's 97 there (docs/decode.md, "ggml weights on the CPU").

How: one small ggml graph (y = W x) per layer and row count, built once; a call points the graph's input and
output tensors at the torch tensors' memory and computes it on the calling thread, with as many threads as torch
has at that moment. ggml quantizes the activations to its dot-product type itself. Everything here is CPU-only
and needs llama-cpp-python's shared libraries, whose struct layouts are pinned with its version (0.3.36);
`available()` checks the one field offset written directly.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading

import torch
from torch import nn

from decode_gpu.model.quantized_linear import QuantizedLinear

log = logging.getLogger(__name__)
GGML_TYPES = {"q8_0": 8}  # weight_dtype -> ggml_type
GGML_F32 = 0
MAX_THREADS = 4  # threads of one call at most; measured at 1 and 2 only (no persistent ggml threadpool yet)
# nodes a layer's graph may hold: it has one (y = W x) and two leaves; ggml's default graph (2048 nodes, 83 KB of
# structs) made every (layer, row count) cost 85 KB: 190 MB over the embedded model's 121 layers at 16 row counts
GRAPH_NODES = 4
_TENSOR_DATA_OFFSET = 248  # offsetof(struct ggml_tensor, data) in ggml 0.25 (llama-cpp-python 0.3.36), checked
# offsetof(struct ggml_tensor, name) and (extra): name[64] follows data, extra follows name (checked with the name)
_TENSOR_NAME_OFFSET, _TENSOR_EXTRA_OFFSET = 256, 320
# ggml_backend_cpu_repack_buffer_type() of ggml-cpu's repack.h: exported without C linkage, so by its C++ name
_REPACK_BUFT_SYMBOL = "_Z35ggml_backend_cpu_repack_buffer_typev"
_P = ctypes.c_void_p
_CPUS = os.cpu_count() or 1


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):  # struct ggml_cplan (ggml-cpu.h)
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", _P), ("n_threads", ctypes.c_int), ("threadpool", _P),
                ("abort_callback", _P), ("abort_callback_data", _P), ("use_ref", ctypes.c_bool)]


class TypeTraits(ctypes.Structure):  # struct ggml_type_traits (ggml.h); checked against ggml_type_size on use
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool),
                ("to_float", ctypes.CFUNCTYPE(None, _P, _P, ctypes.c_int64)), ("from_float_ref", _P)]


class _GGML:
    """The ggml functions used here, with their C signatures."""

    def __init__(self, libdir: str) -> None:
        base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
        cpu = ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so"))
        signatures = {
            (base, "ggml_init"): (_P, [_InitParams]),
            (base, "ggml_free"): (None, [_P]),
            (base, "ggml_new_tensor_2d"): (_P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
            (base, "ggml_mul_mat"): (_P, [_P, _P, _P]),
            (base, "ggml_new_graph_custom"): (_P, [_P, ctypes.c_size_t, ctypes.c_bool]),
            (base, "ggml_graph_overhead_custom"): (ctypes.c_size_t, [ctypes.c_size_t, ctypes.c_bool]),
            (base, "ggml_build_forward_expand"): (None, [_P, _P]),
            (base, "ggml_get_data"): (_P, [_P]),
            (base, "ggml_tensor_overhead"): (ctypes.c_size_t, []),
            (base, "ggml_row_size"): (ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
            (base, "ggml_type_size"): (ctypes.c_size_t, [ctypes.c_int]),
            (base, "ggml_blck_size"): (ctypes.c_int64, [ctypes.c_int]),
            (base, "ggml_get_type_traits"): (ctypes.POINTER(TypeTraits), [ctypes.c_int]),
            (base, "ggml_quantize_chunk"): (ctypes.c_size_t, [ctypes.c_int, _P, _P, ctypes.c_int64, ctypes.c_int64,
                                                              ctypes.c_int64, _P]),
            (base, "ggml_set_name"): (_P, [_P, ctypes.c_char_p]),
            (base, "ggml_backend_alloc_ctx_tensors_from_buft"): (_P, [_P, _P]),
            (base, "ggml_backend_tensor_set"): (None, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
            (base, "ggml_backend_buffer_free"): (None, [_P]),
            (base, "ggml_backend_buffer_get_size"): (ctypes.c_size_t, [_P]),
            (cpu, "ggml_cpu_init"): (None, []),
            (cpu, "ggml_graph_plan"): (_CPlan, [_P, ctypes.c_int, _P]),
            (cpu, "ggml_graph_compute"): (ctypes.c_int, [_P, ctypes.POINTER(_CPlan)]),
        }
        for (lib, name), (restype, argtypes) in signatures.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
            setattr(self, name.removeprefix("ggml_"), function)
        self.cpu_init()
        self.repack_buffer_type = None  # llama.cpp's CPU repack (interleaved blocks), where this ggml exports it
        if hasattr(cpu, _REPACK_BUFT_SYMBOL):
            function = getattr(cpu, _REPACK_BUFT_SYMBOL)
            function.restype, function.argtypes = _P, []
            self.repack_buffer_type = function()


@functools.cache
def _ggml() -> _GGML | None:
    """The ggml bindings, or None where llama-cpp-python's libraries are missing or laid out otherwise."""
    try:
        import llama_cpp  # noqa: F401  (loads the ggml libraries this process shares with llama.cpp)
        lib = _GGML(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))
    except (ImportError, OSError, AttributeError) as e:
        log.info("ggml weights unavailable: %s", e)
        return None
    # the one struct field written directly: where a tensor's data pointer lives
    size = 2 * lib.tensor_overhead() + 1024
    ctx = lib.init(_InitParams(size, None, False))
    tensor = lib.new_tensor_2d(ctx, GGML_F32, 4, 2)
    matches = _P.from_address(tensor + _TENSOR_DATA_OFFSET).value == lib.get_data(tensor)
    lib.set_name(tensor, b"layout-check")  # and the name's, which places extra (repacked weights read it)
    matches = matches and ctypes.string_at(tensor + _TENSOR_NAME_OFFSET, 12) == b"layout-check"
    lib.free(ctx)
    if not matches:
        log.warning("ggml weights unavailable: this ggml's tensor layout is not the one llama-cpp-python 0.3.36 has")
        return None
    return lib


def available() -> bool:
    return _ggml() is not None


def library() -> _GGML:
    """The ggml bindings; RuntimeError where they do not load (available())."""
    lib = _ggml()
    if lib is None:
        raise RuntimeError("ggml weights need llama-cpp-python's ggml libraries (0.3.36)")
    return lib


class RepackedWeight:
    """A matrix's blocks repacked by llama.cpp's CPU repack (its CPU_REPACK buffer type: rows interleaved in groups of
    4 or 8, so one pass of the dot-product kernels reads several rows' blocks together) into memory of its own: a
    private copy of the matrix, as llama.cpp makes at load. Measured on the 8B ladder's 4096 x 14336 Q4_K matrix
    (AVX-512 box, one thread): 2.4-2.7 ms against 3.4-4.1 ms at one row, 13.5 against 21.8 ms at 16 rows; equal
    results within 2e-6 (/tmp probe of issue 44, docs/sizes.md)."""

    def __init__(self, lib: _GGML, ctx: int, tensor: int, buffer: int) -> None:
        self._lib, self._ctx, self.tensor, self._buffer = lib, ctx, tensor, buffer
        self.nbytes = lib.backend_buffer_get_size(buffer)

    def __del__(self) -> None:
        if getattr(self, "_buffer", None):
            self._lib.backend_buffer_free(self._buffer)
            self._lib.free(self._ctx)


def repack(blocks: torch.Tensor, ggml_type: int, in_features: int, out_features: int) -> RepackedWeight | None:
    """`blocks` (a [out, in] matrix of ggml_type, e.g. the mapped GGUF's) repacked for this CPU, or None where
    llama.cpp has no repacked layout for the type, the shape or the CPU's instructions (or this ggml no repack)."""
    lib = library()
    if lib.repack_buffer_type is None:
        return None
    ctx = lib.init(_InitParams(2 * lib.tensor_overhead() + 1024, None, True))
    tensor = lib.new_tensor_2d(ctx, ggml_type, in_features, out_features)
    # allocating runs the buffer type's init_tensor, which sets extra to the repacked layout for this tensor, or
    # to NULL where there is none (tensor_set would then abort the process: checked first)
    buffer = lib.backend_alloc_ctx_tensors_from_buft(ctx, lib.repack_buffer_type)
    if not buffer or not _P.from_address(tensor + _TENSOR_EXTRA_OFFSET).value:
        if buffer:
            lib.backend_buffer_free(buffer)
        lib.free(ctx)
        return None
    lib.backend_tensor_set(tensor, blocks.data_ptr(), 0, blocks.numel())  # repacks as it copies
    return RepackedWeight(lib, ctx, tensor, buffer)


class _MatMulGraph:
    """y [rows, out] = x [rows, in] @ W.T as a ggml graph over a fixed number of rows; the tensors' data pointers
    are set at each call. With `repacked`, W is that tensor (its own buffer, llama.cpp's repacked layout)."""

    def __init__(self, lib: _GGML, ggml_type: int, weight_ptr: int, in_features: int, out_features: int,
                 rows: int, repacked: RepackedWeight | None = None) -> None:
        size = 4 * lib.tensor_overhead() + lib.graph_overhead_custom(GRAPH_NODES, False) + 1024
        self._buffer = ctypes.create_string_buffer(size)  # the context's memory: tensor and graph structs only
        self._ctx = lib.init(_InitParams(size, ctypes.cast(self._buffer, _P), True))
        self._repacked = repacked  # kept alive as long as a graph reads it
        if repacked is None:
            weight = lib.new_tensor_2d(self._ctx, ggml_type, in_features, out_features)  # [ne0 = in, ne1 = out]
        else:
            weight = repacked.tensor
        self._x = lib.new_tensor_2d(self._ctx, GGML_F32, in_features, rows)
        self._y = lib.mul_mat(self._ctx, weight, self._x)  # [ne0 = out, ne1 = rows]: row-major [rows, out]
        self._graph = lib.new_graph_custom(self._ctx, GRAPH_NODES, False)
        lib.build_forward_expand(self._graph, self._y)
        if repacked is None:
            _P.from_address(weight + _TENSOR_DATA_OFFSET).value = weight_ptr
        # work (the activations quantized) for the most threads a call may use: in the calling thread's one buffer,
        # shared by every graph it computes (a buffer per graph was 20 KB more per layer and row count)
        self._plan = lib.graph_plan(self._graph, _CPUS, None)
        self._lib = lib

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:  # x: [rows, in] float32, y: [rows, out] float32
        # as many threads as torch has now (the engine halves its threads while a prompt is in prefill on the same
        # cores, docs/decode.md), up to MAX_THREADS: ggml starts and joins them per call, which paid at 2 threads
        # (29 against 42 ms over the embedded model's layers) but costs more with every thread
        self._plan.n_threads = min(torch.get_num_threads(), MAX_THREADS, _CPUS)
        self._plan.work_data = _work_buffer(self._plan.work_size)
        _P.from_address(self._x + _TENSOR_DATA_OFFSET).value = x.data_ptr()
        _P.from_address(self._y + _TENSOR_DATA_OFFSET).value = y.data_ptr()
        status = self._lib.graph_compute(self._graph, ctypes.byref(self._plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def __del__(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.free(self._ctx)


_work = threading.local()  # each thread's work buffer (the engine computes every layer on its one thread)


def _work_buffer(size: int) -> int:
    """The address of this thread's work buffer, grown to at least `size` bytes."""
    buffer = getattr(_work, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _work.buffer = torch.empty(max(size, 1), dtype=torch.uint8)
    return buffer.data_ptr()


def quantize(weight: torch.Tensor, weight_dtype: str) -> torch.Tensor:
    """weight [out, in] -> its rows in ggml's `weight_dtype` blocks, as bytes [out * row bytes] uint8."""
    lib = _ggml()
    if lib is None:
        raise RuntimeError("ggml weights need llama-cpp-python's ggml libraries (0.3.36)")
    ggml_type = GGML_TYPES[weight_dtype]
    out_features, in_features = weight.shape
    if in_features % 32:  # ggml would abort the process on a partial block
        raise ValueError(f"{weight_dtype} weights need an input size divisible by 32, this layer has {in_features}")
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    blocks = torch.empty(lib.row_size(ggml_type, in_features) * out_features, dtype=torch.uint8)
    lib.quantize_chunk(ggml_type, w.data_ptr(), blocks.data_ptr(), 0, out_features, in_features, None)
    return blocks


def matmul_graph(blocks: torch.Tensor, weight_dtype: str | int, in_features: int, out_features: int,
                 rows: int, repacked: RepackedWeight | None = None) -> _MatMulGraph:
    """weight_dtype: a GGML_TYPES name, or a ggml_type id (a GGUF tensor's own type, gguf_layers.py). repacked: the
    same matrix repacked (repack()), multiplied instead of `blocks`."""
    ggml_type = weight_dtype if isinstance(weight_dtype, int) else GGML_TYPES[weight_dtype]
    return _MatMulGraph(_ggml(), ggml_type, blocks.data_ptr(), in_features, out_features, rows, repacked)


class GGMLLinear(QuantizedLinear):
    """y = x @ W.T + b with W held in ggml's Q8_0 blocks (32 weights, one float16 scale) and multiplied by ggml's CPU
    kernels with torch's current thread count; activations cross as float32."""
    held_as = "q8_0"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 float_above: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", quantize(weight, "q8_0"))  # [out * row bytes] uint8
        self.activation_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.keep_float(weight, float_above)
        self._graphs: dict[tuple[int, int], _MatMulGraph] = {}  # (rows, weight address) -> its graph

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) builds graphs of its own over its own bytes
        return {**super().__getstate__(), "_graphs": {}}

    def product(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        rows = x2.shape[0]
        key = (rows, self.qweight.data_ptr())  # a moved buffer gets graphs of its own
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = matmul_graph(self.qweight, "q8_0", self.in_features, self.out_features, rows)
        x = x2.to(torch.float32).contiguous()  # [rows, in]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)  # [rows, out]
        graph(x, y)
        return y.to(x2.dtype)
