"""Decode steps yield the CPU to a more important prompt in prefill, or to a peer's (decode_gpu.core.priority_gate
says why and when)."""

from __future__ import annotations

import dataclasses

from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.core.scheduler import ScheduledStep


def yield_to_prefill(step: ScheduledStep, gate: PriorityGate | None) -> ScheduledStep:
    """While a more important prompt is in prefill (CPU boxes), the sequences it outranks sit this step out,
    keeping their blocks; if it outranks all of them, the forward itself waits between layers."""
    if gate is None:
        return step
    urgent = [seq for seq in step.decode if not gate.outranks(seq.decode_priority)]
    if not urgent or len(urgent) == len(step.decode):
        return step
    return dataclasses.replace(step, decode=urgent)
