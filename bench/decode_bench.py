"""Benchmark the decode engine against static batching and transformers' continuous batching.

    make bench-decode          # or: .venv/bin/python -m bench.decode_bench [--device auto] [--outputs 16,32,64,128]

Workload: 16 requests, all submitted at t=0, prompts of 64/256/1024 tokens in a 6:3:1 mix, greedy, output
lengths cycling through --outputs. Three systems in one run, each doing prefill and decode:
  ours     llama.cpp prefill (q8_0 KV) -> handoff -> paged engine (prefill of request i+1 interleaved with
           one decode step, as one process: on the appliance they run in parallel on CPU and GPU)
  static   transformers generate() on one left-padded batch, max_new_tokens = the longest output
  cb       transformers generate_batch-style continuous batching (init_continuous_batching, per-request
           max_new_tokens)
Useful tokens are the tokens each request asked for; latency is from t=0 to the request's last token.
Then the engine's step at batch 1/8/32 and context 256 with the serving weights (weight_dtype auto, fused
projections) by forward: transformers' model code with the paged attention plugged in, our native forward, and
the native forward with deterministic numerics, beside the linear layers alone (what is not overhead); the step
time against a plain transformers forward with its own DynamicCache; the cost of structured-output masks; and the
step by weight_dtype (bench/weights_bench.py).

    .venv/bin/python -m bench.decode_bench --skip ours,static,cb,steps,grammar,weights   # the forwards' table only
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from transformers import DynamicCache, GenerationConfig

from contracts.handoff import SamplingParams
from decode_gpu.attention.paged_batch import build_paged_batch
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.kv.pool import bytes_per_token
from decode_gpu.model.loader import load_decode_model
from decode_gpu.runner.device import resolve_device, resolve_dtype
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

TEXT = ("Operators of on-prem appliances care about predictable latency, honest errors and simple configuration. "
        "This paragraph is filler text used to build prompts of a chosen length for the benchmark. ")


def workload(prefiller: Prefiller, outputs: list[int]) -> list[tuple[list[int], int]]:
    base = prefiller.tokenize(TEXT * 60)
    lengths = [64] * 10 + [256] * 5 + [1024]
    return [(base[i * 7:i * 7 + n], outputs[i % len(outputs)]) for i, n in enumerate(lengths)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_ours(prefiller, model, device, requests) -> dict:
    runner = ModelRunner(model, prefiller.identity, RunnerConfig(kv_cache_tokens=16384), device)
    engine = DecodeEngine(runner, EngineConfig(max_model_len=4096))
    done, peak_blocks, started = {}, 0, time.perf_counter()

    def record(events):
        for event in events:
            if event.finish_reason:
                done[event.request_id] = time.perf_counter() - started

    for i, (tokens, n_out) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=n_out)
        record(engine.add(prefiller.prefill(PrefillRequest(f"r{i}", tuple(tokens), params)).handoff))
        record(engine.step())
        peak_blocks = max(peak_blocks, engine.blocks.num_used_blocks)
    while engine.has_work:
        record(engine.step())
        peak_blocks = max(peak_blocks, engine.blocks.num_used_blocks)
    kv_bytes = peak_blocks * runner.pool.shape.block_size * runner.pool.shape.bytes_per_token()
    return dict(latencies=list(done.values()), wall=time.perf_counter() - started, kv_bytes=kv_bytes)


def run_static(model, requests, per_token_bytes) -> dict:
    longest = max(len(t) for t, _ in requests)
    max_new = max(n for _, n in requests)
    ids = torch.full((len(requests), longest), model.config.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (tokens, _) in enumerate(requests):
        ids[row, longest - len(tokens):] = torch.tensor(tokens)
        mask[row, longest - len(tokens):] = 1
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                       max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=model.config.pad_token_id or 0)
    wall = time.perf_counter() - started
    return dict(latencies=[wall] * len(requests), wall=wall,
                kv_bytes=len(requests) * (longest + max_new) * per_token_bytes)


def run_cb(model, requests) -> dict:
    config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in requests), eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    started = time.perf_counter()
    for i, (tokens, n_out) in enumerate(requests):
        manager.add_request(tokens, request_id=f"r{i}", max_new_tokens=n_out, eos_token_id=-1)
    done = {}
    while len(done) < len(requests):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers continuous batching stopped before finishing")
        if result.is_finished():
            done[result.request_id] = time.perf_counter() - started
    wall = time.perf_counter() - started
    manager.stop(block=True)
    return dict(latencies=list(done.values()), wall=wall, kv_bytes=None)


def legacy_forward(runner, seqs, block_tables):
    """The step as it was before the static step, kept to measure against: metadata built per step in
    Python loops (build_paged_batch) and copied as fresh tensors, the torch path gathering every token's slot.
    # [len(seqs), vocab]"""
    paged = build_paged_batch(runner.pool, [block_tables[s.seq_id] for s in seqs], [s.num_cached + 1 for s in seqs],
                              [1] * len(seqs), runner.device)
    input_ids = torch.tensor([[s.tokens[s.num_cached] for s in seqs]], device=runner.device)  # [1, n_seqs]
    positions = torch.tensor([[s.num_cached for s in seqs]], device=runner.device)  # [1, n_seqs]
    with torch.inference_mode():
        out = runner.model(input_ids=input_ids, position_ids=positions, paged=paged, use_cache=False)
    return out.logits[0].float()


def step_times(prefiller, model, device, batches, context=256, steps=9) -> list[tuple[int, float, float, float]]:
    tokens = tuple(prefiller.tokenize(TEXT * 8)[:context])
    handoff = prefiller.prefill(PrefillRequest("s", tokens, SamplingParams(temperature=0.0, max_tokens=64))).handoff
    rows = []
    for batch in batches:
        runner = ModelRunner(model, prefiller.identity, RunnerConfig(kv_cache_tokens=(context + 80) * batch,
                                                                     forward="transformers"), device)
        engine = DecodeEngine(runner, EngineConfig())
        for i in range(batch):
            engine.add(_renamed(handoff, f"s{i}"))
        engine.step()  # imports and the first step
        ours = _timed(engine.step, steps, device)
        runner.forward = types.MethodType(legacy_forward, runner)
        before = _timed(engine.step, steps, device)
        model.set_attn_implementation("sdpa")
        ids = torch.tensor([tokens] * batch, device=device)
        with torch.inference_mode():
            out = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)

        def plain_step():
            nonlocal nxt
            with torch.inference_mode():
                nxt = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        rows.append((batch, before, ours, _timed(plain_step, steps, device)))
    return rows


FORWARDS = {"transformers": {"forward": "transformers"}, "native": {"forward": "native"},
            "native deterministic": {"forward": "native", "deterministic": True}}


def forward_step_times(prefiller, device, batches, context=256, steps=15, rounds=3) -> tuple[str, list]:
    """The engine's step by forward at each batch size, with the serving weights (load_weights, weight_dtype auto):
    per batch, `rounds` rounds that time each forward's `steps` steps in turn (a burst of other work on the machine
    lands on all of them alike), the median of all; and one pass over the linear layers alone at that batch.
    Returns (the weights' description, rows of (batch, {forward: ms}, linear layers ms))."""
    from decode_gpu.model.weight_plan import _pass_seconds
    from decode_gpu.model.weight_quant import load_weights
    dtype = resolve_dtype("auto", device)
    model, report = load_weights(prefiller.identity, device, dtype, "auto", max(batches))
    tokens = tuple(prefiller.tokenize(TEXT * 8)[:context])
    new_tokens = rounds * steps + 8  # every sequence still decoding at the last timed step
    handoff = prefiller.prefill(PrefillRequest("s", tokens, SamplingParams(temperature=0.0,
                                                                           max_tokens=new_tokens))).handoff
    linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")
               and not list(m.children()) and type(m).__name__ != "FusedSlice"]
    rows = []
    for batch in batches:
        engines = {}
        for name, options in FORWARDS.items():
            runner = ModelRunner(model, prefiller.identity, RunnerConfig(
                kv_cache_tokens=(context + new_tokens + 32) * batch, max_num_seqs=max(batches), **options),
                device)
            engine = DecodeEngine(runner, EngineConfig())
            for i in range(batch):
                engine.add(_renamed(handoff, f"s{i}"))
            engine.step()  # imports and the first step
            engines[name] = engine
        times = {name: [] for name in engines}
        inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype, device=device) for m in linears}
        linear_ms = []
        for _ in range(rounds):
            for name, engine in engines.items():
                times[name] += _step_times(engine.step, steps, device)
            linear_ms.append(_pass_seconds(linears, inputs) * 1e3)  # in the same rounds: the same load
        rows.append((batch, {name: statistics.median(t) for name, t in times.items()}, statistics.median(linear_ms)))
        del engines
    return report.describe(), rows


def print_forward_step_times(weights: str, rows) -> None:
    print(f"\nThe engine's step by forward, context 256, median of 3 rounds x 15 steps; {weights}; linear layers: "
          f"one pass over the model's linear layers alone (best of 3 in each round, the median of the rounds), the "
          f"rest of a step is overhead")
    names = list(FORWARDS)
    print("| batch | " + " | ".join(f"{n} ms" for n in names) + " | linear layers ms | overhead transformers ms | "
          "overhead native ms | native / transformers | deterministic / native |")
    print("|" + "---|" * (len(names) + 6))
    for batch, ms, linear in rows:
        print(f"| {batch} | " + " | ".join(f"{ms[n]:.1f}" for n in names) + f" | {linear:.1f} | "
              f"{ms['transformers'] - linear:.1f} | {ms['native'] - linear:.1f} | "
              f"{ms['native'] / ms['transformers']:.2f}x | {ms['native deterministic'] / ms['native']:.2f}x |")


SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": '
          '{"type": "string"}}, "score": {"type": "number"}}, "required": ["name", "tags", "score"]}')


def grammar_costs(prefiller, model, device, batches, steps=9) -> list[tuple[int, float, float]]:
    """The decode step with every row under a JSON schema against the same rows unconstrained: what the
    structured outputs' token masks cost (host: the matchers fill a bitmask; device: the mask is applied)."""
    from decode_gpu.model.loader import load_tokenizer
    tokenizer = load_tokenizer(prefiller.identity)
    tokens = tuple(prefiller.tokenize("Describe a city as a JSON object with a name, tags and a score.")[:64])
    rows = []
    for batch in batches:
        medians = []
        for structured in (None, ("json_schema", SCHEMA)):
            params = SamplingParams(temperature=0.0, max_tokens=400, structured=structured)
            handoff = prefiller.prefill(PrefillRequest("g", tokens, params)).handoff
            runner = ModelRunner(model, prefiller.identity, RunnerConfig(kv_cache_tokens=512 * batch), device)
            engine = DecodeEngine(runner, EngineConfig(), tokenizer, (tokenizer.eos_token_id,))
            for i in range(batch):
                engine.add(_renamed(handoff, f"g{i}"))
            engine.step()
            medians.append(_timed(engine.step, steps, device))
        rows.append((batch, *medians))
    return rows


def _renamed(handoff, request_id):
    import dataclasses
    return dataclasses.replace(handoff, request_id=request_id)


def _timed(fn, steps, device) -> float:
    return statistics.median(_step_times(fn, steps, device))


def _step_times(fn, steps, device) -> list[float]:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--outputs", default="16,32,64,128", help="output lengths, cycled over the 16 requests")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: ours,static,cb,forwards,steps,grammar,weights")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    prefiller = Prefiller(PrefillConfig(args.model or embedded_model_path(), n_ctx=1100, kv_type="q8_0"))
    requests = workload(prefiller, [int(n) for n in args.outputs.split(",")])
    useful = sum(n for _, n in requests)
    ident = prefiller.identity
    per_token = bytes_per_token(ident.n_layer, ident.num_kv_heads, ident.head_dim_k, str(dtype).split(".")[-1])
    results = {}
    if "ours" not in args.skip:
        results["ours (llama.cpp prefill + paged engine)"] = run_ours(
            prefiller, load_decode_model(ident, device, dtype), device, requests)
    if "static" not in args.skip:
        results["static batch (transformers generate)"] = run_static(load_decode_model(ident, device, dtype),
                                                                     requests, per_token)
    if "cb" not in args.skip:
        results["transformers continuous batching"] = run_cb(load_decode_model(ident, device, dtype), requests)
    print(f"\n16 requests (prompts 64/256/1024 in 6:3:1, outputs {args.outputs}) on {device}, {dtype}; "
          f"useful tokens {useful}")
    print("| system | useful tok/s | latency p50 s | latency p99 s | wall s | peak KV MiB |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        kv = f"{r['kv_bytes'] / 2**20:.1f}" if r["kv_bytes"] is not None else "n/a (pool preallocated)"
        print(f"| {name} | {useful / r['wall']:.1f} | {percentile(r['latencies'], 50):.2f} | "
              f"{percentile(r['latencies'], 99):.2f} | {r['wall']:.1f} | {kv} |")
    if "forwards" not in args.skip:
        print_forward_step_times(*forward_step_times(prefiller, device, [int(b) for b in args.batches.split(",")]))
    if "steps" not in args.skip:
        print_step_times(step_times(prefiller, load_decode_model(ident, device, dtype), device,
                                    [int(b) for b in args.batches.split(",")]))
    if "grammar" not in args.skip:
        print_grammar_costs(grammar_costs(prefiller, load_decode_model(ident, device, dtype), device, [16, 32]))
    prefiller.close()
    if "weights" not in args.skip:  # on the CPU, each weight dtype in a process of its own
        from bench.weights_bench import WEIGHTS, print_weight_rows, weight_rows
        batches = [int(b) for b in args.batches.split(",")]
        print_weight_rows(weight_rows(WEIGHTS.split(","), batches, args.model), batches)


def print_step_times(rows) -> None:
    print("\nDecode step time at context 256 (median of 9); before: the step before the static step "
          "(per-step metadata, per-token gather)")
    print("| batch | ours before ms | ours ms | after / before | transformers DynamicCache ms | ours / transformers |")
    print("|---|---|---|---|---|---|")
    for batch, before, ours, plain in rows:
        print(f"| {batch} | {before:.1f} | {ours:.1f} | {ours / before:.2f}x | {plain:.1f} | {ours / plain:.2f}x |")


def print_grammar_costs(rows) -> None:
    print("\nStructured outputs: the step with every row under a JSON schema (median of 9, context ~70)")
    print("| batch | unconstrained ms | constrained ms | mask cost ms | share of the step |")
    print("|---|---|---|---|---|")
    for batch, plain, constrained in rows:
        print(f"| {batch} | {plain:.1f} | {constrained:.1f} | {constrained - plain:.1f} | "
              f"{(constrained - plain) / constrained:.0%} |")


if __name__ == "__main__":
    main()
