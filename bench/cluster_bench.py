"""The KV handoff between two Ray nodes: the direct worker->engine TCP stream (what edge serve --ray uses) against
Ray's object store (ray.put on the worker's node, the engine's actor reading it), for a 512-token q8_0 handoff of
the embedded model (30 layers, 3 KV heads, head size 64: 6.3 MB).

    python -m bench.cluster_bench [--tokens 512] [--repeats 30]

Runs a local ray.cluster_utils.Cluster (head + two nodes with custom resources), so both paths cross loopback:
the numbers compare the paths' overheads (copies, serialization, scheduling), not a network.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
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
