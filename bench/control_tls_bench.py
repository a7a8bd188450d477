"""What mutual TLS costs a control link: connect (both handshakes) and one KV handoff frame, plain TCP against TLS,
over loopback through contracts.framing (docs/security.md, "Network"). The frame is 6.3 MB, a 512-token q8_0 handoff
of the embedded model; sender and receiver share this process's event loop, so the time includes both ends' work.

    python -m bench.control_tls_bench [--repeats 30] [--mbytes 6.3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from contracts.control_tls import ControlTLS
from contracts.framing import accept_peer, connect_when_listening, read_message, send_message, start_server
from contracts.messages import Handoff

SECRET = b"bench-secret-0123456789abcdef"


def make_ca(folder: Path) -> ControlTLS:
    import trustme  # the test extra's
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(folder / "node.pem"))
    leaf.private_key_pem.write_to_path(str(folder / "node.key"))
    return ControlTLS(str(folder / "node.pem"), str(folder / "node.key"), str(folder / "ca.pem")).check()


async def measure(tls: ControlTLS, frame: Handoff, repeats: int) -> tuple[float, list[float]]:
    """(connect ms, each frame's ms from send to decoded at the listener)."""
    arrived: asyncio.Queue[float] = asyncio.Queue()
    ended = asyncio.Event()

    async def listener(reader, writer):
        await accept_peer(reader, writer, SECRET)
        while await read_message(reader, 1 << 30) is not None:
            arrived.put_nowait(time.perf_counter())
        writer.close()
        ended.set()
    server = await start_server(listener, "tcp://127.0.0.1:0", tls)
    address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    started = time.perf_counter()
    _, writer = await connect_when_listening(address, "prefill", "bench", SECRET, 5, tls)
    connect_ms = (time.perf_counter() - started) * 1e3
    times = []
    for i in range(repeats + 3):  # 3 to warm up
        started = time.perf_counter()
        await send_message(writer, frame)
        done = await arrived.get()
        if i >= 3:
            times.append((done - started) * 1e3)
    writer.close()
    await ended.wait()
    server.close()
    return connect_ms, times


async def main(repeats: int, mbytes: float) -> None:
    frame = Handoff("bench", os.urandom(int(mbytes * 1e6)))
    with tempfile.TemporaryDirectory() as folder:
        links = {"plain TCP": ControlTLS(), "mutual TLS": make_ca(Path(folder))}
        print(f"one {mbytes} MB handoff frame over loopback, {repeats} repeats (two rounds)\n")
        print("| link | connect ms | frame median ms | frame p90 ms | MB/s |")
        print("|---|---|---|---|---|")
        for _ in range(2):
            for name, tls in links.items():
                connect_ms, times = await measure(tls, frame, repeats)
                median = statistics.median(times)
                p90 = sorted(times)[int(0.9 * len(times))]
                print(f"| {name} | {connect_ms:.1f} | {median:.1f} | {p90:.1f} | {mbytes / median * 1e3:.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--mbytes", type=float, default=6.3)
    args = parser.parse_args()
    asyncio.run(main(args.repeats, args.mbytes))
