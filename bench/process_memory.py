"""What each process of `edge serve` holds once ready and idle: RSS, PSS and USS, the part of the RSS that is a
mapped model file (GGUF, safetensors: page cache, shared between processes that map the same file), and the rest.
The planner's fixed runtimes (contracts/memory_plan.py) come from these numbers on the embedded model.

    .venv/bin/python -m bench.process_memory [--model PATH.gguf] [--config 'kv_cache_tokens = 8192'] [--settle 5]

Starts `edge serve` (tests/server_process.py's way: a config file, a free port; the first start on a new model
converts it, which may take minutes), waits for /health, lets it settle, reads every process, prints one row each,
the engine's own account (/health engine memory, if it reports one) and the totals, and stops it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/server_process.py

from server_process import ServerProcess  # noqa: E402

MIB = 2**20
MODEL_FILES = (".gguf", ".safetensors")


def process_memory(pid: int) -> dict[str, int]:
    """rss, pss, uss, and `mapped_model`: the resident bytes of mapped model files (and their PSS)."""
    process = psutil.Process(pid)
    full = process.memory_full_info()
    mapped_rss = mapped_pss = 0
    for region in process.memory_maps(grouped=True):
        if region.path.endswith(MODEL_FILES):
            mapped_rss += region.rss
            mapped_pss += region.pss
    return {"rss": full.rss, "pss": full.pss, "uss": full.uss, "mapped_model_rss": mapped_rss,
            "mapped_model_pss": mapped_pss, "beyond_model_rss": full.rss - mapped_rss}


def _name(process: psutil.Process) -> str:
    """A child the health report does not name: its module (python -m X) and pid."""
    cmdline = process.cmdline()
    module = cmdline[cmdline.index("-m") + 1] if "-m" in cmdline[:-1] else process.name()
    return f"{module} ({process.pid})"


def measure(config: str, workdir: Path, settle_s: float, start_timeout_s: float) -> dict:
    server = ServerProcess(config, workdir)
    started = time.monotonic()
    server.start(timeout_s=start_timeout_s)
    ready_s = time.monotonic() - started
    try:
        time.sleep(settle_s)  # the workers' and engine's start-up measurements end, allocators settle
        health = server.health()
        pids = {"gateway": server.process.pid}
        pids.update({name: p["pid"] for name, p in health.get("processes", {}).items() if p.get("pid")})
        for child in psutil.Process(server.process.pid).children(recursive=True):  # e.g. grammar compile processes
            if child.pid not in pids.values():
                pids[_name(child)] = child.pid
        rows = {name: process_memory(pid) for name, pid in pids.items()}
        engine = (health.get("engine") or {}).get("memory")
    finally:
        server.stop()
    return {"ready_s": ready_s, "processes": rows, "engine_memory": engine}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="GGUF path; default the embedded model")
    parser.add_argument("--config", action="append", default=[], help="a serve.toml line (repeatable)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds idle before reading")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lines = [f'model = "{Path(args.model).resolve()}"'] if args.model else []
    config = "\n".join([*lines, *args.config, "[limits]", "shutdown_grace_s = 1.0"]) + "\n"
    with tempfile.TemporaryDirectory() as folder:
        result = measure(config, Path(folder), args.settle, args.start_timeout)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"ready in {result['ready_s']:.1f} s\n")
    columns = ("rss", "pss", "uss", "mapped_model_rss", "beyond_model_rss")
    print(f"| process | {' | '.join(c + ' MiB' for c in columns)} |")
    print("|---|" + "---:|" * len(columns))
    totals = dict.fromkeys(columns, 0)
    for name, row in result["processes"].items():
        print(f"| {name} | " + " | ".join(f"{row[c] / MIB:.0f}" for c in columns) + " |")
        totals = {c: totals[c] + row[c] for c in columns}
    print("| total | " + " | ".join(f"{totals[c] / MIB:.0f}" for c in columns) + " |")
    if result["engine_memory"]:
        print("\nengine's own account (MiB): " + ", ".join(
            f"{k} {v / MIB:.0f}" if isinstance(v, int) else f"{k} {v}" for k, v in result["engine_memory"].items()
            if not isinstance(v, dict)) + "; weights " + json.dumps(
            {k: round(v / MIB) for k, v in result["engine_memory"]["weights"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
