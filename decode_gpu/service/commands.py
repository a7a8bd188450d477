"""What the asyncio side asks of the engine thread: one frozen dataclass per kind, queued in arrival order and
applied between two steps (decode_gpu.service.engine_loop), because only the engine thread may touch the engine."""

from __future__ import annotations

from dataclasses import dataclass

from contracts.handoff import KVHandoff
from decode_gpu.core.sequence import Sequence


@dataclass(frozen=True)
class Admit:
    """An opened request (its first tokens already sent) joins the engine."""
    seq: Sequence  # the first choice that goes on; the others are its forks


@dataclass(frozen=True)
class Resume:
    """A recompute came back: the preempted choice waits for admission again."""
    handoff: KVHandoff


@dataclass(frozen=True)
class AbortRequest:
    """End a request at any stage; with `error`, as failed, saying why."""
    request_id: str
    error: str | None = None


@dataclass(frozen=True)
class SetSpeculation:
    """Speculative decoding off (a policy under load) or back on."""
    enabled: bool


Command = Admit | Resume | AbortRequest | SetSpeculation
