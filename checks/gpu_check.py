"""The one-command GPU check: gpu tests, then a decode benchmark against transformers, as one table.

    make gpu-check                        # python3 -m checks.gpu_check: budgeted to end within 8 minutes on an H200
    python3 -m checks.gpu_check --quick    # the 1B shape at batch 1 and 32, context 1k
    python3 -m checks.gpu_check --device cpu --tiny --out /tmp/t.md   # the CPU smoke test's run

Stages, each reporting its own failure so that the table is always written: missing packages installed from
carried wheels (.whl/), the device and its measured copy bandwidth, `pytest -m gpu` on the files that hold
gpu tests, then per model (random weights of published shapes, built on the device) and context: our engine
fed synthetic f16 handoffs at each batch size, transformers `generate` continuing a random dense cache, and
transformers `generate_batch` (paged continuous batching) on random prompts. A global deadline skips what
would not fit, and a watchdog writes what was measured and exits if a stage hangs past it.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from checks.gpu_benchmarks import run_benchmarks
from checks.gpu_report import Deadline, Report

ROOT = Path(__file__).resolve().parent.parent  # the repository
STARTED = time.monotonic()  # main() resets it; the wheels re-exec carries it over, so the budget counts the install
PRESETS = {  # models, batch sizes, contexts
    "full": (["llama-3.2-1b", "llama-3.1-8b"], [1, 8, 32, 64, 128], [1024, 4096]),
    "quick": (["llama-3.2-1b"], [1, 32], [1024]),
    "tiny": (["tiny"], [1, 2], [32, 64]),
}
NEEDED = {"msgspec": None, "gguf": None, "transformers": "5.24.0"}  # the GPU image lacks the first two


def ensure_packages(wheel_dir: str, argv: list[str]) -> str:
    """Install carried wheels into a private folder and re-exec when a needed package is missing or of
    another version; returns a note for the report."""
    wrong = [n for n, want in NEEDED.items() if _version(n) is None or (want and _version(n) != want)]
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    found = "needed packages: " + ", ".join(f"{n} {_version(n)}" for n in NEEDED)
    if not wrong:
        return found
    if os.environ.get("EDGE_GPU_CHECK_WHEELS") or not wheels:
        return found + f"; still missing or another version: {wrong} (carry wheels: docs/gpu.md)"
    target = os.path.join(tempfile.gettempdir(), "edge-gpu-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", target, *wheels], check=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p)
    os.environ["EDGE_GPU_CHECK_WHEELS"] = f"{len(wheels)} wheels from {wheel_dir}/ for {', '.join(wrong)}"
    os.environ["EDGE_GPU_CHECK_STARTED"] = repr(STARTED)
    os.execv(sys.executable, [sys.executable, "-m", "checks.gpu_check", *argv])


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_device(name: str, report: Report):
    """The device, the versions, and the copy bandwidth that the floor is measured against."""
    import torch

    from decode_gpu.attention.backend import resolve_backend
    from decode_gpu.runner.device import resolve_device
    device = resolve_device(name)
    triton = _version("triton") or "not installed"
    versions = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton}, "
                f"transformers {_version('transformers')}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
                f"sm_{props.major}{props.minor}")
    else:
        what = f"CPU, {os.cpu_count()} cores"
    report.bandwidth = copy_bandwidth(device)
    report.environment += [f"device: {what}; {versions}",
                           f"copy bandwidth: {report.bandwidth / 1e9:.0f} GB/s (a device-to-device `copy_`, bytes read "
                           f"+ written); the floor of a step is the bytes it must read over this",
                           f"our attention backend: {resolve_backend(device)} "
                           f"(EDGE_ATTENTION_BACKEND={os.environ.get('EDGE_ATTENTION_BACKEND', 'auto')})"]
    return device


def copy_bandwidth(device) -> float:
    """Bytes moved (read + written) per second by a large copy_, best of a few."""
    import torch
    n = (2 << 30) if device.type == "cuda" else (64 << 20)  # far beyond the H200's 60 MB L2
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(8):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started) if i >= 2 else best
    return 2 * n / best


def gpu_test_files() -> list[str]:
    """The test modules that hold gpu-marked tests; no other is collected (some import llama.cpp)."""
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/**/test_*.py") if "mark.gpu" in p.read_text())


def run_gpu_tests(timeout_s: float) -> str:
    """`pytest -m gpu` on those files in a subprocess; returns the counts from its junit report."""
    import xml.etree.ElementTree as ET
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE",
               f"--junitxml={junit}", *gpu_test_files()]
        print("$", " ".join(cmd), flush=True)
        try:
            done = subprocess.run(cmd, timeout=timeout_s, cwd=ROOT)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"pytest did not finish within {timeout_s:.0f} s") from None
        if not os.path.exists(junit):
            raise RuntimeError(f"pytest exited {done.returncode} without a report")
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root[0]
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    summary = f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"
    if n["failures"] or n["errors"] or done.returncode not in (0, 5):
        raise AssertionError(f"{summary}, pytest exit {done.returncode} (the failures are in the log above)")
    return summary

def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 1B shape, batch 1 and 32, context 1k")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, batch 1/2, context 32/64 (CPU smoke test)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", default=None, help="markdown file whose result block is replaced "
                        "(default docs/gpu.md on cuda; on the cpu only printed)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="global deadline, from the process start")
    parser.add_argument("--tests-timeout-s", type=float, default=200.0)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-baselines", action="store_true")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per batch size (3; tiny 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per batch size (10; tiny 2)")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="folder of carried wheels for missing packages")
    args = parser.parse_args(argv)
    args.models, args.batches, args.contexts = PRESETS["tiny" if args.tiny else "quick" if args.quick else "full"]
    args.warmup = args.warmup if args.warmup is not None else 1 if args.tiny else 3
    args.steps = args.steps if args.steps is not None else 2 if args.tiny else 10
    if args.out is None and args.device == "cuda":
        args.out = str(ROOT / "docs" / "gpu.md")
    return args


def main(argv: list[str] | None = None) -> int:
    global STARTED
    STARTED = float(os.environ.pop("EDGE_GPU_CHECK_STARTED", time.monotonic()))
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    report = Report(" ".join(["python3 -m checks.gpu_check", *argv]), args.out, STARTED)
    try:
        report.environment.append(ensure_packages(args.wheels, argv))
    except Exception as err:  # a broken wheel: run with what is installed, and say so
        report.environment.append(f"installing the carried wheels failed: {type(err).__name__}: {err}")
    if os.environ.get("EDGE_GPU_CHECK_WHEELS"):
        report.environment.append(f"installed {os.environ['EDGE_GPU_CHECK_WHEELS']}")
    watchdog = threading.Timer(max(1.0, STARTED + args.budget_s + 25 - time.monotonic()), _fire, args=(report,))
    watchdog.daemon = True
    watchdog.start()
    deadline = Deadline(STARTED, args.budget_s)
    device = report.stage("device", describe_device, args.device, report)
    if device is not None and not args.skip_tests:
        timeout_s = min(args.tests_timeout_s, max(10, deadline.left() - 120))  # leave the benchmark two minutes
        report.stage("gpu tests (pytest -m gpu)", run_gpu_tests, timeout_s)
    if device is not None:
        report.stage("benchmarks", run_benchmarks, args, device, report, deadline)
    watchdog.cancel()
    report.finish()
    return 0 if report.all_ok else 1


def _fire(report: Report) -> None:
    """The watchdog: a stage hung past the deadline (a stuck kernel, say). Write what was measured and end."""
    try:
        report.notes.append(f"STOPPED by the watchdog at the global deadline, during: {' > '.join(report.running)}; "
                            "later stages never ran")
        report.all_ok = False
        report.finish()
    finally:
        os._exit(3)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a hung baseline's thread must not keep the process alive
