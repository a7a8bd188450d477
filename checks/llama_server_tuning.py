"""llama-server's best setting for a model on this box, chosen by measuring its options (bench/sizes_bench.py).

A peer run with a setting nobody measured is no peer: on this shared 2-core box `-t 2` decoded a 1B Q4_K_M at
0.3-0.5 tok/s while `-t 1` decoded it at 1.6-1.8 tok/s in the same minutes (ggml's threads meet at a barrier after
every operation, hundreds a token; when another process holds one of the two cores, each barrier waits for the
scheduler). Which is best depends on the load beside it, so it is measured right before the run, not assumed.

The search is greedy, one option at a time, each kept only if it measures better (llama-server's own timings):
  1. weights x threads: the given GGUF and its f16 file (where one lies beside it and fits the free RAM), at 1 and
     2 threads: one stream's decode tok/s (the run's prompt length, `probe_tokens` out, ignore_eos);
  2. llama.cpp's weight repack (on, its default, or `--no-repack`), at the best of 1: the same score;
  3. parallel slots (the burst's concurrency, or a quarter of it: fewer, larger batches) and the physical batch
     (`-ub` 512, its default, or 128), continuous batching on (its default; off serves one slot at a time): a burst of
     `concurrency` of the run's chats (the same prompts, `burst_tokens` out), output tok/s.
Each probe starts llama-server afresh (its start, page cache warm, is seconds) and is bounded in tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import numpy as np
import psutil

from checks import llama_server

GIB = 2**30


@dataclass(frozen=True)
class PeerSetting:
    model: str  # the GGUF llama-server loads
    weights: str  # "given" or "f16"
    threads: int
    slots: int
    n_ctx: int  # per slot
    repack: bool = True
    ubatch: int = 512
    cont_batching: bool = True

    def argv(self, port: int) -> list[str]:
        return [str(llama_server.binary_path()), "-m", self.model, "--port", str(port), "-t", str(self.threads), "-tb",
                str(self.threads), "-np", str(self.slots), "-c", str(self.slots * self.n_ctx), "-ub", str(self.ubatch),
                "--log-disable", *([] if self.repack else ["--no-repack"]),
                *([] if self.cont_batching else ["--no-cont-batching"])]

    @property
    def label(self) -> str:
        return (f"{self.weights}, -t {self.threads}, -np {self.slots}, -ub {self.ubatch}"
                + ("" if self.repack else ", --no-repack") + ("" if self.cont_batching else ", -nocb"))


def system_for(setting: PeerSetting, model_id: str):
    from bench.systems import System
    return System(f"llama-server ({setting.label})", model_id, setting.argv, ready_path="/health")


def f16_beside(gguf: str) -> str | None:
    """The ladder's f16 file of the same rung (ladder-<size>-f16.gguf), if it lies beside `gguf` and fits the free
    RAM with room for the rest; None otherwise."""
    path = Path(gguf)
    f16 = path.with_name(path.name.replace("q4_k_m", "f16"))
    if f16 == path or not f16.exists():
        return None
    return str(f16) if f16.stat().st_size + 4 * GIB < psutil.virtual_memory().available else None


def _prompt(seed: int) -> str:
    """The run's chat text (bench.sizes_bench.PROMPT's length)."""
    from bench.sizes_bench import PROMPT
    from bench.workloads import text_of
    return "Summarize: " + text_of(PROMPT["tokens"], np.random.default_rng(seed))


def single_stream(setting: PeerSetting, model_id: str, tokens: int) -> dict:
    """One stream: a warm-up token, then `tokens` out of a fresh prompt; llama-server's own timings."""
    system = system_for(setting, model_id)
    started = time.monotonic()
    system.start(timeout_s=900)
    ready_s = time.monotonic() - started
    try:
        body = {"n_predict": 1, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
        httpx.post(system.url + "/completion", json={**body, "prompt": _prompt(7)}, timeout=900)
        answer = httpx.post(system.url + "/completion", json={**body, "prompt": _prompt(8), "n_predict": tokens},
                            timeout=900).json()["timings"]
    finally:
        system.stop()
    return {"setting": setting, "probe": "single", "ready_s": ready_s, "score": answer["predicted_per_second"],
            "prefill_tok_s": answer["prompt_per_second"], "decode_tok_s": answer["predicted_per_second"]}


def burst(setting: PeerSetting, model_id: str, concurrency: int, tokens: int) -> dict:
    """`concurrency` of the run's chats at once (`tokens` out, ignore_eos), not streamed: output
    tok/s from the usage llama-server reports (a streamed probe of a few tokens of random text may show no content)."""
    from bench.sizes_bench import chats
    system = system_for(setting, model_id)
    system.start(timeout_s=900)

    async def one(client: httpx.AsyncClient, spec) -> int:
        body = {"model": model_id, "messages": list(spec.messages), "max_tokens": spec.max_tokens,
                "temperature": 0, "ignore_eos": True}
        answer = await client.post(system.url + "/v1/chat/completions", json=body, timeout=1800)
        return answer.json()["usage"]["completion_tokens"] if answer.status_code == 200 else 0

    async def run(specs) -> tuple[list[int], float]:
        async with httpx.AsyncClient() as client:
            started = time.monotonic()
            done = await asyncio.gather(*(one(client, spec) for spec in specs))
            return done, time.monotonic() - started
    try:
        asyncio.run(run(chats(1, 2, seed=98)))
        done, wall_s = asyncio.run(run(chats(concurrency, tokens, seed=97)))
    finally:
        system.stop()
    errors = ["no answer"] * done.count(0)
    return {"setting": setting, "probe": "burst", "score": sum(done) / wall_s, "wall_s": wall_s, "errors": errors}


def choose(gguf: str, concurrency: int, n_ctx: int, probe_tokens: int = 16, burst_tokens: int = 8,
           threads: tuple[int, ...] = (1, 2), burst_options: tuple[str, ...] = ("slots", "ubatch"),
           log=print) -> tuple[PeerSetting, list[dict]]:
    """The best setting found by the greedy search (module docstring) and every probe's measurement."""
    model_id = Path(gguf).stem
    weights = [("given", gguf)] + ([("f16", f16)] if (f16 := f16_beside(gguf)) else [])
    probes: list[dict] = []

    def measured(row: dict) -> dict:
        probes.append(row)
        log(f"  probe {row['probe']:6} {row['setting'].label:48} {row['score']:7.2f} tok/s")
        return row

    candidates = [PeerSetting(path, kind, t, concurrency, n_ctx) for kind, path in weights for t in threads]
    best = max((measured(single_stream(s, model_id, probe_tokens)) for s in candidates), key=lambda r: r["score"])
    unpacked = measured(single_stream(replace(best["setting"], repack=False), model_id, probe_tokens))
    chosen = (unpacked if unpacked["score"] > best["score"] else best)["setting"]
    if not burst_options:  # nothing to compare a burst against
        return chosen, probes
    # the burst's options, each against the chosen so far
    top = measured(burst(chosen, model_id, concurrency, burst_tokens))
    changes = {"slots": {"slots": max(1, concurrency // 4)}, "ubatch": {"ubatch": 128}}
    for change in (changes[name] for name in burst_options):
        row = measured(burst(replace(top["setting"], **change), model_id, concurrency, burst_tokens))
        top = row if row["score"] > top["score"] and not row["errors"] else top
    return top["setting"], probes
