"""When the decode engine serves the GGUF's own blocks (weight_dtype "gguf", gguf_layers.py): when configured, and
under `auto` on a CPU when the memory plan leaves room for one weight set only (no float model is then loaded or
converted at all), or when they measure at least as fast as the plan auto measured, at one row and at a burst's batch.
Each returns why (the weight report says it), or None where auto keeps its own plan."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from contracts.gguf_header import read_header
from decode_gpu.model import ggml_linear
from decode_gpu.model.gguf_layers import GGUF_LAYER_TYPES
from decode_gpu.model.weight_plan import WeightPlan, _turns, layer_class

log = logging.getLogger(__name__)
BURST_ROWS = 16  # the batch a 16-chat burst decodes at: the second size the measurement compares
TOLERANCE = 1.05  # "at least as fast" within the noise of a shared box: the mapped set holds no second copy


def unusable(identity, serving: bool) -> str | None:
    """Why the GGUF's own blocks cannot serve this model here, or None."""
    if not serving:
        return "the transformers forward reads transformers' own modules (decode_forward = \"native\" serves them)"
    if not ggml_linear.available():
        return "llama-cpp-python's ggml libraries do not load"
    if not os.path.isfile(identity.path):
        return "no GGUF file on disk"
    types = {t.tensor_type.name for t in read_header(identity.path).tensors if len(t.shape) == 2}
    other = types - GGUF_LAYER_TYPES
    return f"its matrices of type {'/'.join(sorted(other))} are not multiplied in place" if other else None


def configured(identity, serving: bool) -> str:
    reason = unusable(identity, serving)
    if reason is not None:
        raise ValueError(f"weight_dtype gguf cannot serve {os.path.basename(identity.path)}: {reason}")
    return "configured: the GGUF's own blocks, mapped"


def for_memory(identity, serving: bool, second_set: bool) -> str | None:
    """auto, where the memory plan leaves room for one set only: the file's blocks, which the workers map too."""
    if second_set:
        return None
    reason = unusable(identity, serving)
    if reason is not None:
        log.info("auto: one weight set, not the GGUF's own blocks: %s", reason)
        return None
    return ("auto: the memory plan leaves room for one weight set: the GGUF's own blocks, mapped (the workers' "
            "pages, no second copy)")


def measured(identity, serving: bool, model: nn.Module, plan: WeightPlan, dtype: torch.dtype) -> str | None:
    """auto with room for both sets: the GGUF's blocks where a pass over their layers at one row and at BURST_ROWS
    takes at most TOLERANCE x the plan's layers' (the float model loaded for the measurement then goes)."""
    if unusable(identity, serving) is not None:
        return None
    from decode_gpu.model.gguf_weights import load_gguf_model
    try:
        mapped = load_gguf_model(identity, dtype)
    except ValueError as err:
        log.info("auto: the GGUF's own blocks not measured: %s", err)
        return None
    ours = [m for m in mapped.modules() if getattr(m, "held_as", "") == "gguf"]
    notes = []
    for rows in (1, BURST_ROWS):
        theirs = _plan_layers(model, plan, rows)
        inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in [*ours, *theirs]}
        with torch.inference_mode():
            plan_s, gguf_s = _turns(theirs, ours, inputs)
        notes.append(f"{rows} row(s): plan {plan_s * 1e3:.1f} ms, gguf {gguf_s * 1e3:.1f} ms")
        if gguf_s > TOLERANCE * plan_s:
            log.info("auto keeps its plan (%s): the GGUF's own blocks measured slower, %s", plan.weight_dtype,
                     "; ".join(notes))
            return None
    return (f"auto: the GGUF's own blocks, mapped, measured at least as fast as the {plan.weight_dtype} plan "
            f"({'; '.join(notes)}), with no second copy")


def _plan_layers(model: nn.Module, plan: WeightPlan, rows: int) -> list[nn.Module]:
    """The layers the plan multiplies `rows` rows with: its quantized ones (the measurement's, else built now), or
    the float ones (packed where the plan packed them) above its float_above or in a float plan."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    use_float = plan.weight_dtype == "float" or (plan.float_above is not None and rows > plan.float_above)
    if use_float:
        return [plan.packed.get(name, m) for name, m in linears.items()]
    head = model.get_output_embeddings()
    return [plan.prebuilt.get(name) or layer_class(plan.weight_dtype, m is head and plan.head_int8)(
        m.weight, m.bias, m.weight.dtype) for name, m in linears.items()]
