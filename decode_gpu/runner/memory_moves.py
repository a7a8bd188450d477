"""A step's memory moves on the paged pool, part of the model runner (the only owner of device tensors).

`prepare` carries them out in a ScheduledStep's field order: swaps out to host memory, handoff imports, swaps in,
copies on write. It moves one sequence at a time, so that one sequence's bad bytes (or a failed copy) fail only
that sequence: its blocks then hold garbage that no other sequence reads, and the engine fails it and frees them.
"""

from __future__ import annotations

import logging

import torch

from contracts.identity import GGUFIdentity
from decode_gpu.core.scheduler import ScheduledStep
from decode_gpu.core.sequence import Sequence
from decode_gpu.kv.importer import import_handoff
from decode_gpu.kv.pool import KVPool, device_index

log = logging.getLogger(__name__)


class PagedKVWriter:
    """KVWriter that lands an imported handoff directly in the sequence's pool blocks."""

    def __init__(self, pool: KVPool, blocks: list[int], n_tokens: int, device: torch.device, start: int = 0) -> None:
        """Rows written land at positions start..n_tokens-1 (the earlier ones are a cached prefix)."""
        bs = pool.shape.block_size
        positions = torch.arange(start, n_tokens)
        self.slots = device_index((torch.tensor(blocks)[positions // bs] * bs + positions % bs), device)  # [n_tokens]
        self.pool = pool

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.pool.write(layer, self.slots, keys, values)


class MemoryMoves:
    """The moves of a step between the pool, host memory and handoffs; the host copies of swapped-out blocks."""

    def __init__(self, pool: KVPool, identity: GGUFIdentity, device: torch.device) -> None:
        self.pool = pool
        self.identity = identity
        self.device = device
        self.swap_space: dict[str, list[torch.Tensor]] = {}  # host copies of preempted sequences' blocks

    @torch.inference_mode()
    def prepare(self, step: ScheduledStep) -> list[tuple[str, str]]:
        """The step's memory moves; returns (seq id, why) for each sequence whose own move failed."""
        failed: list[tuple[str, str]] = []
        for seq_id, blocks in step.swap_out:
            _attempt(failed, seq_id, "swapping out its KV", self._swap_out, seq_id, blocks)
        for seq, blocks in step.imports:
            _attempt(failed, seq.seq_id, "importing its KV handoff", self._import, seq, blocks,
                     step.cached_tokens.get(seq.seq_id, 0))
        for seq_id, blocks in step.swap_in:
            _attempt(failed, seq_id, "swapping in its KV", self._swap_in, seq_id, blocks)
        for copy in step.copies:
            self.pool.copy_blocks(copy.src, copy.dst)
        return failed

    def forget(self, seq_id: str) -> None:
        """Drop host swap space of an aborted or failed sequence."""
        self.swap_space.pop(seq_id, None)

    def _swap_out(self, seq_id: str, blocks: list[int]) -> None:
        self.swap_space[seq_id] = self.pool.read_blocks(blocks)

    def _import(self, seq: Sequence, blocks: list[int], cached: int) -> None:
        """Write the handoff's KV after its first `cached` positions, which the pool holds already."""
        writer = PagedKVWriter(self.pool, blocks, seq.handoff.n_tokens, self.device, start=cached)
        import_handoff(seq.handoff, self.identity, writer, self.device, start=cached)

    def _swap_in(self, seq_id: str, blocks: list[int]) -> None:
        saved = self.swap_space.pop(seq_id)
        # it left with the blocks holding its KV (Scheduler._holding_kv) and comes back with room for its next token
        # too, which may be a block more
        n = min(len(blocks), saved[0].shape[0])
        self.pool.write_blocks(blocks[:n], [rows[:n] for rows in saved])


def _attempt(failed: list[tuple[str, str]], seq_id: str, what: str, action, *args) -> None:
    try:
        action(*args)
    except Exception as err:  # a bad payload or a failed copy of one sequence: that sequence fails, not the step
        log.exception("request %s failed %s", seq_id, what)
        failed.append((seq_id, f"{what} failed: {type(err).__name__}: {err}"))
