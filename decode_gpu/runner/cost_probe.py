"""Speculative decoding's start-up cost model: what a plain step and a verify step cost by rows fed, measured on the
model runner's own forward and verify before any request (or read from the record of an earlier quiet start).

The engine corrects the model by its real steps from then on (core.speculative.LiveCosts); this module only times
forwards of dummy sequences (Probe) through the runner, which stays the owner of every device tensor involved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from contracts.cache import write_record
from decode_gpu.core.speculative import StepCosts, measurement_rows
from decode_gpu.model.plan_record import measurement_window as _window  # a module name of its own: tests replace it

if TYPE_CHECKING:
    from decode_gpu.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)
COST_CONTEXT = 256  # the context of the dummy sequences speculative decoding's cost model is measured on
PROBE_BUDGET_S = 3.0  # the start-up probe of that cost model: rounds past this are left out


@dataclass
class Probe:
    """A dummy sequence for measuring a step (what forward and verify read of a Sequence)."""
    seq_id: str
    tokens: list[int]
    num_cached: int
    priority: int = 0

    @property
    def decode_priority(self) -> float:
        """The level the priority gate holds it by (Sequence.decode_priority): its priority."""
        return float(self.priority)


def step_costs(runner: ModelRunner, max_num_seqs: int, num_draft: int, reps: int, budget_s: float,
               record: Path | None) -> StepCosts:
    """The one recorded in `record` by an earlier quiet start if there is one, else runner.measure_step_costs, recorded
    there when nothing else used the CPU through it (contracts/cpu_window.py)."""
    if record is not None and record.is_file():
        try:
            costs = StepCosts.from_json(record.read_text())
            log.info("speculative decoding's cost model recorded by a quiet start (%s): %s", record, costs.describe())
            return costs
        except (ValueError, KeyError, TypeError) as err:
            log.warning("ignoring the recorded cost model %s: %s", record, err)
    window = _window()
    costs = runner.measure_step_costs(max_num_seqs, num_draft, reps, budget_s)
    if record is not None and window.quiet():
        write_record(record, costs.to_json())
        log.info("recorded the cost model in %s (a quiet start): later starts reuse it", record)
    elif record is not None:
        log.info("speculation's cost model measured on a busy machine (%s): used, not recorded; a quiet start "
                 "records one", window.describe())
    return costs


def cost_record_key(runner: ModelRunner, max_num_seqs: int, num_draft: int) -> str:
    """What a recorded cost model must match: weights, device, threads, batch limits."""
    from decode_gpu.model.weight_quant import held_weight_dtype
    held = held_weight_dtype(runner.model).replace(" ", "_").replace("(", "").replace(")", "")
    return (f"{runner.device.type}-{held}-{runner.forward_name}-t{torch.get_num_threads()}-s{max_num_seqs}-"
            f"k{num_draft}-{runner.pool.shape.storage}")


@torch.inference_mode()
def measure_step_costs(runner: ModelRunner, max_num_seqs: int, num_draft: int, reps: int,
                       budget_s: float) -> StepCosts:
    """Dummy sequences of COST_CONTEXT tokens (fewer when the pool is small) write into the pool's blocks, which
    nothing holds yet; a verify of r rows feeds 1 + num_draft tokens per sequence. Each point is the median of up to
    `reps` forwards after a warm-up, taken in rounds over every point, so that a burst of other work on the machine
    (a prefill worker starting on the same cores) lands on all of them alike rather than on a few; as many rounds as
    fit in budget_s (at least one)."""
    bs, num_blocks = runner.pool.shape.block_size, runner.num_blocks
    limit = max_num_seqs * (1 + num_draft)
    per_seq = max(1, min(-(-(COST_CONTEXT + 1 + num_draft) // bs), num_blocks // max_num_seqs,
                         -(-runner.config.max_model_len // bs)))
    # within max_model_len too: the rotary table and the block tables end there
    context = max(1, min(per_seq * bs, runner.config.max_model_len) - 1 - num_draft)

    def probes(n: int) -> tuple[list[Probe], dict[str, list[int]]]:
        seqs = [Probe(str(i), [0] * (context + 1 + num_draft), context) for i in range(n)]
        return seqs, {p.seq_id: [(i * per_seq + b) % num_blocks for b in range(per_seq)] for i, p in enumerate(seqs)}

    def plain(rows: int):
        seqs, tables = probes(rows)
        return lambda: runner.forward(seqs, tables)

    def verify(rows: int, n: int | None = None):
        """rows fed by n sequences (by default as few as can feed them), all but the last as many as can"""
        seqs, tables = probes(n or -(-rows // (1 + num_draft)))
        width = -(-rows // len(seqs))
        drafts = [[0] * (width - 1) for _ in seqs]
        drafts[-1] = drafts[-1][:rows - 1 - (len(seqs) - 1) * width]
        return lambda: runner.verify(seqs, tables, drafts)

    started = time.perf_counter()
    plain_rows, verify_rows = measurement_rows(max_num_seqs), [r for r in measurement_rows(limit) if r > 1]
    # what a sequence more costs: 2 rows a sequence against 1 + num_draft, for the same rows
    many = min(max_num_seqs, limit // 2)
    few = -(-2 * many // (1 + num_draft))
    # fewest rows first (what small batches plan with), the two kinds side by side: a budget spent early leaves
    # out the largest counts, which the model extrapolates
    keys = sorted([("plain", r) for r in plain_rows] + [("verify", r) for r in verify_rows], key=lambda k: k[1])
    points = {key: plain(key[1]) if key[0] == "plain" else verify(key[1]) for key in keys}
    if many > few:
        points |= {("many", 2 * many): verify(2 * many, many), ("few", 2 * many): verify(2 * many)}
    ms = median_ms(points, runner.device, reps, budget_s)
    seq_ms = max(0.0, (ms["many", 2 * many] - ms["few", 2 * many]) / (many - few)) \
        if ("few", 2 * many) in ms else 0.0
    plain_ms = tuple((r, ms["plain", r]) for r in plain_rows if ("plain", r) in ms)
    verify_ms = tuple((r, ms["verify", r]) for r in verify_rows if ("verify", r) in ms)
    if len(verify_ms) == 1:  # the budget spent early: past its one point, verify grows as the plain step does
        (r0, ms0), shape = verify_ms[0], StepCosts(plain_ms, verify_ms)
        verify_ms += ((2 * r0, ms0 * shape.plain_ms(2 * r0) / shape.plain_ms(r0)),)
    costs = StepCosts(plain_ms, verify_ms, 1 + num_draft, seq_ms)
    log.info("speculative decoding's cost model, ms by rows fed (context %d), measured in %.1f s: %s", context,
             time.perf_counter() - started, costs.describe())
    return costs


def median_ms(forwards: dict, device: torch.device, reps: int, budget_s: float = float("inf"),
              needed: tuple[str, ...] = ("plain", "verify")) -> dict:
    """The median ms of each forward over up to `reps` rounds that run every forward once, as many rounds as fit
    in budget_s: what a step in a run of many costs (the best of them would be optimistic). In the first round
    each forward is warmed up right before it is timed (packing, kernel selection, Triton's compiles), and the
    round stops at the budget once one forward of each `needed` kind (a key's first element) is timed: those
    not reached are left out of the answer, so a slow machine (a CPU hog) keeps the probe within the budget."""
    times: dict = {key: [] for key in forwards}
    began = time.perf_counter()
    for rep in range(reps):
        if rep and (time.perf_counter() - began) * (rep + 1) / rep > budget_s:
            break  # another round would overrun the budget
        for key, forward in forwards.items():
            if rep == 0 and time.perf_counter() - began > budget_s and \
                    {k[0] for k, t in times.items() if t} >= set(needed):
                break
            if rep == 0:
                _timed(forward, device)  # the warm-up
            elif not times[key]:
                continue  # not reached in the first round
            times[key].append(_timed(forward, device))
    return {key: sorted(t)[len(t) // 2] * 1e3 for key, t in times.items() if t}


def _timed(forward, device: torch.device) -> float:
    started = time.perf_counter()
    forward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
