"""python -m checks.soak [--duration S] [--clients N] [--seed N] [--workdir DIR]: the soak's tables on stdout."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from checks.soak.harness import run_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checks.soak",
                                     description="Chaos soak of the real service; prints markdown tables.")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--clients", type=int, default=3, help="client threads sending valid requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="", help="where the config, policy and service log go")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="edge-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = run_soak(args.duration, workdir, args.clients, args.seed)
    print(f"`python -m checks.soak --duration {args.duration:g}` (service log: {report.log_path})\n")
    print(report.markdown())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
