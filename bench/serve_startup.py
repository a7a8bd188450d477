"""How long `edge serve` takes to be ready, and where the time goes, on the embedded model (cached).

    .venv/bin/python -m bench.serve_startup [--runs 3] [--config 'deterministic = true'] [--config ...]

Each run starts `edge serve` (tests/server_process.py's way: a config file, a free port), times process start to
/health 200, stops it, and prints one row per run: the 1-minute load average just before, the seconds to ready,
and the seconds from process start to each start-up log line named in STAGES (the first line that matches). The
conversion of the embedded model into the cache (the first start after an install) is not start-up time: run once
before measuring.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/server_process.py

from server_process import ServerProcess  # noqa: E402

BASE_CONFIG = "kv_cache_tokens = 8192\nmax_model_len = 1200\n[limits]\nshutdown_grace_s = 1.0\n"
# (column, the log line that ends the stage): the first line that matches, seconds from process start
STAGES = [
    ("gateway log", r"\[gateway\]"),
    ("children started", r"started decode_engine"),
    ("engine log", r"\[engine\]"),
    ("worker log", r"\[prefill-0\]"),
    ("model loaded", r"decode model .* loaded"),
    ("weights held", r"weight_quant: decode weights "),
    ("engine ready", r"decode engine ready"),
    ("worker ready", r"prefill worker prefill-0 ready"),
    ("gateway ready", r"\[gateway\] edge.launch.local: ready: "),
]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stage_times(log: str, began: float) -> dict[str, float]:
    """Seconds from `began` (a time.time()) to the first line of each stage."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        stamp = STAMP.match(line)
        if stamp is None:
            continue
        at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - began
        for name, pattern in STAGES:
            if name not in found and re.search(pattern, line):
                found[name] = at
    return found


def run_once(config: str, workdir: Path) -> tuple[float, float, dict[str, float], str]:
    server = ServerProcess(config, workdir)
    load = os.getloadavg()[0]
    began_wall, began = time.time(), time.monotonic()
    server.start()
    ready_s = time.monotonic() - began
    server.stop()
    log = server.log_path.read_text()
    return load, ready_s, stage_times(log, began_wall), log


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", action="append", default=[], help="a TOML line added to the config")
    parser.add_argument("--keep-logs", help="a folder to copy each run's log into")
    args = parser.parse_args(argv)
    config = "".join(line + "\n" for line in args.config) + BASE_CONFIG
    print("| run | load before | ready (s) | " + " | ".join(name for name, _ in STAGES) + " |")
    print("|---" * (3 + len(STAGES)) + "|")
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="startup-") as folder:
            load, ready_s, stages, log = run_once(config, Path(folder))
            if args.keep_logs:
                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                Path(args.keep_logs, f"run-{run}.log").write_text(log)
        cells = [f"{stages[name]:.1f}" if name in stages else "-" for name, _ in STAGES]
        print(f"| {run} | {load:.2f} | {ready_s:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
