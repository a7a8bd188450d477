"""weight_dtype = auto on a CPU: the weight plan a quiet start measured, recorded beside the model's converted weights
and reused by later starts with the same settings, as speculation's cost model is (docs/decode.md, "Decisions
measured while serving").

A start on a busy machine measures the quantized kernels slower than they are (ggml's threads spin against the other
work) and would hold float weights for the day; two starts would choose two plans, and greedy answers would differ
between them. So a start measures only when no record fits, records only when nothing else used the CPU through
the measurement (contracts/cpu_window.py), and a start that reuses a record builds the chosen layers without timing
anything. The record holds the decision, not weights.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from contracts.cache import write_record
from contracts.cpu_window import CpuWindow, load_average
from decode_gpu.model.weight_plan import GGUFWeightTypes, WeightPlan, auto_weight_plan, cpu_kinds

log = logging.getLogger(__name__)

RECORDS = "weight_plan"  # the folder of records in the model's converted_dir


def cpu_weight_plan(identity, types: GGUFWeightTypes, model: nn.Module, dtype: torch.dtype,
                    max_batch: int) -> WeightPlan:
    """auto's plan on the CPU: the one a quiet start recorded for this model and these settings if there is one,
    else a measurement (auto_weight_plan), recorded when the machine was quiet through it. A model without a GGUF
    file on disk (tests' synthetic ones) neither reads nor records one."""
    settings = plan_settings(dtype, max_batch, cpu_kinds(types))
    path = record_path(identity, settings)
    recorded = read_plan(path, settings) if path is not None else None
    if recorded is not None:
        return recorded
    window = measurement_window()
    plan = auto_weight_plan(torch.device("cpu"), types, model, max_batch)
    if path is not None and window.quiet():
        write_plan(path, plan, settings, window)
    elif path is not None:
        log.info("weight plan measured on a busy machine (%s): used, not recorded; a quiet start records one",
                 window.describe())
    return plan


def plan_settings(dtype: torch.dtype, max_batch: int, kinds: tuple[str, ...]) -> dict:
    """What a recorded plan must match: the CPU's kernels (ISA, threads, torch), the compute dtype, the batch sizes
    measured and the kinds measured. Deterministic decoding is not among them: it drops the float weights of the
    plan afterwards (load_weights), from a recorded plan as from a measured one."""
    return {"device": "cpu", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."), "max_batch": max_batch, "kinds": list(kinds)}


def record_path(identity, settings: dict) -> Path | None:
    """<cache>/converted/<fingerprint>/weight_plan/<settings>.json; None without a GGUF file on disk. The torch
    version is not in the name: a record from another version is found, found not to match, and replaced."""
    if not os.path.isfile(identity.path):
        return None
    from contracts.cache import converted_dir
    key = (f"{settings['device']}-{settings['cpu_capability']}-t{settings['threads']}-{settings['dtype']}-"
           f"b{settings['max_batch']}-{'+'.join(settings['kinds'])}")
    return converted_dir(identity) / RECORDS / f"{key}.json"


def read_plan(path: Path, settings: dict) -> WeightPlan | None:
    """The plan recorded in `path` for `settings`; None (with a warning) for a record that does not parse or does
    not match them, and without a record."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        plan = _plan(record, settings, path)
    except (ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the recorded weight plan %s: %s; measuring again", path, err)
        return None
    log.info("weight plan recorded by a quiet start (%s): %s", path, _describe(plan))
    return plan


def _plan(record: dict, settings: dict, path: Path) -> WeightPlan:
    """The WeightPlan a record holds, checked against `settings` (ValueError where it does not fit them)."""
    if record["settings"] != settings:
        raise ValueError(f"recorded for {record['settings']}, not {settings}")
    kind, float_above, head_int8 = record["weight_dtype"], record["float_above"], record["head_int8"]
    if kind not in (*settings["kinds"], "float"):
        raise ValueError(f"weight_dtype {kind!r} is none of the kinds measured, {settings['kinds']}")
    if float_above is not None and (kind == "float" or type(float_above) is not int
                                    or not 1 <= float_above < settings["max_batch"]):
        raise ValueError(f"float_above {float_above!r} does not fit {kind} up to batch {settings['max_batch']}")
    if type(head_int8) is not bool:
        raise ValueError(f"head_int8 {head_int8!r} is not a boolean")
    why = f"recorded by a quiet start at {record['recorded_at']} ({path.name}): {record['why']}"
    return WeightPlan(kind, why, float_above, head_int8=head_int8)


def write_plan(path: Path, plan: WeightPlan, settings: dict, window: CpuWindow | None = None) -> None:
    """Record the plan's decision (not its layers) in `path`: written whole to a partial file, then moved there, so
    a start reading it meanwhile finds the old record or the new one."""
    record = {"settings": settings, "weight_dtype": plan.weight_dtype, "float_above": plan.float_above,
              "head_int8": plan.head_int8, "why": plan.why, "load_average": load_average(), "cores": os.cpu_count(),
              "others_cores": None if window is None else window.others_cores(),
              "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_record(path, json.dumps(record, indent=1))
    log.info("recorded the weight plan in %s (a quiet start): later starts reuse it: %s", path, _describe(plan))


def _describe(plan: WeightPlan) -> str:
    above = "" if plan.float_above is None else f" up to batch {plan.float_above}, float above"
    return f"{plan.weight_dtype}{above}"


def measurement_window() -> CpuWindow:
    """Opened before a measurement whose result may be recorded; its quiet() says whether to record it (also what
    speculation's probe asks before it records its cost model, runner/cost_probe.py). Tests replace it."""
    return CpuWindow()
