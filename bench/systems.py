"""The servers compared by the serving benchmark, each started as a subprocess on a free local port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from checks.llama_server import build as build_llama_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class System:
    name: str
    model: str  # the "model" field this server expects
    argv_for_port: object  # callable(port) -> argv
    ready_path: str = "/v1/models"
    port: int = 0
    process: subprocess.Popen | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".log")[1]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(self.argv_for_port(self.port), stdout=open(self.log, "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start; log: {self.log}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {timeout_s} s; log: {self.log}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def f16_copy(gguf: str) -> str:
    """The f16 copy of `gguf` our prefill workers load under prefill_weights = "auto" (made once, cached)."""
    from contracts.cache import converted_dir
    from contracts.identity import read_gguf_identity
    from prefill_cpu.prefill_weights import converted_copy
    identity = read_gguf_identity(gguf)
    folder = converted_dir(identity)
    folder.mkdir(parents=True, exist_ok=True)
    return str(converted_copy(identity, "f16", folder))


def make_systems(names: list[str], gguf: str, threads: int, slots: int, ctx_per_slot: int,
                 pace_ms: float = 100) -> list[System]:
    model_id = Path(gguf).name.removesuffix(".gguf")

    def edge_serve(name: str, layout: str) -> System:
        """`edge serve` with the prefill layout `layout` (TOML lines) and what every run of ours shares."""
        config = Path(tempfile.mkstemp(suffix=".toml")[1])
        config.write_text(f'log_level = "WARNING"\n{layout}max_num_seqs = 64\n'
                          f'kv_cache_tokens = {slots * ctx_per_slot * 2}\n[limits]\nprefill_queue_size = 512\n')
        return System(name, model_id, lambda p: [sys.executable, "-m", "edge.cli", "serve", "--model", gguf, "--port",
                                                 str(p), "--config", str(config)], ready_path="/health")

    catalog = {
        "ours": lambda: edge_serve("ours (edge serve)", f"threads_per_worker = {threads}\n"),
        # the throughput layout of a CPU-only box (docs/decode.md, "Pacing decode while prompts wait"): a
        # single-threaded worker per core, and decode paced while prompts wait for one
        "ours-paced": lambda: edge_serve(f"ours ({threads} workers x 1 thread, paced {pace_ms:g} ms)",
                                         f"prefill_workers = {threads}\nthreads_per_worker = 1\n"
                                         f"cpu_decode_pace_ms = {pace_ms:g}\n"),
        # ours with 128-token prefill chunks (the default before 2026-12-02's evening)
        "ours-nb128": lambda: edge_serve("ours (n_batch 128)", f"threads_per_worker = {threads}\nn_batch = 128\n"),
        # ours with llama.cpp prefilling the GGUF as given (before `prefill_weights = "auto"` made an f16 copy)
        "ours-given": lambda: edge_serve("ours (prefill weights as given)",
                                         f'threads_per_worker = {threads}\nprefill_weights = "given"\n'),
        # ours with the float32 decode weights `auto` kept on an AVX2 CPU before q8_0 (docs/decode.md)
        "ours-float32": lambda: edge_serve("ours (float32 weights)",
                                           f'threads_per_worker = {threads}\nweight_dtype = "float32"\n'),
        # ours with transformers' decoder forward (kept behind decode_forward for this comparison, docs/decode.md)
        "ours-transformers": lambda: edge_serve("ours (transformers forward)",
                                                f'threads_per_worker = {threads}\ndecode_forward = "transformers"\n'),
        "llama-server": lambda: System(f"llama-server (-np {slots})", model_id, lambda p: [
            str(build_llama_server(os.cpu_count() or 2)), "-m", gguf, "--port", str(p), "-t", str(threads),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "--log-disable"], ready_path="/health"),
        # llama-server on the f16 copy `prefill_weights = "auto"` gives our workers: faster prefill, slower decode
        "llama-server-f16": lambda: System(f"llama-server (-np {slots}, f16 copy)", model_id, lambda p: [
            str(build_llama_server(os.cpu_count() or 2)), "-m", f16_copy(gguf), "--port", str(p), "-t", str(threads),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "--log-disable"], ready_path="/health"),
        "llama-cpp-python": lambda: System("llama_cpp.server", model_id, lambda p: [
            sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(p), "--n_threads", str(threads),
            "--n_ctx", str(ctx_per_slot * 2), "--interrupt_requests", "False", "--model_alias", model_id]),
        "transformers": lambda: System("transformers generate (serial)", "transformers", lambda p: [
            sys.executable, "-m", "bench.hf_server", "--model", gguf, "--port", str(p)]),
    }
    unknown = set(names) - set(catalog)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {sorted(catalog)}")
    return [catalog[name]() for name in names]
