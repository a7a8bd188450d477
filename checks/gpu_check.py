"""The one-command GPU check (issue 11): gpu tests, then a decode benchmark against transformers, as one table.

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
import datetime
import glob
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
STARTED = time.monotonic()  # main() resets it; the wheels re-exec carries it over, so the budget counts the install
PRESETS = {  # models, batch sizes, contexts
    "full": (["llama-3.2-1b", "llama-3.1-8b"], [1, 8, 32, 64, 128], [1024, 4096]),
    "quick": (["llama-3.2-1b"], [1, 32], [1024]),
    "tiny": (["tiny"], [1, 2], [32, 64]),
}
CB_FIRST = (64, 1)  # generate_batch runs these batch sizes first: the target compares batch 64, and 1 is cheap
NEEDED = {"msgspec": None, "gguf": None, "transformers": "5.24.0"}  # the GPU image lacks the first two
BEGIN, END = "<!-- gpu-check:begin", "<!-- gpu-check:end -->"
COLUMNS = ["model", "batch", "context", "ours ms/step", "ours tok/s", "GB read/step", "floor ms", "% of floor",
           "generate ms/step", "generate_batch ms/step", "generate_batch ÷ ours"]


class Deadline:
    def __init__(self, budget_s: float) -> None:
        self.end = STARTED + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


class Report:
    """What the run measured so far; `finish` renders it once (from the main thread or the watchdog)."""

    def __init__(self, command: str, out: str | None) -> None:
        self.command, self.out = command, out
        self.environment: list[str] = []
        self.stages: list[tuple[str, str, float]] = []  # (name, result, seconds)
        self.rows: dict[tuple[int, str, int, int], dict[str, str]] = {}  # (model index, model, context, batch) -> cells
        self.notes: list[str] = []
        self.bandwidth = 0.0  # bytes/s, read + written
        self.all_ok = True
        self.running: list[str] = []  # the stages in progress, outermost first
        self._lock = threading.Lock()
        self._done = False

    def stage(self, name: str, fn, *args):
        """Run one stage; its failure is recorded, printed and swallowed. Returns fn's value, or None."""
        print(f"\n== {name}", flush=True)
        started = time.monotonic()
        self.running.append(name)
        try:
            value = fn(*args)
        except Exception as err:  # one stage's failure must not stop the others or the table
            self.running.pop()
            traceback.print_exc()
            self.all_ok = False
            self.stages.append((name, f"FAILED: {type(err).__name__}: {' '.join(str(err).split())[:300]}",
                                time.monotonic() - started))
            return None
        self.running.pop()
        self.stages.append((name, value if isinstance(value, str) else "ok", time.monotonic() - started))
        print(f"   {self.stages[-1][1]} ({self.stages[-1][2]:.1f} s)", flush=True)
        return value

    def skip(self, name: str, why: str) -> None:
        print(f"\n== {name}: skipped, {why}", flush=True)
        self.stages.append((name, f"skipped: {why}", 0.0))

    def cell(self, key: tuple[int, str, int, int], column: str, value: str) -> None:
        _, model, context, batch = key
        self.rows.setdefault(key, {"model": model, "batch": str(batch), "context": str(context)})[column] = value

    def finish(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            text = self.render()
            print("\n" + text, flush=True)
            if self.out:
                write_block(self.out, text)
                print(f"written to {self.out}", flush=True)

    def render(self) -> str:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        lines = [f"{BEGIN} (written by checks/gpu_check.py; replaced up to gpu-check:end on each run) -->",
                 "## Results", "", f"`{self.command}` on {now}, {time.monotonic() - STARTED:.0f} s in all.", ""]
        lines += [f"- {item}" for item in self.environment]
        lines += ["", "| stage | result | s |", "|---|---|---|"]
        lines += [f"| {name} | {result} | {secs:.1f} |" for name, result, secs in self.stages]
        lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for key in sorted(self.rows):
            cells = self.rows[key]
            lines.append("| " + " | ".join(cells.get(c, "—") for c in COLUMNS) + " |")
        lines += ["", *[f"- {note}" for note in self.notes], END]
        return "\n".join(lines)


def write_block(path: str, block: str) -> None:
    """Replace the result block of `path`, keeping the prose around it; append one if there is none."""
    text = open(path).read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


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
    from decode_gpu.runner.device import resolve_device
    from decode_gpu.attention.paged_attention import resolve_backend
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


def run_benchmarks(args, device, report: Report, deadline: Deadline) -> None:
    import torch
    from checks import gpu_models as gm
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = {}
    for name in args.models:
        if deadline.left() < 40:
            report.skip(f"build {name}", "time budget")
            continue
        report.stage(f"build {name}", _build, gm, name, device, dtype, models)
    report.notes.append(f"random weights, {str(dtype).split('.')[-1]}, KV pool in the model's dtype, greedy; "
                        f"ours: ms/step is the median of {args.steps} steps after {args.warmup} warm-up step(s), "
                        f"the engine's whole step (schedule, forward, sampling, the host copy); generate: the median gap between tokens "
                        f"reaching a streamer, after a warm-up call; generate_batch: the median gap between a "
                        f"request's tokens once every request has its first token (prefill excluded)")
    for context in args.contexts:
        for name, model in models.items():
            if deadline.left() < 30 + _import_bytes(gm.SHAPES[name], context, max(args.batches)) / 1e9:
                report.skip(f"ours {name} context {context}", "time budget")
                continue
            if report.stage(f"ours {name} context {context}", _ours, gm, args, report, deadline, name, model, device,
                            context) is None:
                for batch in args.batches:
                    report.cell(_key(args, name, context, batch), "ours ms/step", "error (see stages)")
    if models and deadline.left() > 120:
        from checks.gpu_weights import weight_stage
        name = list(models)[-1]  # the largest shape: where the weights' bytes matter
        report.stage(f"weights {name}", weight_stage, gm, report, name, models[name], device, args.contexts[0],
                     [b for b in args.batches if b in (1, 32)] or args.batches[:1], args.warmup, args.steps,
                     lambda: deadline.left() - 60)
    if args.skip_baselines:
        return
    for context in args.contexts:
        for name, model in models.items():
            report.stage(f"generate {name} context {context}", _generate, gm, args, report, deadline, name, model,
                         device, context)
    cb_order = [(c, b) for c in args.contexts for b in [*CB_FIRST, *args.batches] if b in args.batches]
    for context, batch in dict.fromkeys(cb_order):
        for name, model in models.items():
            _generate_batch(gm, args, report, deadline, name, model, device, context, batch)


def _build(gm, name: str, device, dtype, models: dict) -> str:
    model, seconds = gm.build_model(gm.SHAPES[name], device, dtype)
    models[name] = model
    params = sum(p.numel() for p in model.parameters())
    read = gm.weight_bytes_read_per_step(model)
    return f"{params / 1e9:.2f} B parameters, {read / 1e9:.1f} GB of weights read per step, built in {seconds:.1f} s"


def _import_bytes(shape, context: int, batch: int) -> int:
    return batch * context * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2  # f16 K and V


def _key(args, name: str, context: int, batch: int) -> tuple[int, str, int, int]:
    return args.models.index(name), name, context, batch


def _ours(gm, args, report: Report, deadline: Deadline, name: str, model, device, context: int) -> str:
    shape = gm.SHAPES[name]
    first_s, results = gm.time_ours(model, shape, device, context, args.batches, args.warmup, args.steps,
                                    lambda: deadline.left() - 20)
    weights = gm.weight_bytes_read_per_step(model)
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * model.dtype.itemsize
    for batch, result in results.items():
        key = _key(args, name, context, batch)
        if isinstance(result, str):
            report.cell(key, "ours ms/step", result)
            continue
        read = weights + result.kv_tokens * per_token
        floor_ms = 1e3 * read / report.bandwidth
        report.cell(key, "ours ms/step", f"{result.ms:.2f}")
        report.rows[key].update({"ours tok/s": f"{batch * 1e3 / result.ms:.0f}",
                                 "GB read/step": f"{read / 1e9:.3g}", "floor ms": f"{floor_ms:.2f}",
                                 "% of floor": f"{100 * floor_ms / result.ms:.3g}%"})
    done = sum(not isinstance(r, str) for r in results.values())
    return (f"{max(args.batches)} handoffs of {context} tokens imported + first step {first_s:.1f} s; "
            f"{done} batch sizes timed")


def _ours_ms(report: Report, key) -> float | None:
    try:
        return float(report.rows.get(key, {}).get("ours ms/step", ""))
    except ValueError:
        return None


def _generate(gm, args, report: Report, deadline: Deadline, name: str, model, device, context: int) -> str:
    done = []
    for batch in args.batches:
        key = _key(args, name, context, batch)
        estimate = (args.steps + 2) * 4 * (_ours_ms(report, key) or 1000) / 1e3 + 2  # transformers: a few x slower
        if deadline.left() < estimate + 20:
            report.cell(key, "generate ms/step", "skipped: time budget")
            continue
        try:
            ms = gm.time_generate(model, gm.SHAPES[name], device, context, batch, args.steps)
        except Exception as err:  # one batch size's failure (out of memory, say) is its own cell
            traceback.print_exc()
            report.cell(key, "generate ms/step", f"error: {type(err).__name__}: {str(err)[:80]}")
            report.all_ok = False
            gm._free(device)
            continue
        report.cell(key, "generate ms/step", f"{ms:.2f}")
        done.append(batch)
    return f"timed at batch {done}"


def _generate_batch(gm, args, report: Report, deadline: Deadline, name: str, model, device, context: int, batch: int):
    key = _key(args, name, context, batch)
    shape = gm.SHAPES[name]
    prefill_s = 2 * batch * context * shape.num_layers * 12 * shape.hidden_size ** 2 / 2e14  # rough, H200 bf16
    decode_s = (args.steps + 4 + batch * context / 8192) * 4 * (_ours_ms(report, key) or 50) / 1e3
    estimate = getattr(report, "cb_setup_s", 20.0) + prefill_s + decode_s  # set-up: 20 s until a call measures it
    title = f"generate_batch {name} context {context} batch {batch}"
    if getattr(report, "cb_hung", False) or deadline.left() < estimate + 15:
        report.cell(key, "generate_batch ms/step", "skipped: time budget")
        report.skip(title, "a generate_batch call hung" if getattr(report, "cb_hung", False) else "time budget")
        return
    value = report.stage(title, _cb_cell, gm, report, key, model, shape, device, context, batch, args.steps,
                         max(30.0, min(deadline.left() - 15, 3 * estimate)), prefill_s)
    if value is None:
        report.cell(key, "generate_batch ms/step", "error (see stages)")


def _cb_cell(gm, report: Report, key, model, shape, device, context, batch, steps, timeout_s, prefill_s) -> str:
    try:
        ms, wall, note = gm.time_generate_batch(model, shape, device, context, batch, steps, timeout_s)
    except TimeoutError:
        report.cb_hung = True  # its thread still holds the GPU: later generate_batch calls would be meaningless
        raise
    report.cb_setup_s = max(5.0, wall - prefill_s - 1e-3 * ms * (steps + 4 + batch * context / 8192))
    report.cell(key, "generate_batch ms/step", f"{ms:.2f}" + (f" ({note})" if note else ""))
    ours = _ours_ms(report, key)
    if ours:
        report.cell(key, "generate_batch ÷ ours", f"{ms / ours:.1f}x")
    return f"{ms:.2f} ms/step, the whole call {wall:.1f} s"


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
    report = Report(" ".join(["python3 -m checks.gpu_check", *argv]), args.out)
    try:
        report.environment.append(ensure_packages(args.wheels, argv))
    except Exception as err:  # a broken wheel: run with what is installed, and say so
        report.environment.append(f"installing the carried wheels failed: {type(err).__name__}: {err}")
    if os.environ.get("EDGE_GPU_CHECK_WHEELS"):
        report.environment.append(f"installed {os.environ['EDGE_GPU_CHECK_WHEELS']}")
    watchdog = threading.Timer(max(1.0, STARTED + args.budget_s + 25 - time.monotonic()), _fire, args=(report,))
    watchdog.daemon = True
    watchdog.start()
    deadline = Deadline(args.budget_s)
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
