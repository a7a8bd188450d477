"""llama.cpp prefill speed and fidelity by weight file: the GGUF as given against the copies `prefill_weights` can make.

    .venv/bin/python -m bench.prefill_weights_bench [--model PATH.gguf] [--lengths 64,256,1024] [--threads 2]

Each file prefills prompts of each length (prefill_weights.measure_prefill, as `auto` measures: best of 3, the
files taking turns, f16 KV with flash attention, n_batch 128 unless --n-batch says otherwise). Fidelity: the last
prompt position's logits on a few real prompts against a float32 copy (llama.cpp computing with unquantized
activations and weights): KL(f32 || file) and whether the argmax agrees. Copies are made with llama.cpp's quantizer
into a temporary folder.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefill_weights import measure_prefill, quantize_gguf

PROMPTS = ["The history of the printing press begins in",
           "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Paris is the capital of France. Berlin is the capital of",
           "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nExplain recursion in one "
           "sentence.<|im_end|>\n<|im_start|>assistant\n"]


def convert(source: str, kind: str, folder: Path) -> str:
    target = folder / f"{kind}.gguf"
    quantize_gguf(source, target, kind)
    return str(target)


def load(path: str, threads: int, n_ctx: int) -> llama_cpp.Llama:
    return llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=128, n_ubatch=128, n_threads=threads, n_threads_batch=threads,
                           flash_attn=True, verbose=False)


def speeds(paths: dict[str, str], lengths: list[int], threads: int, n_batch: int) -> dict[str, list[float]]:
    """tok/s of each file at each length (prefill_weights.measure_prefill: best of 3, the files taking turns)."""
    by_length = [measure_prefill(list(paths.values()), threads, n_batch, n_tokens=n) for n in lengths]
    return {name: [row[i] for row in by_length] for i, name in enumerate(paths)}


def last_logits(path: str, threads: int) -> list[np.ndarray]:
    model = load(path, threads, 512)
    rows = []
    for text in PROMPTS:
        model.reset()
        model.eval(model.tokenize(text.encode(), add_bos=True, special=True))
        n_vocab = llama_cpp.llama_vocab_n_tokens(model._model.vocab)
        logits = llama_cpp.llama_get_logits_ith(model._ctx.ctx, -1)  # the last prompt position's
        rows.append(np.ctypeslib.as_array(logits, shape=(n_vocab,)).astype(np.float64))
    model.close()
    return rows


def kl(reference: np.ndarray, other: np.ndarray) -> float:
    p, q = (np.exp(x - x.max()) for x in (reference, other))
    p, q = p / p.sum(), q / q.sum()
    return float((p * (np.log(p + 1e-30) - np.log(q + 1e-30))).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--lengths", default="64,256,1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default="f16,bf16,q8_0")
    parser.add_argument("--n-batch", type=int, default=128, help="prompt tokens per llama.cpp call (speed only)")
    args = parser.parse_args()
    source = args.model or embedded_model_path()
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        paths = {"given": source} | {kind: convert(source, kind, Path(folder)) for kind in args.kinds.split(",")}
        tok_s = speeds(paths, lengths, args.threads, args.n_batch)
        reference = last_logits(convert(source, "f32", Path(folder)), args.threads)
        print(f"\n{Path(source).name}, {args.threads} threads, n_batch {args.n_batch}, KV f16, flash attention\n")
        print("| weights | " + " | ".join(f"prefill tok/s at {n}" for n in lengths)
              + " | KL vs f32, mean / max | argmax = f32's |")
        print("|---|" + "---|" * (len(lengths) + 2))
        for name, path in paths.items():
            logits = last_logits(path, args.threads)
            kls = [kl(r, x) for r, x in zip(reference, logits)]
            agree = sum(int(np.argmax(r) == np.argmax(x)) for r, x in zip(reference, logits))
            print(f"| {name} | " + " | ".join(f"{v:.0f}" for v in tok_s[name])
                  + f" | {np.mean(kls):.5f} / {max(kls):.5f} | {agree}/{len(PROMPTS)} |")


if __name__ == "__main__":
    main()
