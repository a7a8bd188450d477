"""The GPU check's weight_dtype stage: one model shape in the float dtype against int8 and int4 weight-only
quantization (decode_gpu.model.weight_quant), weight bytes and our engine's tok/s at each batch size.

The target: int4 at batch 1 at least 1.8x the bfloat16 tok/s (it reads a quarter of the bytes).
"""

from __future__ import annotations

import copy

import torch


def weight_stage(gm, report, name: str, model, device: torch.device, context: int, batches: list[int],
                 warmup: int, steps: int, time_left) -> str:
    """Times the engine with each weight dtype; the lines go to the report's notes. Returns a summary."""
    from decode_gpu.model.weight_quant import held_weight_dtype, quantize_model, weight_bytes
    shape = gm.SHAPES[name]
    tok_s: dict[str, dict[int, float]] = {}
    for weights in ("float", "int8", "int4"):
        if time_left() < 60:
            report.notes.append(f"weights {name} {weights}: skipped, time budget")
            continue
        candidate = model
        if weights != "float":
            candidate = copy.deepcopy(model)  # on the device; its float layers are freed as they are replaced
            quantize_model(candidate, weights, device, model.dtype)
        held = held_weight_dtype(candidate)
        gib = sum(weight_bytes(candidate).values()) / 2**30
        _, results = gm.time_ours(candidate, shape, device, context, batches, warmup, steps, lambda: time_left() - 30)
        tok_s[weights] = {b: b * 1e3 / r.ms for b, r in results.items() if not isinstance(r, str)}
        cells = ", ".join(f"batch {b}: {v:.0f} tok/s" for b, v in tok_s[weights].items())
        report.notes.append(f"weights {name} context {context} {held}: {gib:.2f} GiB; {cells}")
        del candidate
        gm._free(device)
    float_1, int4_1 = tok_s.get("float", {}).get(1), tok_s.get("int4", {}).get(1)
    if float_1 and int4_1:
        report.notes.append(f"weights {name}: int4 / {str(model.dtype)[6:]} at batch 1 = {int4_1 / float_1:.2f}x "
                            f"(target >= 1.8x)")
    return f"{len(tok_s)} weight dtypes timed"
