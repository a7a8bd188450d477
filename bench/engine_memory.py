"""Where the decode engine's memory goes on the embedded model, by component.

    .venv/bin/python -m bench.engine_memory [--chats 16] [--max-tokens 64] [--config 'weight_dtype = "int8"']
                                            [--skip in-process,served]

Two parts, each a table of component and MB:
- in-process: this process imports torch, then transformers and the engine's code, then builds the engine exactly
  as the engine process does (decode_gpu.service.server.build_engine, the default settings plus --config's), and
  reports the engine's own account of its memory (decode_gpu.service.memory): the libraries (the RSS before the
  model), the weights by the precision held, the KV pool, the rotary tables and step inputs, and what is left;
- served: `edge serve` on the embedded model with the same settings, a warm-up of --chats concurrent chats, then
  the engine process's RSS (psutil, from outside) beside the components it reports in /health.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

MB = 1e6
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List five uses for a paperclip.", "Describe the water cycle to a child.",
           "What makes a good cup of tea?", "Summarize the plot of a heist film you invent.",
           "Give three tips for learning a language.", "Why is the sky blue?"]


def rss() -> float:
    return psutil.Process().memory_info().rss / MB


def in_process(settings: dict) -> list[tuple[str, float]]:
    rows = [("interpreter (RSS)", rss())]
    import torch  # noqa: F401
    rows.append(("+ torch (RSS)", rss()))
    import transformers  # noqa: F401
    rows.append(("+ transformers (RSS)", rss()))
    from contracts.process_config import EngineProcessConfig
    from decode_gpu.service.memory import MemoryAccount, rss_bytes
    from decode_gpu.service.server import build_engine
    from prefill_cpu.embedded_model import embedded_model_path
    libraries = rss_bytes()
    rows.append(("+ the engine's code (RSS)", libraries / MB))
    started = time.perf_counter()
    engine = build_engine(EngineProcessConfig(model=embedded_model_path(), listen="unix:/tmp/unused.sock",
                                              **settings))
    built_s = time.perf_counter() - started
    rows += account_rows(MemoryAccount(engine, libraries).memory().__dict__)
    rows.append(("(build seconds)", built_s))
    return rows


def account_rows(memory: dict) -> list[tuple[str, float]]:
    """The engine's account (EngineMemory as a dict) as table rows."""
    rows = [("libraries: Python, torch, transformers, our code", memory["libraries"] / MB)]
    rows += [(f"weights {precision}", n / MB) for precision, n in sorted(memory["weights"].items())]
    rows += [(f"KV pool (on {memory['device']})", memory["kv_pool"] / MB),
             ("... of it resident (its blocks used so far)", memory["kv_pool_resident"] / MB),
             ("swap space of preempted sequences", memory["swap"] / MB),
             ("rotary tables and step inputs", memory["buffers"] / MB),
             ("other: tokenizer, grammar tables, activations, allocator", memory["other"] / MB),
             ("RSS (the engine's own reading)", memory["rss"] / MB)]
    return rows


def served(settings_toml: str, chats: int, max_tokens: int) -> list[tuple[str, float]]:
    import httpx

    from bench.systems import System
    from prefill_cpu.embedded_model import embedded_model_path
    config = Path(tempfile.mkstemp(suffix=".toml")[1])
    config.write_text(f'log_level = "WARNING"\n{settings_toml}\n')
    system = System("edge serve", "", lambda p: [sys.executable, "-m", "edge.cli", "serve", "--model",
                                                   embedded_model_path(), "--port", str(p), "--config", str(config)],
                    ready_path="/health")
    system.start()
    try:
        health = httpx.get(system.url + "/health", timeout=5).json()
        engine, model = _engine_process(health), health["model"]
        before = engine.memory_info().rss / MB

        def chat(i: int) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" ({i})"}],
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
            response = httpx.post(system.url + "/v1/chat/completions", json=body, timeout=600)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(chats) as pool:
            tokens = sum(pool.map(chat, range(chats)))
        warm_s = time.perf_counter() - started
        memory = _reported(system.url, started)
        rows = [("engine RSS before the warm-up (psutil)", before)]
        rows += account_rows(memory)
        rows += [(f"engine RSS after {chats} concurrent chats (psutil)", engine.memory_info().rss / MB),
                 ("(warm-up tokens)", tokens), ("(warm-up seconds)", warm_s)]
        return rows
    finally:
        system.stop()


def _engine_process(health: dict) -> psutil.Process:
    for process in health["processes"].values():
        if process["pid"] and "decode_gpu.service.server" in " ".join(psutil.Process(process["pid"]).cmdline()):
            return psutil.Process(process["pid"])
    raise RuntimeError(f"no decode engine among {health['processes']}")


def _reported(url: str, since: float, timeout_s: float = 10.0) -> dict:
    """The engine's memory from /health, once a report made after the warm-up has arrived (stats every 0.5 s)."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while True:
        engine = httpx.get(url + "/health", timeout=5).json().get("engine") or {}
        if engine.get("memory") and (time.perf_counter() - since > 1.0 or time.monotonic() > deadline):
            return engine["memory"]
        if time.monotonic() > deadline:
            raise RuntimeError("the engine reported no memory in /health")
        time.sleep(0.5)


def print_table(title: str, rows: list[tuple[str, float]]) -> None:
    print(f"\n{title}\n\n| component | MB |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |" if not name.startswith("(") else f"| {name} | {value:g} |")


def parse_settings(toml_text: str) -> dict:
    import tomllib
    return tomllib.loads(toml_text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--config", default="", help="serve settings (TOML lines) over the defaults")
    parser.add_argument("--skip", default="", help="in-process and/or served")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"engine memory on the embedded model, settings: {args.config or 'the defaults'}; "
          f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB")
    if "in-process" not in skip:
        print_table("in-process (build_engine, before any request)", in_process(parse_settings(args.config)))
    if "served" not in skip:
        print_table(f"served (edge serve, after {args.chats} concurrent chats of up to {args.max_tokens} tokens)",
                    served(args.config, args.chats, args.max_tokens))


if __name__ == "__main__":
    main()
