"""Multi-turn chats: what the answer's KV coming back to the prefill worker saves (issue 46).

    .venv/bin/python -m bench.kv_return_bench [--conversations 8] [--turns 6] [--max-tokens 32] [--no-llama-server]

8 conversations of 6 turns, growing: each turn resends the whole conversation (its system prompt, every earlier
question and answer) plus a new question. The turns go round-robin (turn 1 of every conversation, then turn 2, ...),
one request at a time, greedy, streamed. Systems, one after the other on the embedded model: `edge serve` as
configured by default (the engine returns each answer's KV to the worker: kv_return_bytes 64 MiB), the same with
kv_return_bytes = 0 (the worker's RAM prompt cache holds each prompt, not its answer), the same with no tier at all
(prefix_cache_tokens = 0, kv_return_bytes = 0, prefix_caching = false: every turn prefills the whole conversation),
and llama-server (-np 8 slots, its prompt cache on) when checks.llama_server finds a binary.
Per system: TTFT p50/p99 of turn 1 and of turns 2..6, the prompt tokens computed per turn (ours: prompt minus
cached tokens in the usage; llama-server: timings.prompt_n), and for ours where turns 2..6's TTFT went, from the
gateway's /metrics (means): the prefill queue, the worker (lookup, llama.cpp over the new tokens, first token, the
KV's export and the handoff sent) and the engine (the handoff's import and the first token back). The prompt
lengths per turn (mean) say how long the conversations were.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.systems import System
from prefill_cpu.embedded_model import embedded_model_path

QUESTIONS = ("What does a load balancer do?", "Why would it fail?", "How do I notice that?", "What should I log?",
             "Which metric matters most?", "Summarize that in one line.", "Give an example.", "Anything else?")


def edge(name: str, gguf: str, extra: str) -> System:
    config = Path(tempfile.mkstemp(suffix=".toml")[1])
    config.write_text(f'log_level = "WARNING"\nkv_type = "f16"\nkv_cache_tokens = 16384\n{extra}')
    return System(name, Path(gguf).name.removesuffix(".gguf"), lambda p: [
        sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port", str(p), "--config", str(config)],
        ready_path="/health")


def llama_server(binary: str, gguf: str) -> System:
    return System("llama-server (-np 8, prompt cache)", Path(gguf).name.removesuffix(".gguf"), lambda p: [
        binary, "-m", gguf, "--port", str(p), "-t", "2", "-np", "8", "-c", "16384", "-ctk", "f16", "-ctv", "f16",
        "--log-disable"], ready_path="/health")


def one_turn(system: System, messages: list[dict], max_tokens: int) -> tuple[float, int, str]:
    """(TTFT s, prompt tokens computed, answer text) of one streamed greedy request."""
    body = {"model": system.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, ttft, text, computed = time.perf_counter(), None, [], None
    with httpx.stream("POST", system.url + "/v1/chat/completions", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = choice.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - started
                text.append(piece)
            if "timings" in chunk:  # llama-server: the prompt tokens it computed
                computed = chunk["timings"]["prompt_n"]
            elif chunk.get("usage") and computed is None:
                usage = chunk["usage"]
                computed = usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft or time.perf_counter() - started, computed or 0, "".join(text)


PHASES = {"queue": "vllm:request_queue_time_seconds", "worker": "vllm:request_prefill_time_seconds",
          "ttft": "vllm:time_to_first_token_seconds", "prompt": "vllm:prompt_tokens"}


def phases(system: System) -> dict[str, float] | None:
    """Sums (and counts) of the gateway's histograms and counters (ours only: None for llama-server)."""
    if not system.name.startswith("ours"):
        return None
    text = httpx.get(system.url + "/metrics", timeout=30).text
    out = {}
    for key, name in PHASES.items():
        for part in ("sum", "count", "total"):
            found = re.findall(rf"^{re.escape(name)}_{part}{{[^}}]*}} (\S+)", text, re.M)
            out[f"{key}_{part}"] = sum(float(v) for v in found)
    return out


def run(system: System, conversations: int, turns: int, max_tokens: int) -> tuple[dict, dict | None]:
    """(turn -> [(TTFT s, tokens computed, prompt tokens)], turns 2..'s mean phases in ms or None)."""
    chats = [[{"role": "system", "content": f"You are assistant number {i} of a support team. Answer briefly."}]
             for i in range(conversations)]
    rows = {t: [] for t in range(turns)}
    system.start()
    before = None
    try:
        for t in range(turns):
            if t == 1:
                before = phases(system)
            for i, chat in enumerate(chats):
                chat.append({"role": "user", "content": QUESTIONS[(i + t) % len(QUESTIONS)]})
                ttft, computed, answer = one_turn(system, chat, max_tokens)
                chat.append({"role": "assistant", "content": answer})
                rows[t].append((ttft, computed))
        after = phases(system)
    finally:
        system.stop()
    return rows, _split(before, after)


def _split(before: dict | None, after: dict | None) -> dict | None:
    """Mean ms per request of turns 2.. in the queue, the worker and the engine; mean prompt tokens."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in after}
    n = max(d["ttft_count"], 1)
    queue, worker, ttft = (d[f"{k}_sum"] / n * 1e3 for k in ("queue", "worker", "ttft"))
    return {"queue": queue, "worker": worker, "engine": ttft - queue - worker, "prompt": d["prompt_total"] / n}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--prefix-cache-tokens", type=int, default=None, help="ours: the worker's RAM prompt cache")
    parser.add_argument("--model", help="a GGUF other than the embedded model, whose answers re-tokenize as they were "
                                        "generated (the size ladder's random weights answer with tokens that do not: "
                                        "every later turn then misses, measured)")
    args = parser.parse_args()
    gguf = args.model or embedded_model_path()
    cache = f"prefix_cache_tokens = {args.prefix_cache_tokens}\n" if args.prefix_cache_tokens is not None else ""
    systems = [edge("ours (answer KV returned)", gguf, cache),
               edge("ours (kv_return_bytes = 0)", gguf, cache + "kv_return_bytes = 0\n"),
               edge("ours (no tiers)", gguf, "prefix_cache_tokens = 0\nkv_return_bytes = 0\nprefix_caching = false\n")]
    if not args.no_llama_server:
        from checks.llama_server import binary_path
        if (binary := binary_path()) is not None and Path(binary).exists():
            systems.append(llama_server(str(binary), gguf))
    results = {s.name: run(s, args.conversations, args.turns, args.max_tokens) for s in systems}
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.max_tokens} answer tokens, greedy, "
          "one request at a time")
    print(f"| system | turn 1 TTFT p50 / p99 ms | turns 2-{args.turns} TTFT p50 / p99 ms | prompt tokens computed "
          f"per turn (mean, turns 1..{args.turns}) |")
    print("|---|---|---|---|")
    for name, (rows, _) in results.items():
        first = [r[0] * 1e3 for r in rows[0]]
        later = [r[0] * 1e3 for t in range(1, args.turns) for r in rows[t]]
        computed = " / ".join(f"{statistics.mean(r[1] for r in rows[t]):.0f}" for t in range(args.turns))
        print(f"| {name} | {pct(first, 0.5):.0f} / {pct(first, 0.99):.0f} | {pct(later, 0.5):.0f} / "
              f"{pct(later, 0.99):.0f} | {computed} |")
    print(f"\nturns 2-{args.turns}, mean per request (the gateway's /metrics)")
    print("| system | prompt tokens | prefill queue ms | worker ms | engine ms |")
    print("|---|---|---|---|---|")
    for name, (_, split) in results.items():
        if split is not None:
            print(f"| {name} | {split['prompt']:.0f} | {split['queue']:.1f} | {split['worker']:.1f} | "
                  f"{split['engine']:.1f} |")


if __name__ == "__main__":
    main()
