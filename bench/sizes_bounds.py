"""What bounds ours against llama-server at a size (docs/sizes.md): the decode step's matrix products alone, as the
engine runs them on the GGUF's own blocks (weight_dtype gguf: one ggml mul_mat graph per layer, called from Python),
against llama.cpp's whole graph for the same rows (every layer, attention, norms, head: one graph), same file, same
threads, in one process, one after the other.

    .venv/bin/python -m bench.sizes_bounds --model /work/ladder/ladder-1b-q4_k_m.gguf [--rows 1,16] [--threads 1,2]

For `rows` tokens at once (one step of `rows` sequences; llama.cpp: `rows` positions of one sequence in one batch,
the same matrix products, attention over a short context): ours' products are every GGUFLinear of the model (the
head included) timed on random activations, best of `--repeat`; llama.cpp's is `llama_decode` of the batch, best
of `--repeat`, after a warm-up. If ours' products alone take about llama.cpp's whole step, the kernels are the
bound (the same ggml kernels on the same blocks) and the rest of ours' step (attention, norms, sampling, Python)
is what ours adds; if far less, the per-layer calls are not the bound.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch


def ours_products_ms(path: str, rows: int, threads: int, repeat: int, repack: bool = False) -> tuple[float, int]:
    """ours' products on the mapped blocks, or (repack) on the engine's repacked copy (weight_repack)."""
    from contracts.identity import read_gguf_identity
    from decode_gpu.model.gguf_layers import GGUFLinear
    from decode_gpu.model.gguf_weights import load_gguf_model
    model = _MODELS.get((path, repack)) or _MODELS.setdefault(
        (path, repack), load_gguf_model(read_gguf_identity(path), torch.bfloat16, repack=repack))
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    torch.set_num_threads(threads)
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in layers}
    best = float("inf")
    for _ in range(repeat + 1):  # the first builds each layer's graph for this row count
        started = time.perf_counter()
        for layer in layers:
            layer.product(inputs[layer.in_features])
        best = min(best, time.perf_counter() - started)
    return best * 1e3, len(layers)


_MODELS: dict = {}


def llama_cpp_step_ms(path: str, rows: int, threads: int, repeat: int, repack: bool) -> float:
    import llama_cpp

    from prefill_cpu.prefiller import _model_params
    with _model_params(use_extra_bufts=repack):
        llm = llama_cpp.Llama(path, n_ctx=512, n_batch=max(rows, 8), n_ubatch=max(rows, 8), n_threads=threads,
                              n_threads_batch=threads, flash_attn=True, verbose=False)
    try:
        prompt = [int(t) for t in np.random.default_rng(0).integers(1000, 5000, 64)]
        best = float("inf")
        for _ in range(repeat + 1):
            llm.reset()
            llm.eval(prompt)  # a short context, as the burst's
            started = time.perf_counter()
            llm.eval(prompt[:rows])
            best = min(best, time.perf_counter() - started)
    finally:
        llm.close()
    return best * 1e3


def print_table(model: str, rows: list[int], threads: list[int], repeat: int) -> None:
    """The bounds table: per (rows, threads), ours' products (mapped / repacked) against llama.cpp's whole step
    (repack on / off), printed as each row is measured."""
    print("| rows | threads | ours: matrix products alone ms (mapped / repacked) | llama.cpp whole step ms (repack "
          "on / off) |")
    print("|---:|---:|---:|---:|")
    for n_rows in rows:
        for n_threads in threads:
            ours, n = ours_products_ms(model, n_rows, n_threads, repeat)
            repacked, _ = ours_products_ms(model, n_rows, n_threads, repeat, repack=True)
            on, off = (llama_cpp_step_ms(model, n_rows, n_threads, repeat, repack) for repack in (True, False))
            print(f"| {n_rows} | {n_threads} | {ours:.1f} / {repacked:.1f} ({n} products) | {on:.1f} / {off:.1f} |",
                  flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print_table(args.model, [int(r) for r in args.rows.split(",")], [int(t) for t in args.threads.split(",")],
                args.repeat)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
