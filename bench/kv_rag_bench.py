"""A RAG set through `edge serve`, with and without the KV tiers, and after a restart; llama-server beside it.

    .venv/bin/python -m bench.kv_rag_bench [--docs 8] [--doc-tokens 1500] [--rounds 4] [--baseline-rounds 4]
                                           [--no-llama-server]

8 documents of about 1,500 tokens (seeded word salad on the embedded model's tokenizer), asked about in turn by 32
requests: round r asks every document its r-th question (document 0..7, then again), one request at a time, greedy,
16 answer tokens, streamed. Each prompt is a system line, the document, then the question, so a document's prefix is
shared by its questions. Systems, one after the other on the embedded model, f16 KV:
- ours, tiers: `edge serve` with its defaults (an 8192-token RAM prompt cache per worker: five documents; the engine's
  prefix blocks; the answers' KV returned) and a 4 GiB disk tier (`kv_disk_bytes`), then the same server restarted
  with the same config and folder, each document asked a new question (its first request since the restart);
- ours, no tiers: prefix_cache_tokens = 0, kv_return_bytes = 0, prefix_caching = false, no disk tier: every prompt
  computed whole (--baseline-rounds: only the first rounds, each is the same work);
- llama-server (-np 1, its RAM prompt cache `--cache-ram` 8192 MiB): then restarted with `--slot-save-path`, each
  document's slot saved after its first request restored (POST /slots/0?action=restore) before its new question; the
  restore's own time counts in that request's TTFT.
Per system: TTFT p50/p99 of round 1 (cold) and of rounds 2.. (each document seen), and the prompt tokens computed per
request (ours: prompt minus the usage's cached tokens; llama-server: timings.prompt_n).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import llama_cpp
import numpy as np

from bench.kv_return_bench import one_turn, pct
from bench.kv_tiers_bench import WORDS
from bench.systems import System
from prefill_cpu.embedded_model import embedded_model_path

QUESTIONS = ("What does it say about revenue?", "What happened to shipping costs?", "What did the engineering team "
             "deliver?", "What about staff turnover?", "Where did the warehouse open?", "Which suppliers are named?")
SYSTEM = "Answer from the document in one sentence."
MAX_TOKENS = 16


def documents(gguf: str, n_docs: int, n_tokens: int) -> list[str]:
    """Seeded word salad, each cut to about n_tokens tokens of the model's tokenizer."""
    vocab = llama_cpp.Llama(model_path=gguf, vocab_only=True, verbose=False)
    rng = np.random.default_rng(0)
    docs = []
    for i in range(n_docs):
        words = [f"Document {i}."] + list(rng.choice(WORDS, size=n_tokens * 2))
        lo, hi = 1, len(words)  # the most words within n_tokens tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(vocab.tokenize(" ".join(words[:mid]).encode(), add_bos=False)) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        docs.append(" ".join(words[:lo]) + ".")
    vocab.close()
    return docs


def messages(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]


def edge(name: str, gguf: str, extra: str) -> System:
    config = Path(tempfile.mkstemp(suffix=".toml")[1])
    config.write_text(f'log_level = "WARNING"\nkv_type = "f16"\nkv_cache_tokens = 16384\n{extra}')
    return System(name, Path(gguf).name.removesuffix(".gguf"), lambda p: [
        sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port", str(p), "--config", str(config)],
        ready_path="/health")


def llama_server(binary: str, gguf: str, slots: Path) -> System:
    return System("llama-server (-np 1, --cache-ram 8192)", Path(gguf).name.removesuffix(".gguf"), lambda p: [
        binary, "-m", gguf, "--port", str(p), "-t", "2", "-np", "1", "-c", "4096", "-ctk", "f16", "-ctv", "f16",
        "--cache-ram", "8192", "--slot-save-path", str(slots), "--log-disable"], ready_path="/health")


def rounds(system: System, docs: list[str], n_rounds: int, after_first=None) -> list[list[tuple[float, int]]]:
    """(TTFT s, prompt tokens computed) per request, per round; after_first(system, doc index) runs after each
    document's first request (not timed)."""
    rows = []
    for r in range(n_rounds):
        row = []
        for d, doc in enumerate(docs):
            ttft, computed, _ = one_turn(system, messages(doc, QUESTIONS[r % len(QUESTIONS)]), MAX_TOKENS)
            row.append((ttft, computed))
            if r == 0 and after_first is not None:
                after_first(system, d)
        rows.append(row)
        print(f"  {system.name}: round {r + 1} TTFT p50 {pct([t for t, _ in row], 0.5) * 1e3:.0f} ms, computed "
              f"{statistics.mean(c for _, c in row):.0f}", flush=True)
    return rows


def restarted(system: System, docs: list[str], restore=None) -> list[tuple[float, int]]:
    """The server started again: each document asked a question it was not asked before (its first request since)."""
    system.start()
    try:
        row = []
        for d, doc in enumerate(docs):
            started = time.perf_counter()
            if restore is not None:
                restore(system, d)
            restore_s = time.perf_counter() - started
            ttft, computed, _ = one_turn(system, messages(doc, QUESTIONS[-1]), MAX_TOKENS)
            row.append((restore_s + ttft, computed))
        return row
    finally:
        system.stop()


def _slot(action: str):
    def call(system: System, d: int) -> None:
        reply = httpx.post(f"{system.url}/slots/0?action={action}", json={"filename": f"doc{d}.bin"}, timeout=300)
        reply.raise_for_status()
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--baseline-rounds", type=int, default=4, help="ours without tiers: rounds measured")
    parser.add_argument("--no-llama-server", action="store_true")
    args = parser.parse_args()
    gguf = embedded_model_path()
    docs = documents(gguf, args.docs, args.doc_tokens)
    folder = Path(tempfile.mkdtemp(prefix="kv-rag-"))
    results: dict[str, tuple[list, list | None]] = {}
    tiers = edge("ours, tiers (RAM prompt cache at its default, disk 4 GiB)", gguf,
                 f'kv_disk_bytes = {4 << 30}\nkv_disk_dir = "{folder / "disk"}"\n')
    try:
        tiers.start()
        try:
            measured = rounds(tiers, docs, args.rounds)
        finally:
            tiers.stop()
        results[tiers.name] = (measured, restarted(tiers, docs))
        none = edge("ours, no tiers", gguf, "prefix_cache_tokens = 0\nkv_return_bytes = 0\nprefix_caching = false\n")
        none.start()
        try:
            results[none.name] = (rounds(none, docs, args.baseline_rounds), None)
        finally:
            none.stop()
        if not args.no_llama_server:
            from checks.llama_server import binary_path
            if (binary := binary_path()) is not None and Path(binary).exists():
                (folder / "slots").mkdir()
                server = llama_server(str(binary), gguf, folder / "slots")
                server.start()
                try:
                    measured = rounds(server, docs, args.rounds, after_first=_slot("save"))
                finally:
                    server.stop()
                results[server.name] = (measured, restarted(server, docs, restore=_slot("restore")))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report(results, args)


def report(results: dict, args) -> None:
    print(f"\n{args.docs} documents of about {args.doc_tokens} tokens, {args.rounds} rounds ({args.docs * args.rounds} "
          f"requests), {MAX_TOKENS} answer tokens, greedy, one request at a time")
    print("| system | round 1 (cold) TTFT p50 / p99 ms | rounds 2.. TTFT p50 / p99 ms | computed per request, round 1 "
          "/ rounds 2.. | after a restart: TTFT p50 / p99 ms, computed |")
    print("|---|---|---|---|---|")
    for name, (measured, after) in results.items():
        cold, seen = measured[0], [x for row in measured[1:] for x in row]
        line = f"| {name} | {_ms(cold)} | {_ms(seen) if seen else '-'} | {statistics.mean(c for _, c in cold):.0f} / "
        line += f"{statistics.mean(c for _, c in seen):.0f} | " if seen else "- | "
        line += f"{_ms(after)}, {statistics.mean(c for _, c in after):.0f} |" if after else "- |"
        print(line)


def _ms(rows: list[tuple[float, int]]) -> str:
    ttfts = [t * 1e3 for t, _ in rows]
    return f"{pct(ttfts, 0.5):.0f} / {pct(ttfts, 0.99):.0f}"


if __name__ == "__main__":
    main()
