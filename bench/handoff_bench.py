"""Benchmark the KV handoff: llama.cpp prefill vs the cost of moving its KV into the torch decoder.

    make bench-handoff            # or: .venv/bin/python -m bench.handoff_bench [--model PATH] [--device auto]

For each prompt length and KV type, in one run: prefill ms (llama_decode + first-token sample),
export ms (llama_state_seq_get_data + parse + msgpack encode), message bytes, transfer ms over a
local Unix socket (send until the receiver has every byte), import ms (decode the message, dequantize,
un-rotate, un-permute, write into the cache on the device), and overhead = (export+transfer+import)/prefill.
Each number is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import threading
import time

import torch

from contracts.handoff import SamplingParams, decode_handoff, encode_handoff
from decode_gpu.kv.importer import import_handoff
from decode_gpu.model.loader import load_decode_model
from decode_gpu.reference.dense_cache import DenseKVCache
from decode_gpu.runner.device import resolve_device
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

TEXT = ("The history of computing is a story of people, machines and ideas. Early mechanical calculators gave way "
        "to electronic computers, and those to the personal devices we carry today. ")


class SocketLink:
    """A length-prefixed byte pipe over a local Unix socket pair; the receiver acks each full message."""

    def __init__(self) -> None:
        self.sender, self.receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.received: bytes = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while header := self._recv_exactly(8):
            (size,) = struct.unpack("<Q", header)
            self.received = self._recv_exactly(size)
            self.receiver.sendall(b"k")

    def _recv_exactly(self, size: int) -> bytes:
        chunks, remaining = [], size
        while remaining:
            chunk = self.receiver.recv(min(remaining, 1 << 20))
            if not chunk:
                return b""
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def send(self, message: bytes) -> bytes:
        self.sender.sendall(struct.pack("<Q", len(message)) + message)
        self.sender.recv(1)
        return self.received

    def close(self) -> None:
        self.sender.close()
        self.thread.join(timeout=2)
        self.receiver.close()


def measure(prefiller: Prefiller, model, device, tokens: list[int], link: SocketLink) -> dict:
    outcome = prefiller.prefill(PrefillRequest("bench", tuple(tokens), SamplingParams(temperature=0)))
    started = time.perf_counter()
    message = encode_handoff(outcome.handoff)
    encoded = time.perf_counter()
    received = link.send(message)
    sent = time.perf_counter()
    cache = DenseKVCache(model.config, model.dtype)
    import_handoff(decode_handoff(received), prefiller.identity, cache, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    imported = time.perf_counter()
    export_ms = (outcome.export_s + encoded - started) * 1e3
    return dict(prefill=outcome.prefill_s * 1e3, export=export_ms, bytes=len(message),
                transfer=(sent - encoded) * 1e3, import_=(imported - sent) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--lengths", default="128,512,1024")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0")
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: all cores)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_path = args.model or embedded_model_path()
    device = resolve_device(args.device)
    lengths = [int(n) for n in args.lengths.split(",")]
    link = SocketLink()
    rows, model = [], None
    for kv_type in args.kv_types.split(","):
        prefiller = Prefiller(PrefillConfig(model_path, n_ctx=max(lengths) + 16, n_threads=args.threads,
                                            kv_type=kv_type))
        model = model or load_decode_model(prefiller.identity, device, torch.float32 if device.type == "cpu"
                                           else torch.float16)
        base = prefiller.tokenize(TEXT * (max(lengths) // 20 + 1))
        for n in lengths:
            runs = [measure(prefiller, model, device, base[:n], link) for _ in range(args.repeats + 1)][1:]
            rows.append((kv_type, n, {k: statistics.median(r[k] for r in runs) for k in runs[0]}))
        prefiller.close()
    link.close()
    print_table(rows, device)


def print_table(rows, device) -> None:
    print(f"\nKV handoff on {device} (torch {torch.__version__}); medians")
    head = ("kv", "tokens", "prefill ms", "export ms", "bytes", "B/token", "transfer ms", "import ms", "overhead")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    f16_bytes = {n: r["bytes"] for kv, n, r in rows if kv == "f16"}
    for kv, n, r in rows:
        overhead = (r["export"] + r["transfer"] + r["import_"]) / r["prefill"]
        share = f" ({r['bytes'] / f16_bytes[n]:.0%} of f16)" if kv != "f16" and n in f16_bytes else ""
        size = f"{r['bytes']:,}{share}"
        print(f"| {kv} | {n} | {r['prefill']:.1f} | {r['export']:.2f} | {size} | {r['bytes'] / n:,.0f} | "
              f"{r['transfer']:.2f} | {r['import_']:.2f} | {overhead:.1%} |")


if __name__ == "__main__":
    main()
