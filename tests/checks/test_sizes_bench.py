"""bench/sizes_bench.py's own parts: the process tree's memory read from the system, the peak sampler, the chats
(ignore_eos, fixed max_tokens) and which llama.cpp it compares against; the one-slot llama.cpp endpoint streams a
chat of exactly max_tokens tokens (slow: it loads llama.cpp in a subprocess)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import psutil
import pytest

from bench import sizes_bench
from bench.sizes_bench import PeakSampler, chats, llama_cpp, load, tree_memory

BALLAST = 96 << 20  # bytes the child writes, so it holds them


@pytest.fixture
def parent():
    """A process with a child that holds BALLAST."""
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            f"'import time; b = bytearray({BALLAST}); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(60)']); "
            "time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(100):
            rows = tree_memory(process.pid)
            if len(rows) == 2 and max(r["rss"] for r in rows.values()) > BALLAST:
                break
            asyncio.run(asyncio.sleep(0.1))
        yield process
    finally:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        process.wait()


def test_the_tree_and_its_peak_count_every_process(parent):
    rows = tree_memory(parent.pid)
    assert len(rows) == 2 and all(f"({pid})" in " ".join(rows) for pid in (parent.pid,))
    assert sum(r["rss"] for r in rows.values()) > BALLAST and all(0 < r["pss"] <= r["rss"] for r in rows.values())
    sampler = PeakSampler(parent.pid)
    asyncio.run(asyncio.sleep(3 * sizes_bench.SAMPLE_S))
    peak = sampler.stop()
    assert peak["rss"] > BALLAST and 0 < peak["pss"] <= peak["rss"]
    assert tree_memory(2**22 + 12345) == {}  # no such process


def test_the_chats_are_the_same_work_on_every_server():
    specs = chats(4, 32)
    assert len(specs) == 4 and {s.max_tokens for s in specs} == {32} and all(s.ignore_eos for s in specs)
    assert len({str(s.messages) for s in specs}) == 4  # four prompts, not one cached four times


def test_without_llama_server_or_its_python_server_the_one_slot_endpoint_stands_in(monkeypatch, tmp_path):
    import checks.llama_server
    monkeypatch.setattr(checks.llama_server, "binary_path", lambda: tmp_path / "absent")
    monkeypatch.setattr(sizes_bench.importlib.util, "find_spec", lambda name: None)
    system = llama_cpp("/m/ladder-1b.gguf", 2, 4, 4096, tune=True, probe_tokens=16)
    assert system.name == "llama.cpp (llama-cpp-python Llama, one slot)" and system.model == "ladder-1b"
    assert system.argv_for_port(1234)[1:5] == ["-m", "bench.sizes_bench", "--serve-llama-cpp", "/m/ladder-1b.gguf"]
    built = tmp_path / "llama-server"
    built.write_text("")
    monkeypatch.setattr(checks.llama_server, "binary_path", lambda: built)
    system = llama_cpp("/m/ladder-1b.gguf", 2, 4, 4096, tune=False, probe_tokens=16)
    assert system.name == "llama-server (given, -t 2, -np 4, -ub 512)"
    argv = system.argv_for_port(1234)
    assert argv[0] == str(built) and argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == "16384"


@pytest.mark.slow
def test_the_one_slot_endpoint_streams_max_tokens(monkeypatch, tmp_path, tiny_gguf):
    monkeypatch.setattr(sizes_bench.importlib.util, "find_spec", lambda name: None)
    import checks.llama_server
    monkeypatch.setattr(checks.llama_server, "binary_path", lambda: tmp_path / "absent")
    system = llama_cpp(str(tiny_gguf("llama")), 1, 2, 512, tune=False, probe_tokens=4)
    system.start(timeout_s=120)
    try:
        result = asyncio.run(load(system, chats(2, 8, prompt_tokens=16)))
    finally:
        system.stop()
    assert result["completed"] == 2 and result["output_tokens"] == 16 and not result["errors"]
