"""Weight-only quantization of the decode model: its linear layers (and the tied embedding) stored as int8 per
output channel or int4 in groups, multiplied by torch's own packed kernels; activations stay in the model's dtype.

A decode step reads every weight once, so at small batches its time is the weights' bytes: int8 halves them
against bfloat16, int4 quarters them. The layers are quantized one at a time on the device they run on, so an 8B
model never sits there in bfloat16 (docs/decode.md, "Weights").
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "int4", "q8_0")
QUANTIZED_WEIGHTS = ("int8", "int4", "q8_0")  # q8_0: ggml's Q8_0 blocks and CPU kernels (ggml_linear.py), CPU only
FLOAT_WEIGHTS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# inputs per int4 (scale, zero) group: 32, the block of llama.cpp's Q4_0/Q4_1 (a Q4_1 GGUF's weights are then
# nearly exact in int4: its blocks are min + k x step); a 128 group lost half the top-1 agreement on the embedded model
INT4_GROUP = 32
INT4_INNER_K_TILES = 2  # tinygemm's packing parameter (2, 4 or 8); 2 accepts any input size divisible by 32
# GGUF tensor types (gguf.GGMLQuantizationType names) that `auto` maps to a quantized weight on CUDA
GGUF_INT8 = {"Q8_0", "Q8_1", "Q8_K"}
GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
# affine 4-bit in blocks of 32 (Q4_K: sub-blocks of 32 with their own scale and minimum): int4 in groups of 32 holds
# their codes exactly. A matrix stored with more bits loses in int4: the embedded model's Q8_0 head did (top-1 0.875
# against float32 with it in int4, 0.961 with it in int8, docs/decode.md)
GGUF_EXACT_INT4 = {"Q4_0", "Q4_1", "Q4_K"}


class _QuantizedLinear(nn.Module):
    """A weight-only quantized linear layer. float_above: also keep the float weight and use it for inputs of more
    rows than this. On a CPU the packed int kernels win at small batches (fewer bytes, less work) and lose at larger
    ones to the bfloat16 kernel (AMX); None: quantized only."""
    held_as: str  # the weight_dtype this layer holds
    in_features: int
    out_features: int

    def keep_float(self, weight: torch.Tensor, float_above: int | None) -> None:
        """Hold the float weight too, for inputs of more rows than float_above (None: quantized only); on a CPU
        with oneDNN bfloat16, in oneDNN's layout (PackedLinear)."""
        self.float_above = float_above
        for held in (self._parameters, self._buffers, self.__dict__):
            held.pop("weight", None)
        if float_above is None:
            self.weight = None
        elif weight.is_mkldnn:  # packed already (a PackedLinear's, from the CPU measurement)
            self.register_buffer("weight", weight, persistent=False)
        elif packs(weight.device, self.activation_dtype):
            self.register_buffer("weight", pack_weight(weight.detach().to(self.activation_dtype)), persistent=False)
        else:
            self.weight = nn.Parameter(weight.detach().to(self.activation_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        x2 = x.reshape(-1, self.in_features)
        if self.float_above is not None and x2.shape[0] > self.float_above:
            return float_linear(x, self.weight, self.bias)
        y = self.product(x2)  # [rows, out]
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """A bfloat16 linear layer on the CPU with its weight reordered once into oneDNN's blocked layout, multiplied by
    oneDNN's prepacked kernel (AMX where the CPU has it): the same numbers as F.linear, whose bfloat16 path on the
    CPU prepares the weight at every call. Over the embedded model's linear layers, 2 threads of an AMX Xeon: 15.7
    against 23.2 ms at one row, 18.1 against 24.9 at 32 (docs/decode.md, "Weights")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", pack_weight(weight.detach()), persistent=False)  # oneDNN layout, [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float_linear(x, self.weight, self.bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout for its linear kernel (a tensor of layout torch._mkldnn)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, for a weight in either layout (pack_weight's or a plain one)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float weights of `dtype` on `device` are held in oneDNN's layout: bfloat16 on a CPU whose oneDNN
    has bfloat16 kernels (AVX-512 and up), unless EDGE_PACKED_WEIGHTS=0. Checked once on a small layer."""
    if device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get("EDGE_PACKED_WEIGHTS", "1") == "0":
        return False
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        weight, x = torch.randn(16, 32, dtype=dtype), torch.randn(3, 32, dtype=dtype)
        return bool(torch.equal(float_linear(x, pack_weight(weight), None), F.linear(x, weight)))
    except (RuntimeError, AttributeError) as e:
        log.warning("oneDNN's prepacked bfloat16 linear is not usable here (%s): float weights stay as they are", e)
        return False


def pack_linears(model: nn.Module, packed: dict[str, PackedLinear] | None = None) -> int:
    """Replace the model's bfloat16 nn.Linear layers on the CPU by PackedLinear ones (a tied lm_head gets its own
    packed copy; the embedding keeps the plain table). packed: layers by module name, already packed from these
    weights (the CPU measurement's), used instead of packing them again. The number replaced."""
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and packs(m.weight.device, m.weight.dtype)]
    for name, module in linears:
        layer = (packed or {}).get(name)
        _replace(model, name, layer if layer is not None else PackedLinear(module.weight, module.bias))
    return len(linears)


class Int8Linear(_QuantizedLinear):
    """y = x @ (q * scale).T + b, with q int8 [out, in] and one scale per output channel (symmetric)."""
    held_as = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 float_above: int | None = None) -> None:
        super().__init__()
        w = weight.detach().float()  # [out, in]
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))  # [out]
        self.activation_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.keep_float(weight, float_above)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self._packed_kernel = _int8_kernel_works(weight.device, dtype)

    def product(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self._packed_kernel:
            return torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        # no packed int8 kernel on this device: an int8 -> dtype cast of the layer per call (correct, slower)
        return F.linear(x2, self.qweight.to(x2.dtype)) * self.scales


@functools.cache
def _int8_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a packed int8 kernel for this device and activation dtype (the CPU's always had one;
    CUDA's depends on the build)."""
    try:
        torch._weight_int8pack_mm(torch.ones(1, 32, device=device, dtype=dtype),
                                  torch.ones(8, 32, device=device, dtype=torch.int8),
                                  torch.ones(8, device=device, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        log.warning("no packed int8 kernel on %s for %s: int8 layers cast their weight per call", device, dtype)
        return False


class Int4Linear(_QuantizedLinear):
    """Asymmetric 4-bit groups along the input: w = (q - 8) * scale + zero, one (scale, zero) per group of
    `group` inputs per output; tinygemm's packed layout (torch's _weight_int4pack_mm kernels). A GGUF matrix in
    Q4_0, Q4_1 or Q4_K is affine 4-bit in blocks of 32 already: its codes come back exactly."""
    held_as = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 float_above: int | None = None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.group = INT4_GROUP
        if in_features % INT4_GROUP:
            raise ValueError(f"int4 weights need an input size divisible by {INT4_GROUP}, this layer has {in_features}")
        w = weight.detach().float().reshape(out_features, in_features // self.group, self.group)
        low, high = w.amin(dim=2), w.amax(dim=2)  # [out, groups]
        scales = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        zeros = low + 8 * scales  # so that (q - 8) * scale + zero = q * scale + low
        self.register_buffer("qweight", _pack_int4(q.reshape(out_features, in_features)))
        self.register_buffer("scales_and_zeros", torch.stack([scales.T, zeros.T], dim=-1).to(dtype).contiguous())
        self.activation_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.keep_float(weight, float_above)
        self.in_features, self.out_features = in_features, out_features

    def product(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if x2.is_cuda:
            return torch._weight_int4pack_mm(x2, self.qweight, self.group, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_and_zeros)


class Int8Embedding(nn.Module):
    """Rows of an int8 table times their scale: the input embedding, sharing the tied lm_head's int8 weight."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        # buffers, so that the model's byte count and .to() see them; shared with a tied int8 lm_head
        self.register_buffer("qweight", qweight, persistent=False)  # [vocab, hidden] int8
        self.register_buffer("scales", scales, persistent=False)  # [vocab]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.qweight).to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [out, in] int32 in [0, 15] -> tinygemm's packed layout for q's device."""
    if q.is_cuda:
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two values a byte, the even one high
        return torch._convert_weight_to_int4pack(packed, INT4_INNER_K_TILES)
    return torch._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)


@dataclass(frozen=True)
class WeightReport:
    weight_dtype: str  # what the linear layers hold
    bytes_by_dtype: dict[str, int]  # every parameter and buffer of the model, by torch dtype name
    why: str  # how `auto` chose, or "configured"

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {n / 2**20:.0f} MiB" for name, n in sorted(self.bytes_by_dtype.items()))
        return f"weights {self.weight_dtype} ({self.why}): {self.total_bytes / 2**20:.0f} MiB ({parts})"


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every parameter and buffer, by dtype; a tensor shared by two modules counts once (told apart by
    storage, or by identity on the meta device, where every tensor's data_ptr is 0, and for oneDNN's layout, which
    has no storage to point at)."""
    seen, totals = set(), {}
    for tensor in [*model.parameters(), *model.buffers()]:
        key = id(tensor) if tensor.is_meta or tensor.is_mkldnn else tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        name = str(tensor.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + tensor.numel() * tensor.element_size()
    return totals


def quantize_model(model: nn.Module, weight_dtype: str, device: torch.device, dtype: torch.dtype,
                   float_above: int | None = None, prebuilt: dict[str, _QuantizedLinear] | None = None,
                   head_int8: bool = False, packed: dict[str, PackedLinear] | None = None) -> None:
    """Replace the model's linear layers by `weight_dtype` ("int8", "int4" or "q8_0") ones, layer by layer on `device`,
    then move the rest there. The input embedding is int8 either way, shared with a tied int8 lm_head (the int4
    layout cannot be read row by row). head_int8 (int4): the lm_head int8, for a GGUF whose output matrix has more
    than 4 bits (load_weights). float_above: keep the float weights too, for batches of more rows. prebuilt:
    layers by module name, already made from these weights on `device` (the CPU measurement's), used instead of
    quantizing them again; packed: their float weights, packed by that measurement, kept instead of packing them
    again."""
    if weight_dtype not in QUANTIZED_WEIGHTS:
        raise ValueError(f"quantize_model takes one of {QUANTIZED_WEIGHTS}, not {weight_dtype!r}")
    _check_device(weight_dtype, device)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    started = time.perf_counter()
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in linears:
        quantized = (prebuilt or {}).get(name)
        if quantized is not None:
            float_layer = (packed or {}).get(name)
            quantized.keep_float(module.weight if float_layer is None else float_layer.weight, float_above)
        else:
            weight, bias = module.weight.to(device), module.bias.to(device) if module.bias is not None else None
            quantized = _layer_class(weight_dtype, module is head and head_int8)(weight, bias, dtype, float_above)
        _replace(model, name, quantized)
    new_head = model.get_output_embeddings()
    if tied and isinstance(new_head, Int8Linear):
        table = Int8Embedding(new_head.qweight, new_head.scales)
    else:
        table = Int8Embedding(*_int8_rows(embedding.weight.to(device), dtype))
    model.set_input_embeddings(table)
    model.to(device)
    log.info("quantized %d linear layers to %s%s on %s in %.1f s", len(linears), weight_dtype,
             " (lm_head int8)" if weight_dtype == "int4" and head_int8 else "", device, time.perf_counter() - started)


def _check_device(weight_dtype: str, device: torch.device) -> None:
    if weight_dtype == "q8_0" and device.type != "cpu":
        raise ValueError(f"weight_dtype q8_0 runs on ggml's CPU kernels only, not on {device.type}")


def _layer_class(weight_dtype: str, int8_head: bool) -> type[_QuantizedLinear]:
    """The layer type for `weight_dtype` (QUANTIZED_WEIGHTS); int8_head: this is the lm_head, kept int8 in an int4
    model."""
    if weight_dtype == "q8_0":
        from decode_gpu.model.ggml_linear import GGMLLinear
        return GGMLLinear
    return Int8Linear if weight_dtype == "int8" or int8_head else Int4Linear


def _int8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    layer = Int8Linear(weight, None, dtype)
    return layer.qweight, layer.scales


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@dataclass(frozen=True)
class WeightPlan:
    weight_dtype: str  # "int8", "int4", "q8_0" or "float" (the model's dtype)
    why: str
    float_above: int | None = None  # float weights too, for batches of more rows (_QuantizedLinear)
    prebuilt: dict = field(default_factory=dict, repr=False)  # layers the measurement made, by module name
    packed: dict = field(default_factory=dict, repr=False)  # float layers the measurement packed, by module name
    head_int8: bool = False  # int4: the lm_head int8 (the GGUF's output matrix has more than 4 bits)


@dataclass(frozen=True)
class GGUFWeightTypes:
    """The storage types of a GGUF's weight matrices: its layers', and its output matrix's (the embedding's when
    tied). Empty without a GGUF to read."""
    layers: frozenset[str] = frozenset()
    head: str = ""

    @property
    def head_int8(self) -> bool:
        """Whether an int4 model keeps its lm_head in int8: the GGUF stores it with more than 4 bits."""
        return self.head not in GGUF_EXACT_INT4


def auto_weight_plan(device: torch.device, types: GGUFWeightTypes, model: nn.Module | None = None,
                     max_batch: int = 32) -> WeightPlan:
    """weight_dtype = auto. CUDA: the GGUF's own quantization. CPU: a measurement, per batch size, of the quantized
    layers against the model's float weights: int4 where every layer matrix is affine 4-bit in the GGUF (its codes
    come back exactly), int8 otherwise. The lm_head is int4 only where the GGUF's is."""
    if device.type == "cuda":
        if types.layers & GGUF_INT4:
            return WeightPlan("int4", f"the GGUF's weights are {'/'.join(sorted(types.layers & GGUF_INT4))}",
                              head_int8=types.head_int8)
        if types.layers & GGUF_INT8:
            return WeightPlan("int8", f"the GGUF's weights are {'/'.join(sorted(types.layers & GGUF_INT8))}")
        return WeightPlan("float", "the GGUF's weights are not quantized")
    if model is None:
        return WeightPlan("float", "no model to measure")
    kind = "int4" if types.layers and types.layers <= GGUF_EXACT_INT4 else "int8"
    from decode_gpu.model import ggml_linear
    kinds = (kind, "q8_0") if ggml_linear.available() else (kind,)
    return _measured_cpu_plan(model, max_batch, kinds, types.head_int8)


def _measured_cpu_plan(model: nn.Module, max_batch: int, kinds: tuple[str, ...] = ("int8",),
                       head_int8: bool = False) -> WeightPlan:
    """Of `kinds`, the one fastest at one row if it is at least 10% faster there than the float weights, for the
    batch sizes up to the last where it is still faster. Measured on a pass over every linear layer of the model,
    as a decode step makes it: weights that do not stay in the caches (one layer alone fits, and then the float
    kernel looks better than it is). On this CPU, in this process: the kernels' speed depends on the ISA (torch's
    packed int kernels need AVX-512 to win, ggml's do not) and the thread count."""
    named = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    head = model.get_output_embeddings()
    # the float pass as the engine would run it: bfloat16 weights in oneDNN's layout where they are held so
    floats = {name: PackedLinear(m.weight, m.bias) if packs(m.weight.device, m.weight.dtype) else m
              for name, m in named.items()}
    packed = {name: m for name, m in floats.items() if isinstance(m, PackedLinear)}  # the plan keeps them
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch] + [max_batch]
    inputs = {b: {m.in_features: torch.randn(b, m.in_features, dtype=m.weight.dtype) for m in floats.values()}
              for b in batches}
    float_s: dict[int, float] = {}  # batch -> seconds of the float pass
    best, notes = None, []
    for kind in kinds:
        built = {name: _layer_class(kind, m is head and head_int8)(m.weight, m.bias, m.weight.dtype)
                 for name, m in named.items()}
        wins, seconds, timings = 0, [], []
        for batch in batches:
            if batch not in float_s:
                float_s[batch] = _time(lambda: [m(inputs[batch][m.in_features]) for m in floats.values()], reps=3)
            quantized_s = _time(lambda: [m(inputs[batch][m.in_features]) for m in built.values()], reps=3)
            timings.append(f"{batch}: {float_s[batch] * 1e3:.1f}/{quantized_s * 1e3:.1f}")
            seconds.append(quantized_s)
            if quantized_s >= (0.9 if batch == batches[0] else 1.0) * float_s[batch]:
                break
            wins = batch
        notes.append(f"float/{kind} by batch {', '.join(timings)}")
        if wins and (best is None or seconds[0] < best[2]):  # the fastest at one row
            best = (kind, wins, seconds[0], built)
    why = f"measured over the model's linear layers, ms {'; '.join(notes)}"
    if best is None:
        return WeightPlan("float", why, packed=packed)
    kind, wins, _, built = best
    return WeightPlan(kind, why, None if wins >= max_batch else wins, built, packed,
                      head_int8=kind == "int4" and head_int8)


@torch.inference_mode()
def _time(fn, reps: int = 5) -> float:
    fn()  # warm-up: packing, kernel selection
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def gguf_weight_types(path: str) -> GGUFWeightTypes:
    """The storage types of a GGUF's 2-D tensors (its weight matrices), e.g. layers {"Q4_K", "Q6_K"}, head "Q6_K"."""
    import gguf
    if not os.path.isfile(path):
        return GGUFWeightTypes()
    matrices = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    head = matrices.pop("output.weight", None) or matrices.get("token_embd.weight", "")
    matrices.pop("token_embd.weight", None)
    return GGUFWeightTypes(frozenset(matrices.values()), head)


def held_weight_dtype(model: nn.Module) -> str:
    """What the model's linear layers hold: int8, int4 (its lm_head int8, maybe), or the float dtype; with the batch
    above which the float weights are used, if they are held too."""
    layers = [m for m in model.modules() if isinstance(m, _QuantizedLinear)]
    if not layers:
        return dtype_name(next(model.parameters()).dtype)
    held = "int4" if any(isinstance(m, Int4Linear) for m in layers) else layers[0].held_as
    if held == "int4" and isinstance(model.get_output_embeddings(), Int8Linear):
        held += " (lm_head int8)"
    if layers[0].float_above is None:
        return held
    return f"{held} up to batch {layers[0].float_above}, {dtype_name(layers[0].weight.dtype)} above"


def load_weights(identity, device: torch.device, dtype: torch.dtype, weight_dtype: str,
                 max_batch: int) -> tuple[nn.Module, WeightReport]:
    """The decode model on `device` with its weights as `weight_dtype` says (WEIGHT_DTYPES). A model to be quantized
    is loaded on the CPU and quantized a layer at a time on the device, so its float weights never all sit there."""
    from decode_gpu.model.fused_projections import fuse_projections
    from decode_gpu.model.loader import load_decode_model
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, not {weight_dtype!r}")
    # the GGUF's own types matter to auto (CUDA follows them, the CPU measures by them) and to int4's lm_head
    types = gguf_weight_types(identity.path) if weight_dtype in ("auto", "int4") else GGUFWeightTypes()
    _check_device(weight_dtype, device)  # before the model loads, not after
    plan = WeightPlan(weight_dtype if weight_dtype in QUANTIZED_WEIGHTS else "float", "configured",
                      head_int8=types.head_int8)
    if weight_dtype == "auto" and device.type == "cuda":
        plan = auto_weight_plan(device, types)
    measure = weight_dtype == "auto" and device.type == "cpu"
    on_cpu = plan.weight_dtype != "float" or measure
    model = load_decode_model(identity, torch.device("cpu") if on_cpu else device, dtype)
    fuse_projections(model)  # before packing and quantizing, which then see the stacked layers
    if measure:
        plan = auto_weight_plan(device, types, model, max_batch)
    if plan.weight_dtype == "float":
        model.to(device)
        pack_linears(model, plan.packed)
    else:
        quantize_model(model, plan.weight_dtype, device, dtype, plan.float_above, plan.prebuilt,
                       plan.weight_dtype == "int4" and plan.head_int8 and _int8_head_fits(device, dtype), plan.packed)
    report = WeightReport(held_weight_dtype(model), weight_bytes(model), plan.why)
    log.info("decode %s", report.describe())
    return model, report


def _int8_head_fits(device: torch.device, dtype: torch.dtype) -> bool:
    """An int8 lm_head beside int4 layers only with a packed int8 kernel: without one, the head's weight would be
    cast to `dtype` at every step (for an 8B model's head, a 1 GB copy a step); its int4 codes are then the lesser
    loss."""
    if _int8_kernel_works(device, dtype):
        return True
    log.warning("no packed int8 kernel on %s: the lm_head is int4 like the layers, though the GGUF keeps it at more "
                "bits", device)
    return False


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
