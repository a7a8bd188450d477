"""The GPU check's report: the stages run and their results, the benchmark table, and the result block it
writes into a markdown file (docs/gpu.md), replacing the previous block and keeping the prose around it."""

from __future__ import annotations

import datetime
import os
import threading
import time
import traceback

BEGIN, END = "<!-- gpu-check:begin", "<!-- gpu-check:end -->"
COLUMNS = ["model", "batch", "context", "ours ms/step", "ours tok/s", "GB read/step", "floor ms", "% of floor",
           "generate ms/step", "generate_batch ms/step", "generate_batch ÷ ours"]


class Deadline:
    """The global deadline, counted from the process start (before a wheels re-exec, if any)."""

    def __init__(self, started: float, budget_s: float) -> None:
        self.end = started + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


class Report:
    """What the run measured so far; `finish` renders it once (from the main thread or the watchdog)."""

    def __init__(self, command: str, out: str | None, started: float) -> None:
        self.command, self.out, self.started = command, out, started
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
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        lines = [f"{BEGIN} (written by checks/gpu_check.py; replaced up to gpu-check:end on each run) -->",
                 "## Results", "", f"`{self.command}` on {now}, {time.monotonic() - self.started:.0f} s in all.", ""]
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
