"""The GPU check's forward stage: our native decoder forward (decode_gpu.model.native_decoder) with CUDA graphs
against the same forward eager, and against transformers' forward, on one model shape and context.

The native configurations run on the serving model (decode_gpu.model.serving_model), as `edge serve` does, built
over the transformers model's own weight storage (no copy); the transformers configurations on that model.

- Graph capture: the native runner captures its graphs (one per batch bucket, the whole step each).
- Tokens identical: greedy tokens of the captured graphs equal the eager path's, in deterministic mode (both then
  use the same KV splits and matmul row blocks; the default's eager step sizes its splits by the batch's longest
  context, its graphs by max_model_len, so their last bits may differ).
- Agreement with transformers' forward (eager), as a fraction of tokens: random weights have near ties, and the
  two forwards round differently in bfloat16, so this is reported, not required.
- Step ms of each: native with graphs (default and deterministic), native eager, transformers with graphs.
"""

from __future__ import annotations

import statistics
import time

import torch

CONFIGS = {  # name -> RunnerConfig options
    "native graphs": {},
    "native graphs deterministic": {"deterministic": True},
    "native eager deterministic": {"deterministic": True, "enforce_eager": True},
    "native eager": {"enforce_eager": True},
    "transformers graphs": {"forward": "transformers"},
    "transformers eager": {"forward": "transformers", "enforce_eager": True},
}


def forward_stage(gm, report, name: str, model, device: torch.device, context: int, batch: int, steps: int,
                  time_left) -> str:
    """Runs each configuration on the same handoffs; notes go to the report. Raises when the graphs' tokens differ
    from the eager path's (deterministic), or when CUDA graphs were not captured on CUDA."""
    from decode_gpu.core.scheduler import SchedulerConfig
    from decode_gpu.engine import DecodeEngine, EngineConfig
    from decode_gpu.model.serving_model import serving_model_from
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    serving = serving_model_from(model.config, model.generation_config, dict(model.state_dict()))
    shape = gm.SHAPES[name]
    identity = gm.identity_for(shape)
    new_tokens = steps + 2
    handoffs = gm.synthetic_handoffs(identity, context, batch, new_tokens, shape.vocab_size)
    tokens, ms, captured = {}, {}, {}
    for config_name, options in CONFIGS.items():
        if time_left() < 30:
            report.notes.append(f"native forward {name}: {config_name} skipped, time budget")
            continue
        config = RunnerConfig(kv_cache_tokens=batch * (context + new_tokens + 32), max_num_seqs=batch,
                              max_model_len=context + new_tokens + 16, **options)
        on = model if options.get("forward") == "transformers" else serving
        runner = ModelRunner(on, identity, config, device)
        captured[config_name] = runner.graphs is not None
        engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=batch),
                                                   max_model_len=config.max_model_len,
                                                   max_backlog_bytes=sum(h.payload_bytes for h in handoffs) + 1))
        out: dict[str, list[int]] = {}
        times = []
        for event in [e for h in handoffs for e in engine.add(h)]:
            out.setdefault(event.request_id, []).extend(event.token_ids)
        first = True
        while engine.has_work:
            started = time.perf_counter()
            events = engine.step()
            gm._sync(device)
            if not first:  # the first step imports the handoffs
                times.append(time.perf_counter() - started)
            first = False
            for event in events:
                if event.error:
                    raise RuntimeError(f"{config_name}: {event.error}")
                out.setdefault(event.request_id, []).extend(event.token_ids)
        tokens[config_name] = out
        ms[config_name] = 1e3 * statistics.median(times) if times else float("nan")
        del engine, runner
        gm._free(device)
    del serving
    timing = ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
    report.notes.append(f"native forward {name} (serving model) context {context} batch {batch}: step {timing}; "
                        "graphs captured: "
                        + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in captured.items()))
    problems = []
    if device.type == "cuda" and not all(v for k, v in captured.items() if "graphs" in k):
        problems.append("CUDA graphs were not captured")
    graphs, eager = tokens.get("native graphs deterministic"), tokens.get("native eager deterministic")
    if graphs is not None and eager is not None:
        same = graphs == eager
        report.notes.append(f"native forward {name}: deterministic tokens, graphs against eager: "
                            f"{'identical' if same else 'DIFFERENT'} ({batch} x {new_tokens} tokens)")
        if not same:
            problems.append("the captured graphs' tokens differ from the eager path's")
    ours, theirs = tokens.get("native eager"), tokens.get("transformers eager")
    if ours is not None and theirs is not None:
        agree = sum(a == b for k in theirs for a, b in zip(ours[k], theirs[k]))
        total = sum(len(v) for v in theirs.values())
        report.notes.append(f"native forward {name}: tokens equal to transformers' forward (eager): {agree}/{total}")
    if problems:
        raise AssertionError("; ".join(problems))
    return f"{len(ms)} configurations run"
