"""Open-loop load generator for any OpenAI-compatible /v1/chat/completions endpoint.

Arrivals are scheduled in advance from a seeded Poisson or gamma process, so slow responses never
slow the arrivals. Each request streams; we record time to first token (TTFT), every inter-token
gap (ITL), time per output token after the first (TPOT), end-to-end latency, and the HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    messages: tuple[dict, ...]
    max_tokens: int
    priority: int = 0
    label: str = "default"  # workload class, e.g. "interactive" or "background"
    ignore_eos: bool = False  # generate max_tokens whatever the model says (vLLM's and llama-server's field)


@dataclass
class RequestResult:
    label: str
    status: int = 0  # HTTP status; 0 when the connection itself failed
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def arrival_times(n: int, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """Start offsets (s) of n requests at `rate` per second: gamma inter-arrivals with shape
    `burstiness` (1.0 is Poisson; below 1 is burstier), from a seeded generator."""
    if rate <= 0 or np.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps) - gaps[0]


async def send(session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec,
               extra: dict | None = None, on_token=None) -> RequestResult:
    """One streamed request; on_token(), if given, is called at every content chunk as it arrives."""
    result = RequestResult(spec.label)
    body = {"model": model, "messages": list(spec.messages), "max_tokens": spec.max_tokens, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}, **(extra or {})}
    if spec.priority:
        body["priority"] = spec.priority  # servers that do not know it ignore it
    if spec.ignore_eos:
        body["ignore_eos"] = True
    started = time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            result.status = response.status
            if response.status != 200:
                result.error = (await response.text())[:200]
                return result
            async for raw in response.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    continue
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", result.output_tokens)
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            result.ttft_s = now - started
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        result.output_tokens = max(result.output_tokens, len(result.itl_s) + 1)
                        if on_token is not None:
                            on_token()
    except (TimeoutError, aiohttp.ClientError) as err:
        result.error = f"{type(err).__name__}: {err}"
    result.e2e_s = time.perf_counter() - started
    return result


async def run_open_loop(url: str, model: str, specs: list[RequestSpec], offsets: np.ndarray,
                        timeout_s: float = 600.0, extra: dict | None = None,
                        on_token=None) -> tuple[list[RequestResult], float]:
    """Fire specs[i] at offsets[i] seconds after start; returns results and the wall time."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()

        async def fire(spec: RequestSpec, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            return await send(session, url, model, spec, extra, on_token)

        results = await asyncio.gather(*(fire(s, float(o)) for s, o in zip(specs, offsets)))
        return list(results), time.perf_counter() - started


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[int, float]:
    if not values:
        return {q: float("nan") for q in qs}
    return {q: float(np.percentile(values, q)) for q in qs}


def summarize(results: list[RequestResult], wall_s: float, slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    messages: dict[str, int] = {}  # what went wrong, to tell a server's fault from the client's
    for r in results:
        if not r.ok:
            key = str(r.status) if r.status != 200 else "stream error"
            errors[key] = errors.get(key, 0) + 1
            message = (r.error or "no first token")[:160]
            messages[message] = messages.get(message, 0) + 1

    def meets(r: RequestResult) -> bool:
        return ((slo.get("ttft_s") is None or r.ttft_s <= slo["ttft_s"]) and
                (slo.get("tpot_s") is None or (r.tpot_s or 0) <= slo["tpot_s"]) and
                (slo.get("e2e_s") is None or r.e2e_s <= slo["e2e_s"]))
    return {
        "requests": len(results), "completed": len(ok), "errors": errors, "error_messages": messages,
        "request_throughput": len(ok) / wall_s, "output_throughput": sum(r.output_tokens for r in ok) / wall_s,
        "goodput": sum(1 for r in ok if meets(r)) / wall_s,
        "ttft": percentiles([r.ttft_s for r in ok]), "tpot": percentiles([r.tpot_s for r in ok if r.tpot_s]),
        "itl": percentiles([g for r in ok for g in r.itl_s]), "e2e": percentiles([r.e2e_s for r in ok]),
        "wall_s": wall_s,
    }
