"""edge on a local Ray cluster (ray.cluster_utils.Cluster: every "node" on this machine, so nothing crosses a
network and the numbers compare the paths' own costs). Three runs:

    python -m bench.cluster_bench [--tokens 512] [--repeats 30]      # the KV handoff between two nodes
    python -m bench.cluster_bench --serving [--requests 16] ...      # edge serve --ray against single-box mode
    python -m bench.cluster_bench --affinity                         # the engine choice's prefix-affinity margin

The handoff: the direct worker->engine TCP stream (what edge serve --ray uses) against Ray's object store (ray.put
on the worker's node, the engine's actor reading it), for a 512-token q8_0 handoff of the embedded model (30
layers, 3 KV heads, head size 64: 6.3 MB).
Serving: throughput and TTFT with 1 and 2 prefill workers, on separate Ray nodes or on one
box, and the Ray path's cost as a ratio at each worker count.
Affinity: EngineGroup's choice on a simulated stream of prompts under a few
shared system prompts, for several margins: how often a prompt finds its prefix's engine, and the load imbalance.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import time

import ray
from ray.cluster_utils import Cluster

from contracts.framing import pack, unpack
from contracts.messages import Handoff

STORE = 256 << 20


def handoff_bytes(tokens: int, n_layer: int = 30, num_kv_heads: int = 3, head_dim: int = 64) -> int:
    """K and V of every layer in q8_0: 34 bytes per 32 values."""
    return n_layer * 2 * num_kv_heads * head_dim * tokens * 34 // 32


class Engine:
    """Stands in for the decode engine: a TCP listener that decodes each frame and answers 1 byte, and an actor
    method that takes the handoff from the object store."""

    def __init__(self) -> None:
        self.server = socket.create_server(("0.0.0.0", 0))
        self.port = self.server.getsockname()[1]

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), self.port

    def serve_tcp(self, count: int) -> None:
        connection, _ = self.server.accept()
        with connection:
            for _ in range(count):
                size = struct.unpack(">I", _read(connection, 4))[0]
                message = unpack(_read(connection, size))
                assert isinstance(message, Handoff)
                connection.sendall(b"k")

    def take(self, data: bytes) -> int:  # Ray resolves the ObjectRef argument: the bytes come from the store
        return len(data)


class Worker:
    """Stands in for the prefill worker: sends the same handoff both ways and times each until the engine has it."""

    def __init__(self, size: int) -> None:
        self.data = bytes(range(256)) * (size // 256)

    def over_tcp(self, address: tuple[str, int], count: int) -> list[float]:
        times = []
        with socket.create_connection(address) as connection:
            for i in range(count):
                started = time.perf_counter()
                connection.sendall(pack(Handoff(f"r{i}", self.data)))
                assert _read(connection, 1) == b"k"
                times.append(time.perf_counter() - started)
        return times

    def through_object_store(self, engine, count: int) -> list[float]:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            ray.get(engine.take.remote(ray.put(self.data)))
            times.append(time.perf_counter() - started)
        return times


def _read(connection: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# --- serving: edge serve --ray against single-box mode -------------------------------------------------------------
SERVE_CONFIG = """
log_level = "WARNING"
kv_type = "q8_0"
kv_cache_tokens = 4096
max_model_len = 1024
max_num_seqs = 8
device = "cpu"
threads_per_worker = 1
prefill_workers = {workers}
[limits]
prefill_queue_size = 64
"""
# every "node" is this machine: the links stay on it, so plain TCP (as measured before control TLS existed)
RAY_CONFIG = ('ray = "{address}"\ndecode_engines = 1\nray_decode_resource = "edge_decode"\nray_prefill_cpus = 1\n'
              'allow_plaintext_control = true\n')
NO_TIERS = 'version = 1\ndefault_class = "standard"\n[classes.standard]\npriority = 0\n'  # no KV downgrade mid-run


def serving_table(args) -> str:
    """Single-box runs first, with no cluster running; then the cluster (head, two 1-CPU prefill nodes, a decode
    node), where each prefill worker gets a node of its own. One OpenMP thread everywhere: Ray gives an actor that
    asks for no CPU (the decode engine) OMP_NUM_THREADS=1, so single-box mode's engine gets the same."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {("single box", n): _serve_run(args, n) for n in (1, 2)}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": STORE})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=STORE)
        cluster.add_node(num_cpus=0, resources={"edge_decode": 1}, object_store_memory=STORE)
        results.update({("Ray", n): _serve_run(args, n, cluster.address) for n in (1, 2)})
    finally:
        cluster.shutdown()
    return _serving_rows(args, results)


def _serve_run(args, workers: int, ray_address: str = "") -> dict:
    import asyncio
    import tempfile
    from pathlib import Path

    import numpy as np

    from bench.loadgen import RequestSpec, summarize
    from bench.systems import System
    from bench.workloads import text_of
    work = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    (work / "policy.toml").write_text(NO_TIERS)
    config = f'policy = "{work / "policy.toml"}"\n' + SERVE_CONFIG.format(workers=workers)
    (work / "serve.toml").write_text((RAY_CONFIG.format(address=ray_address) if ray_address else "") + config)
    system = System("edge", "SmolLM2-135M-Instruct.Q4_1", lambda port: [
        sys.executable, "-m", "edge.cli", "serve", "--config", str(work / "serve.toml"), "--port", str(port)],
        ready_path="/health")
    rng = np.random.default_rng(7)  # the same prompts for every run
    specs = [RequestSpec(({"role": "user", "content": "Summarize: " + text_of(args.prompt_tokens, rng)},),
                         args.max_tokens) for _ in range(args.requests + 2)]
    system.start()
    try:
        _wait_all_ready(system.url, workers)
        asyncio.run(_closed_loop(system, specs[:2], 1))  # warm-up
        results, wall = asyncio.run(_closed_loop(system, specs[2:], args.concurrency))
    finally:
        system.stop()
    print(f"  {'Ray' if ray_address else 'single box'}, {workers} worker(s): {wall:.1f} s; log {system.log}",
          flush=True)
    return summarize(results, wall, {})


def _wait_all_ready(url: str, workers: int, timeout_s: float = 300) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        components = httpx.get(url + "/health", timeout=5).json()["components"]
        if len(components) == workers + 1 and set(components.values()) == {"ready"}:
            return
        time.sleep(0.5)
    raise RuntimeError(f"not every component of {url} was ready in {timeout_s} s")


async def _closed_loop(system, specs, concurrency: int):
    """`concurrency` clients, each sending its next request when the last one ended; greedy, ignore_eos: every
    run produces the same tokens."""
    import asyncio

    import aiohttp

    from bench.loadgen import send
    pending = list(specs)
    results = []

    async def client(session):
        while pending:
            results.append(await send(session, system.url, system.model, pending.pop(0), {"ignore_eos": True}))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return results, time.perf_counter() - started


def _serving_rows(args, results: dict) -> str:
    lines = [f"{args.requests} chat requests of ~{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens "
             f"(greedy, ignore_eos), {args.concurrency} in flight; prefill workers of 1 thread, one CPU decode engine "
             f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})",
             "| mode | prefill workers | ok | req/s | output tok/s | TTFT p50 s | TTFT p90 s |",
             "|---|---|---|---|---|---|---|"]
    for (mode, n), r in results.items():
        lines.append(f"| {mode} | {n} | {r['completed']}/{r['requests']} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {r['ttft'][50]:.2f} | {r['ttft'][90]:.2f} |")
    for n in (1, 2):
        ray_run, box = results[("Ray", n)], results[("single box", n)]
        lines.append(f"| Ray / single box | {n} | | {ray_run['request_throughput'] / box['request_throughput']:.2f} | "
                     f"{ray_run['output_throughput'] / box['output_throughput']:.2f} | "
                     f"{ray_run['ttft'][50] / box['ttft'][50]:.2f} | {ray_run['ttft'][90] / box['ttft'][90]:.2f} |")
    return "\n".join(lines)


# --- affinity: the engine choice's margin, simulated ------------------------------------------------------------
def affinity_table(ticks: int = 4000, seed: int = 3) -> str:
    """Two engines; each tick Poisson arrivals, each prompt under one of 8 system prompts (Zipf-like shares: a few
    popular ones) or none (a fifth of them), lasting 5-30 ticks. Per margin: of the prompts under a system prompt
    seen before, the share sent to the engine that took the last one ("prefix hits"; load alone: chance), and the
    in-flight imbalance |n0 - n1| at each choice."""
    from edge.core import engine_group
    lines = ["| load (in flight) | margin | prefix hits | imbalance mean | imbalance p99 |", "|---|---|---|---|---|"]
    margins = {"none (load only)": None, "0": (0.0, 0.0), "2 or 25% (chosen)": (2.0, 0.25), "4 or 50%": (4.0, 0.5),
               "unbounded": (1e9, 0.0)}
    saved = engine_group.AFFINITY_MARGIN, engine_group.AFFINITY_SHARE
    try:
        for rate in (0.3, 1.2):
            for label, margin in margins.items():
                if margin is not None:
                    engine_group.AFFINITY_MARGIN, engine_group.AFFINITY_SHARE = margin
                hits, imbalance = _simulate(rate, ticks, seed, use_affinity=margin is not None)
                lines.append(f"| ~{rate * 17.5:.0f} | {label} | {hits:.0%} | {statistics.mean(imbalance):.2f} | "
                             f"{sorted(imbalance)[int(0.99 * (len(imbalance) - 1))]} |")
    finally:
        engine_group.AFFINITY_MARGIN, engine_group.AFFINITY_SHARE = saved
    return "\n".join(lines)


def _simulate(rate: float, ticks: int, seed: int, use_affinity: bool) -> tuple[float, list[int]]:
    import numpy as np

    from edge.core.affinity import prefix_key
    from edge.core.engine_client import EngineClient
    from edge.core.engine_group import EngineGroup
    from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus
    rng = np.random.default_rng(seed)
    registry = InFlightRegistry()
    clients = {name: EngineClient(name, registry, b"", name) for name in ("decode-0", "decode-1")}
    for client in clients.values():
        client.state = "ready"
    group = EngineGroup(clients, registry)
    shares = 1 / np.arange(1, 9)
    ends: dict[str, int] = {}
    last: dict[int, str] = {}  # system prompt -> the engine that took the last prompt under it
    known = hits = 0
    imbalance = []
    for tick in range(ticks):
        for rid in [rid for rid, end in ends.items() if end <= tick]:
            registry.remove(rid)
            del ends[rid]
        for _ in range(rng.poisson(rate)):
            rid = f"r{len(imbalance)}"
            system = int(rng.choice(8, p=shares / shares.sum()) if rng.random() > 0.2 else rng.integers(8, 1 << 30))
            request = InFlight(rid, 0)
            request.prefix_key = prefix_key(f"system {system}: " * 40, None, None) if use_affinity else None
            registry.add(request)
            had = last.get(system)
            counts = [group.num_requests(name) for name in clients]
            imbalance.append(abs(counts[0] - counts[1]))
            group.choose(rid)
            request.status = RequestStatus.DECODING
            ends[rid] = tick + int(rng.integers(5, 31))
            known += had is not None
            hits += had == request.engine
            last[system] = request.engine
    return hits / max(1, known), imbalance


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--serving", action="store_true", help="edge serve --ray against single-box mode")
    parser.add_argument("--affinity", action="store_true", help="simulate the engine choice's affinity margin")
    parser.add_argument("--requests", type=int, default=16, help="serving: requests per run")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="serving: about this many per prompt")
    parser.add_argument("--max-tokens", type=int, default=24, help="serving: output tokens per request")
    parser.add_argument("--concurrency", type=int, default=4, help="serving: requests in flight")
    args = parser.parse_args(argv)
    if args.serving or args.affinity:
        print(serving_table(args) if args.serving else affinity_table())
        return
    size = handoff_bytes(args.tokens)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": STORE})
    try:
        cluster.add_node(num_cpus=1, resources={"prefill": 1}, object_store_memory=STORE)
        cluster.add_node(num_cpus=1, resources={"decode": 1}, object_store_memory=STORE)
        ray.init(address=cluster.address)
        engine = ray.remote(Engine).options(resources={"decode": 1}, num_cpus=0, max_concurrency=2).remote()
        worker = ray.remote(Worker).options(resources={"prefill": 1}, num_cpus=0).remote(size)
        serving = engine.serve_tcp.remote(args.repeats)
        tcp = ray.get(worker.over_tcp.remote(ray.get(engine.address.remote()), args.repeats))
        ray.get(serving)
        store = ray.get(worker.through_object_store.remote(engine, args.repeats))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"{args.tokens}-token q8_0 handoff, {size / 1e6:.1f} MB, {args.repeats} times, between two Ray nodes:")
    print("| path | median ms | p90 ms | MB/s |\n|---|---|---|---|")
    for name, times in (("direct TCP stream (chosen)", tcp), ("Ray object store", store)):
        median = statistics.median(times)
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        print(f"| {name} | {median * 1e3:.2f} | {p90 * 1e3:.2f} | {size / 1e6 / median:.0f} |")


if __name__ == "__main__":
    main()
