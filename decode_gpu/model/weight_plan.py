"""weight_dtype = auto: which weights the decode model holds, and up to which batch size. On CUDA the GGUF's own
quantization decides; on a CPU a measurement of the quantized layers against the float ones, batch size by batch
size, in this process, or the plan a quiet start recorded (plan_record.py; docs/decode.md, "Weights")."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from decode_gpu.model.int4_linear import Int4Linear
from decode_gpu.model.int8_linear import Int8Linear
from decode_gpu.model.packed_linear import PackedLinear, packs
from decode_gpu.model.quantized_linear import QuantizedLinear

# GGUF tensor types (gguf.GGMLQuantizationType names) that `auto` maps to a quantized weight on CUDA
GGUF_INT8 = {"Q8_0", "Q8_1", "Q8_K"}
GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
# affine 4-bit in blocks of 32 (Q4_K: sub-blocks of 32 with their own scale and minimum): int4 in groups of 32 holds
# their codes exactly. A matrix stored with more bits loses in int4: the embedded model's Q8_0 head did (top-1 0.875
# against float32 with it in int4, 0.961 with it in int8, docs/decode.md)
GGUF_EXACT_INT4 = {"Q4_0", "Q4_1", "Q4_K"}


@dataclass(frozen=True)
class WeightPlan:
    weight_dtype: str  # "int8", "int4", "q8_0" or "float" (the model's dtype)
    why: str
    float_above: int | None = None  # float weights too, for batches of more rows (QuantizedLinear)
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


def gguf_weight_types(path: str) -> GGUFWeightTypes:
    """The storage types of a GGUF's 2-D tensors (its weight matrices), e.g. layers {"Q4_K", "Q6_K"}, head "Q6_K"."""
    from contracts.gguf_header import read_header  # the tensor list in milliseconds (gguf's reader: ~2 s)
    if not os.path.isfile(path):
        return GGUFWeightTypes()
    matrices = {t.name: t.tensor_type.name for t in read_header(path).tensors if len(t.shape) == 2}
    head = matrices.pop("output.weight", None) or matrices.get("token_embd.weight", "")
    matrices.pop("token_embd.weight", None)
    return GGUFWeightTypes(frozenset(matrices.values()), head)


def layer_class(weight_dtype: str, int8_head: bool) -> type[QuantizedLinear]:
    """The layer type for `weight_dtype` (QUANTIZED_WEIGHTS); int8_head: this is the lm_head, kept int8 in an int4
    model."""
    if weight_dtype == "q8_0":
        from decode_gpu.model.ggml_linear import GGMLLinear
        return GGMLLinear
    return Int8Linear if weight_dtype == "int8" or int8_head else Int4Linear


def auto_weight_plan(device: torch.device, types: GGUFWeightTypes, model: nn.Module | None = None,
                     max_batch: int = 32, second_set: bool = True, float_set: bool = True) -> WeightPlan:
    """weight_dtype = auto. CUDA: the GGUF's own quantization. CPU: a measurement, per batch size, of the quantized
    layers against the model's float weights: int4 where every layer matrix is affine 4-bit in the GGUF (its codes
    come back exactly), int8 otherwise. The lm_head is int4 only where the GGUF's is. second_set, float_set: what
    the memory plan leaves room for (within_memory); the defaults keep every choice open."""
    if device.type == "cuda":
        if types.layers & GGUF_INT4:
            return WeightPlan("int4", f"the GGUF's weights are {'/'.join(sorted(types.layers & GGUF_INT4))}",
                              head_int8=types.head_int8)
        if types.layers & GGUF_INT8:
            return WeightPlan("int8", f"the GGUF's weights are {'/'.join(sorted(types.layers & GGUF_INT8))}")
        return within_memory(WeightPlan("float", "the GGUF's weights are not quantized"), "int8", float_set=float_set)
    if model is None:
        return within_memory(WeightPlan("float", "no model to measure"), "int8", float_set=float_set)
    kinds = cpu_kinds(types)
    plan = _measured_cpu_plan(model, max_batch, kinds, types.head_int8)
    if second_set and float_set:  # the memory plan leaves every choice open (or there is none): as measured
        return plan
    return within_memory(plan, kinds[0], second_set, float_set, types.head_int8)


def within_memory(plan: WeightPlan, kind: str, second_set: bool = True, float_set: bool = True,
                  head_int8: bool = False) -> WeightPlan:
    """`plan` as the memory plan (contracts/memory_plan.py) allows it; a recorded plan (plan_record.py) goes through
    here as a measured one does. second_set False: one set at every batch size, the one the measurement found
    fastest at one row (a decode step on a CPU box is mostly of few rows, and the smaller set leaves the KV pool more
    room); the float weights kept for larger batches are dropped. float_set False: no float weights at all; where
    the float set measured fastest, `kind` (the quantized kind auto measured; head_int8 as for it) instead."""
    if not float_set and plan.weight_dtype == "float":
        return WeightPlan(kind, f"{plan.why}; {kind}: the memory plan leaves no room for the float weights",
                          head_int8=kind == "int4" and head_int8)
    if plan.float_above is not None and not (second_set and float_set):
        return dataclasses.replace(plan, float_above=None, packed={}, why=(
            f"{plan.why}; {plan.weight_dtype} at every batch size: the memory plan leaves no room for the float "
            f"weights beside it"))
    return plan


def cpu_kinds(types: GGUFWeightTypes) -> tuple[str, ...]:
    """The quantized kinds auto measures on this CPU against the float weights: int4 where every layer matrix is
    affine 4-bit in the GGUF, else int8; and ggml's q8_0 where its libraries load."""
    kind = "int4" if types.layers and types.layers <= GGUF_EXACT_INT4 else "int8"
    from decode_gpu.model import ggml_linear
    kinds = (kind, "q8_0") if ggml_linear.available() else (kind,)
    if len(kinds) > 1 and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        # torch's packed int4/int8 kernels lose to float without AVX-512 (here: int4 2-13x slower than float32 at
        # batch 1 on an AVX2 CPU); ggml's do not need it. Building and timing them cost seconds of every start
        kinds = ("q8_0",)
    return kinds


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
        built = {name: layer_class(kind, m is head and head_int8)(m.weight, m.bias, m.weight.dtype)
                 for name, m in named.items()}
        wins, seconds, timings = 0, [], []
        for batch in batches:
            float_pass, quantized_s = _turns(floats.values(), built.values(), inputs[batch])
            float_s[batch] = min(float_s.get(batch, float_pass), float_pass)
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


def _pass_seconds(layers, inputs: dict[int, torch.Tensor]) -> float:
    """Seconds of one pass over `layers` (best of 3), each fed the input of its width from `inputs`."""
    return _time(lambda: [m(inputs[m.in_features]) for m in layers], reps=3)


def _turns(floats, quantized, inputs: dict[int, torch.Tensor], reps: int = 3) -> tuple[float, float]:
    """Seconds of one pass over each set of layers (best of `reps`), each layer fed the input of its width: the two
    take turns, so a burst of other work on the machine slows both alike rather than one of them."""
    passes = [lambda layers=layers: [m(inputs[m.in_features]) for m in layers] for layers in (floats, quantized)]
    best = [_time(fn, reps=1) for fn in passes]  # each warmed up, then timed once
    for _ in range(reps - 1):
        best = [min(b, _time(fn, reps=1, warm=False)) for b, fn in zip(best, passes)]
    return best[0], best[1]


@torch.inference_mode()
def _time(fn, reps: int = 5, warm: bool = True) -> float:
    if warm:
        fn()  # warm-up: packing, kernel selection
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best
