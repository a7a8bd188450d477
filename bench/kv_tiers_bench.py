"""The prompt cache's disk tier on a RAG-like load: long documents asked about again after the worker restarted.

    .venv/bin/python -m bench.kv_tiers_bench [--docs 4] [--doc-tokens 1500] [--kv-type f16]

One llama.cpp worker (the embedded model, n_ctx 4096, n_batch 256, the default 2048-token RAM prompt cache). Each
document (seeded word salad, cut to --doc-tokens tokens) is asked about once, cold; then the worker restarts (a new
Prefiller over the same disk folder: the RAM cache is gone), and each document is asked the same question again,
then a new question (--baseline: the same after a restart without the disk tier, which computes every token
again, as cold does). Per row: prefill time (the
worker's share of the time to first token: cached prefix restored, the rest computed, first token drawn) and prompt
tokens computed, summed over the documents; and the disk tier's bytes per entry.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile

import numpy as np

from contracts.handoff import SamplingParams
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

WORDS = ("the", "report", "shows", "that", "revenue", "in", "each", "region", "grew", "while", "costs", "of",
         "shipping", "fell", "after", "new", "contracts", "were", "signed", "with", "suppliers", "and", "a",
         "warehouse", "opened", "near", "port", "during", "second", "quarter", "however", "staff", "turnover",
         "remained", "high", "engineering", "team", "delivered", "three", "releases", "on", "time")


def documents(prefiller: Prefiller, n_docs: int, n_tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    docs = []
    for i in range(n_docs):
        text = f"Document {i}. " + " ".join(rng.choice(WORDS, size=n_tokens * 2)) + "."
        docs.append(prefiller.tokenize("<|im_start|>user\n" + text)[:n_tokens])
    return docs


def question(prefiller: Prefiller, which: str) -> list[int]:
    return prefiller.tokenize(f"\nQuestion: what does the document say about {which}?<|im_end|>\n"
                              "<|im_start|>assistant\n", add_special=False)


def ask(prefiller: Prefiller, prompts: list[list[int]]) -> tuple[float, int]:
    """(prefill seconds, prompt tokens computed), summed over the prompts."""
    seconds, computed = 0.0, 0
    for i, tokens in enumerate(prompts):
        outcome = prefiller.prefill(PrefillRequest(f"q{i}", tuple(tokens), SamplingParams(max_tokens=1)))
        seconds += outcome.prefill_s
        computed += len(tokens) - outcome.cached_tokens
    return seconds, computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--baseline", action="store_true", help="also restart without the disk tier")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = tempfile.mkdtemp(prefix="kv-tiers-")
    with_disk = PrefillConfig(embedded_model_path(), n_ctx=4096, n_batch=256, kv_type=args.kv_type,
                              prefix_cache_tokens=2048, kv_disk_bytes=4 << 30, kv_disk_dir=folder)
    without = PrefillConfig(**{**with_disk.__dict__, "kv_disk_bytes": 0})
    rows = []
    worker = Prefiller(with_disk)
    docs = documents(worker, args.docs, args.doc_tokens)
    first = [d + question(worker, "revenue") for d in docs]
    second = [d + question(worker, "shipping costs") for d in docs]
    rows.append(_shown(("cold: first question", *ask(worker, first))))
    worker.disk.flush()
    written = worker.disk.stats()
    worker.close()
    runs = (("restart, disk tier", with_disk), ("restart, no disk tier", without))
    for label, config in runs[:2 if args.baseline else 1]:
        worker = Prefiller(config)  # the worker restarted: nothing in its RAM cache
        rows.append(_shown((f"{label}: same question", *ask(worker, first))))
        rows.append(_shown((f"{label}: new question", *ask(worker, second))))
        worker.close()
    total = sum(len(p) for p in first)
    print(f"\n{args.docs} documents of {args.doc_tokens} tokens, {total} prompt tokens a round, KV {args.kv_type}, "
          f"{with_disk.n_batch}-token chunks; disk entries {written.bytes / max(written.entries, 1) / 2**20:.1f} "
          f"MiB each ({written.entries} written, {written.dropped_writes} dropped)")
    print(f"{'round':<40}{'prefill s':>10}{'s/doc':>8}{'computed':>10}")
    for label, seconds, computed in rows:
        print(f"{label:<40}{seconds:>10.2f}{seconds / args.docs:>8.3f}{computed:>10}")
    cold, warm = rows[0][1], statistics.mean(r[1] for r in rows[1:3])
    print(f"disk tier after a restart: {cold / warm:.1f}x faster than cold (mean of its two rounds)")
    shutil.rmtree(folder, ignore_errors=True)


def _shown(row: tuple) -> tuple:
    print(f"  measured {row[0]}: {row[1]:.2f} s, {row[2]} tokens computed", flush=True)
    return row


if __name__ == "__main__":
    main()
