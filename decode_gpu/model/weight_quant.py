"""Weight-only quantization of the decode model: its linear layers (and the tied embedding) stored as int8 per
output channel or int4 in groups, multiplied by torch's own packed kernels; activations stay in the model's dtype.

A decode step reads every weight once, so at small batches its time is the weights' bytes: int8 halves them
against bfloat16, int4 quarters them. The layers are quantized one at a time on the device they run on, so an 8B
model never sits there in bfloat16 (docs/decode.md, "Weights").

The entry points and the `weight_dtype` setting's values live here; the layers in int8_linear.py, int4_linear.py,
ggml_linear.py (q8_0) and packed_linear.py (prepacked bfloat16 on the CPU); `auto`'s choice in weight_plan.py, its
record from a quiet start in plan_record.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from decode_gpu.model import gguf_plan
from decode_gpu.model.gguf_layers import GGUFEmbedding
from decode_gpu.model.int4_linear import Int4Linear
from decode_gpu.model.int8_linear import Int8Embedding, Int8Linear, int8_kernel_works, int8_rows
from decode_gpu.model.native_decoder import DETERMINISTIC_ROWS
from decode_gpu.model.packed_linear import PackedLinear, pack_linears, replace_module
from decode_gpu.model.plan_record import cpu_weight_plan
from decode_gpu.model.quantized_linear import QuantizedLinear
from decode_gpu.model.weight_plan import (
    GGUFWeightTypes,
    WeightPlan,
    auto_weight_plan,
    cpu_kinds,
    gguf_weight_types,
    layer_class,
    within_memory,
)

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "int4", "q8_0", "gguf")
QUANTIZED_WEIGHTS = ("int8", "int4", "q8_0")  # q8_0: ggml's Q8_0 blocks and CPU kernels (ggml_linear.py), CPU only
FLOAT_WEIGHTS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def weights_by_precision(model: nn.Module) -> dict[str, int]:
    """Bytes of every parameter and buffer by the precision it holds weights in: a quantized layer's codes and scales
    under its weight_dtype (int8, int4, q8_0), an int8 embedding table under int8, everything else (norms, a float
    copy kept for large batches, a float table) under its torch dtype. A tensor shared by two modules counts once."""
    seen, totals = set(), {}
    for module in model.modules():
        quantized = module.held_as if isinstance(module, QuantizedLinear) else \
            "int8" if isinstance(module, Int8Embedding) else "gguf" if isinstance(module, GGUFEmbedding) else None
        held = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in held:
            key = id(tensor) if tensor.is_meta or tensor.is_mkldnn else tensor.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            precision = quantized if quantized and name not in ("weight", "bias") else dtype_name(tensor.dtype)
            totals[precision] = totals.get(precision, 0) + tensor.numel() * tensor.element_size()
    return totals


def quantize_model(model: nn.Module, weight_dtype: str, device: torch.device, dtype: torch.dtype,
                   float_above: int | None = None, prebuilt: dict[str, QuantizedLinear] | None = None,
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
            quantized = layer_class(weight_dtype, module is head and head_int8)(weight, bias, dtype, float_above)
        replace_module(model, name, quantized)
    new_head = model.get_output_embeddings()
    if tied and isinstance(new_head, Int8Linear):
        table = Int8Embedding(new_head.qweight, new_head.scales)
    else:
        table = Int8Embedding(*int8_rows(embedding.weight.to(device), dtype))
    model.set_input_embeddings(table)
    model.to(device)
    log.info("quantized %d linear layers to %s%s on %s in %.1f s", len(linears), weight_dtype,
             " (lm_head int8)" if weight_dtype == "int4" and head_int8 else "", device, time.perf_counter() - started)


def _check_device(weight_dtype: str, device: torch.device) -> None:
    if weight_dtype in ("q8_0", "gguf") and device.type != "cpu":
        raise ValueError(f"weight_dtype {weight_dtype} runs on ggml's CPU kernels only, not on {device.type}")


def held_weight_dtype(model: nn.Module) -> str:
    """What the model's linear layers hold: int8, int4 (its lm_head int8, maybe), or the float dtype; with the batch
    above which the float weights are used, if they are held too."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        return dtype_name(next(model.parameters()).dtype)
    held = "int4" if any(isinstance(m, Int4Linear) for m in layers) else layers[0].held_as
    if held == "int4" and isinstance(model.get_output_embeddings(), Int8Linear):
        held += " (lm_head int8)"
    if layers[0].float_above is None:
        return held
    return f"{held} up to batch {layers[0].float_above}, {dtype_name(layers[0].weight.dtype)} above"


def load_weights(identity, device: torch.device, dtype: torch.dtype, weight_dtype: str, max_batch: int,
                 fixed_precision: bool = False, serving: bool = False, second_set: bool = True,
                 float_set: bool = True, repack: bool = False) -> tuple[nn.Module, WeightReport]:
    """The decode model on `device` with its weights as `weight_dtype` says (WEIGHT_DTYPES). A model to be quantized
    is loaded on the CPU and quantized a layer at a time on the device, so its float weights never all sit there.
    fixed_precision (deterministic decoding): one precision for every batch size (_one_precision). serving: the
    serving model the native forward reads, not transformers' (loader). second_set, float_set: what the memory plan
    leaves auto room for (weight_plan.within_memory: the float set beside the quantized one, float weights at all).
    repack: the GGUF's own blocks, where served, are repacked by llama.cpp's CPU repack (the plan made room)."""
    from decode_gpu.model.fused_projections import fuse_projections
    from decode_gpu.model.loader import load_decode_model, own_memory
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, not {weight_dtype!r}")
    # the GGUF's own types matter to auto (CUDA follows them, the CPU measures by them) and to int4's lm_head
    types = gguf_weight_types(identity.path) if weight_dtype in ("auto", "int4") else GGUFWeightTypes()
    _check_device(weight_dtype, device)  # before the model loads, not after
    plan = WeightPlan(weight_dtype if weight_dtype in QUANTIZED_WEIGHTS else "float", "configured",
                      head_int8=types.head_int8)
    if weight_dtype == "auto" and device.type == "cuda":
        plan = auto_weight_plan(device, types, float_set=float_set)
    measure = weight_dtype == "auto" and device.type == "cpu"
    gguf = gguf_plan.configured(identity, serving) if weight_dtype == "gguf" else \
        gguf_plan.for_memory(identity, serving, second_set) if measure else None
    if gguf is not None:  # the file's own blocks: nothing converted, nothing loaded but the norms
        try:
            return _gguf_model(identity, dtype, gguf, repack)
        except ValueError as err:  # a family whose converter changes a matrix's values: auto goes on without
            if weight_dtype == "gguf":
                raise
            log.info("auto: not the GGUF's own blocks: %s", err)
    on_cpu = plan.weight_dtype != "float" or measure
    model = load_decode_model(identity, torch.device("cpu") if on_cpu else device, dtype, serving=serving)
    fuse_projections(model)  # before packing and quantizing, which then see the stacked layers
    if measure:  # a quiet start's recorded plan, else a measurement (recorded if the machine was quiet)
        plan = cpu_weight_plan(identity, types, model, dtype, max_batch)
        # a recorded plan bypasses auto_weight_plan: the memory plan's limits apply to it here, as to a measured one
        plan = within_memory(plan, cpu_kinds(types)[0], second_set, float_set, types.head_int8)
        if fixed_precision and plan.float_above is not None:
            plan = _one_precision(plan)
        gguf = gguf_plan.measured(identity, serving, model, plan, dtype)
        if gguf is not None:  # at least as fast at one row as the plan measured: the float model goes
            del model
            # where the plan had room for both sets, a repacked copy (smaller than either) fits in it too
            return _gguf_model(identity, dtype, gguf, repack or second_set)
    if plan.weight_dtype == "float":
        model.to(device)
        pack_linears(model, plan.packed)
    else:
        quantize_model(model, plan.weight_dtype, device, dtype, plan.float_above, plan.prebuilt,
                       plan.weight_dtype == "int4" and plan.head_int8 and _int8_head_fits(device, dtype), plan.packed)
    own_memory(model)  # what the plan kept, out of the loaded file's mapping (which then goes)
    report = WeightReport(held_weight_dtype(model), weight_bytes(model), plan.why)
    log.info("decode %s", report.describe())
    return model, report


def _gguf_model(identity, dtype: torch.dtype, why: str, repack: bool = False) -> tuple[nn.Module, WeightReport]:
    from decode_gpu.model.gguf_weights import load_gguf_model, repacked_bytes
    model = load_gguf_model(identity, dtype, repack=repack)
    repacked = repacked_bytes(model)
    held = weight_bytes(model)
    if repacked:  # memory of the engine's own, beside the mapped file's pages
        held["repacked"] = repacked
        why += f"; {repacked / 2**30:.2f} GiB repacked by llama.cpp's CPU repack"
    report = WeightReport(held_weight_dtype(model), held, why)
    log.info("decode %s", report.describe())
    return model, report


def _one_precision(plan: WeightPlan) -> WeightPlan:
    """Deterministic decoding's plan: one precision at every batch size, the one `plan` uses for products of
    DETERMINISTIC_ROWS rows, the only size deterministic products have (native_decoder.fixed_rows). Here (AVX-512,
    bfloat16) a plan of int4 up to batch 4 measured 8 rows at 15.8 ms bfloat16 against 17.4 int4: its float weights."""
    if plan.float_above < DETERMINISTIC_ROWS:
        return WeightPlan("float", f"{plan.why}; float weights at every batch size (deterministic: every product is "
                          f"of {DETERMINISTIC_ROWS} rows, above the plan's {plan.weight_dtype} batches)",
                          packed=plan.packed)
    return dataclasses.replace(plan, float_above=None, why=f"{plan.why}; {plan.weight_dtype} at every batch size "
                               f"(deterministic: every product is of {DETERMINISTIC_ROWS} rows, within its batches)")


def _int8_head_fits(device: torch.device, dtype: torch.dtype) -> bool:
    """An int8 lm_head beside int4 layers only with a packed int8 kernel: without one, the head's weight would be
    cast to `dtype` at every step (for an 8B model's head, a 1 GB copy a step); its int4 codes are then the lesser
    loss."""
    if int8_kernel_works(device, dtype):
        return True
    log.warning("no packed int8 kernel on %s: the lm_head is int4 like the layers, though the GGUF keeps it at more "
                "bits", device)
    return False


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
