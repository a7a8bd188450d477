"""The GPU check's benchmark stage: per model and context, our engine, then transformers `generate` and
`generate_batch` as baselines, each cell of the report's table filled as it is measured, within the deadline."""

from __future__ import annotations

import traceback

from checks.gpu_report import Deadline, Report

CB_FIRST = (64, 1)  # generate_batch runs these batch sizes first: the target compares batch 64, and 1 is cheap


def run_benchmarks(args, device, report: Report, deadline: Deadline) -> None:
    import torch

    from checks import gpu_models as gm
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = {}
    for name in args.models:
        if deadline.left() < 40:
            report.skip(f"build {name}", "time budget")
            continue
        report.stage(f"build {name}", _build, gm, name, device, dtype, models)
    report.notes.append(f"random weights, {str(dtype).split('.')[-1]}, KV pool in the model's dtype, greedy; "
                        f"ours: ms/step is the median of {args.steps} steps after {args.warmup} warm-up step(s), "
                        f"the engine's whole step (schedule, forward, sampling, the host copy); generate: the "
                        f"median gap between tokens reaching a streamer, after a warm-up call; generate_batch: the "
                        f"median gap between a request's tokens once every request has its first token "
                        f"(prefill excluded)")
    for context in args.contexts:
        for name, model in models.items():
            if deadline.left() < 30 + _import_bytes(gm.SHAPES[name], context, max(args.batches)) / 1e9:
                report.skip(f"ours {name} context {context}", "time budget")
                continue
            if report.stage(f"ours {name} context {context}", _ours, gm, args, report, deadline, name, model, device,
                            context) is None:
                for batch in args.batches:
                    report.cell(_key(args, name, context, batch), "ours ms/step", "error (see stages)")
    if models and deadline.left() > 120:
        from checks.gpu_weights import weight_stage
        name = list(models)[-1]  # the largest shape: where the weights' bytes matter
        report.stage(f"weights {name}", weight_stage, gm, report, name, models[name], device, args.contexts[0],
                     [b for b in args.batches if b in (1, 32)] or args.batches[:1], args.warmup, args.steps,
                     lambda: deadline.left() - 60)
    if models and deadline.left() > 90:
        from checks.gpu_forward import forward_stage
        name = list(models)[0]  # the smallest shape: where the per-layer overhead shows, and graphs matter most
        report.stage(f"native forward {name}", forward_stage, gm, report, name, models[name], device,
                     args.contexts[0], min(8, max(args.batches)), args.steps, lambda: deadline.left() - 45)
    if args.skip_baselines:
        return
    for context in args.contexts:
        for name, model in models.items():
            report.stage(f"generate {name} context {context}", _generate, gm, args, report, deadline, name, model,
                         device, context)
    cb_order = [(c, b) for c in args.contexts for b in [*CB_FIRST, *args.batches] if b in args.batches]
    for context, batch in dict.fromkeys(cb_order):
        for name, model in models.items():
            _generate_batch(gm, args, report, deadline, name, model, device, context, batch)


def _build(gm, name: str, device, dtype, models: dict) -> str:
    model, seconds = gm.build_model(gm.SHAPES[name], device, dtype)
    models[name] = model
    params = sum(p.numel() for p in model.parameters())
    read = gm.weight_bytes_read_per_step(model)
    return f"{params / 1e9:.2f} B parameters, {read / 1e9:.1f} GB of weights read per step, built in {seconds:.1f} s"


def _import_bytes(shape, context: int, batch: int) -> int:
    return batch * context * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2  # f16 K and V


def _key(args, name: str, context: int, batch: int) -> tuple[int, str, int, int]:
    return args.models.index(name), name, context, batch


def _ours(gm, args, report: Report, deadline: Deadline, name: str, model, device, context: int) -> str:
    shape = gm.SHAPES[name]
    first_s, results = gm.time_ours(model, shape, device, context, args.batches, args.warmup, args.steps,
                                    lambda: deadline.left() - 20)
    weights = gm.weight_bytes_read_per_step(model)
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * model.dtype.itemsize
    for batch, result in results.items():
        key = _key(args, name, context, batch)
        if isinstance(result, str):
            report.cell(key, "ours ms/step", result)
            continue
        read = weights + result.kv_tokens * per_token
        floor_ms = 1e3 * read / report.bandwidth
        report.cell(key, "ours ms/step", f"{result.ms:.2f}")
        report.rows[key].update({"ours tok/s": f"{batch * 1e3 / result.ms:.0f}",
                                 "GB read/step": f"{read / 1e9:.3g}", "floor ms": f"{floor_ms:.2f}",
                                 "% of floor": f"{100 * floor_ms / result.ms:.3g}%"})
    done = sum(not isinstance(r, str) for r in results.values())
    return (f"{max(args.batches)} handoffs of {context} tokens imported + first step {first_s:.1f} s; "
            f"{done} batch sizes timed")


def _ours_ms(report: Report, key) -> float | None:
    try:
        return float(report.rows.get(key, {}).get("ours ms/step", ""))
    except ValueError:
        return None


def _generate(gm, args, report: Report, deadline: Deadline, name: str, model, device, context: int) -> str:
    done = []
    for batch in args.batches:
        key = _key(args, name, context, batch)
        estimate = (args.steps + 2) * 4 * (_ours_ms(report, key) or 1000) / 1e3 + 2  # transformers: a few x slower
        if deadline.left() < estimate + 20:
            report.cell(key, "generate ms/step", "skipped: time budget")
            continue
        try:
            ms = gm.time_generate(model, gm.SHAPES[name], device, context, batch, args.steps)
        except Exception as err:  # one batch size's failure (out of memory, say) is its own cell
            traceback.print_exc()
            report.cell(key, "generate ms/step", f"error: {type(err).__name__}: {str(err)[:80]}")
            report.all_ok = False
            gm._free(device)
            continue
        report.cell(key, "generate ms/step", f"{ms:.2f}")
        done.append(batch)
    return f"timed at batch {done}"


def _generate_batch(gm, args, report: Report, deadline: Deadline, name: str, model, device, context: int, batch: int):
    key = _key(args, name, context, batch)
    shape = gm.SHAPES[name]
    prefill_s = 2 * batch * context * shape.num_layers * 12 * shape.hidden_size ** 2 / 2e14  # rough, H200 bf16
    decode_s = (args.steps + 4 + batch * context / 8192) * 4 * (_ours_ms(report, key) or 50) / 1e3
    estimate = getattr(report, "cb_setup_s", 20.0) + prefill_s + decode_s  # set-up: 20 s until a call measures it
    title = f"generate_batch {name} context {context} batch {batch}"
    if getattr(report, "cb_hung", False) or deadline.left() < estimate + 15:
        report.cell(key, "generate_batch ms/step", "skipped: time budget")
        report.skip(title, "a generate_batch call hung" if getattr(report, "cb_hung", False) else "time budget")
        return
    value = report.stage(title, _cb_cell, gm, report, key, model, shape, device, context, batch, args.steps,
                         max(30.0, min(deadline.left() - 15, 3 * estimate)), prefill_s)
    if value is None:
        report.cell(key, "generate_batch ms/step", "error (see stages)")


def _cb_cell(gm, report: Report, key, model, shape, device, context, batch, steps, timeout_s, prefill_s) -> str:
    try:
        ms, wall, note = gm.time_generate_batch(model, shape, device, context, batch, steps, timeout_s)
    except TimeoutError:
        report.cb_hung = True  # its thread still holds the GPU: later generate_batch calls would be meaningless
        raise
    report.cb_setup_s = max(5.0, wall - prefill_s - 1e-3 * ms * (steps + 4 + batch * context / 8192))
    report.cell(key, "generate_batch ms/step", f"{ms:.2f}" + (f" ({note})" if note else ""))
    ours = _ours_ms(report, key)
    if ours:
        report.cell(key, "generate_batch ÷ ours", f"{ms / ours:.1f}x")
    return f"{ms:.2f} ms/step, the whole call {wall:.1f} s"
