"""Decode scheduler (pure Python, no torch): priority waiting queue, running set, preemption by swap or by
recompute (`SchedulerConfig.preemption_mode`), prefix caching at admission (a prompt's full blocks already in the
pool are taken by reference, see block_manager.py).

Host swap space is bounded (in blocks): with preemption by swap, a preemption that would overflow it does not
happen (a waiter waits) or, when a running sequence must grow, fails the victim (see _preempt_or_fail).
Preemption by recompute needs no swap space: the victim's blocks are freed and its tokens prefilled again.

The model runner receives one `ScheduledStep` per step and carries it out in field order.
"""

from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_gpu.core import fair_share
from decode_gpu.core.block_manager import BlockCopy, BlockManager, prefix_hashes
from decode_gpu.core.sequence import SeqState, Sequence
from decode_gpu.core.step_times import StepTimes

PREEMPTION_MODES = ("swap", "recompute")
OUT_OF_KV = "out of KV memory"  # how a sequence failed for want of blocks begins (load, not a fault)

@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running sequences decoded together each step
    max_import_tokens: int = 8192  # prompt tokens imported from handoffs per step (bounds a step's latency)
    prefix_caching: bool = True  # share full prompt blocks between requests with the same prefix
    # how a preempted sequence gives up its blocks: "swap" copies its KV to host memory; "recompute" frees it and asks
    # for a prefill of its tokens (prompt and output but the newest) at its priority: the engine's owner must send
    # that handoff back (KVHandoff.resume_index)
    preemption_mode: str = "swap"
    # while the request with the most choices (n > 1) decodes beside others at least as important, its choices take no
    # more rows than keep the measured step within this many times the others' own step (fair_share.step_budget);
    # 0: no bound (its share of the slots only). Not 2: a plain 8-token answer beside one n = 32 request also waits
    # for the big request's step under way when it joins, and at 2x a step (86 ms against 43) it took 0.64 s against
    # 0.27 s alone (2.4x), on a CPU where the answer is mostly its steps
    share_step_factor: float = 1.25

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"not {self.preemption_mode!r}")
        if self.share_step_factor and self.share_step_factor < 1:
            raise ValueError(f"share_step_factor must be 0 (off) or at least 1, not {self.share_step_factor}")


@dataclass
class ScheduledStep:
    """The one contract between scheduler and model runner; the scheduler fills every field."""
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)  # (seq, blocks) to copy to host, then reuse
    imports: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # handoff KV to write into blocks
    cached_tokens: dict[str, int] = field(default_factory=dict)  # per import: leading prompt tokens already in the pool
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)  # host copy to restore into new blocks
    copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write before a shared block is written
    decode: list[Sequence] = field(default_factory=list)  # feed each its newest token, sample the next
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # sequences that can never fit, and why
    recompute: list[Sequence] = field(default_factory=list)  # preempted by recompute: their tokens need a prefill


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_swap_blocks: int | None = None,
                 clock=time.monotonic) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[tuple[tuple[int, float, int], Sequence]] = []  # heap by rank: (priority, deadline, arrival)
        self.running: dict[str, Sequence] = {}  # KV in the pool; those in `paused` sit the step out
        # running choices beyond their request's share of the batch (fair_share), as of the last step: they keep their
        # blocks and decode again as other requests end
        self.paused: set[str] = set()
        self.num_preemptions = 0
        self.max_swap_blocks = max_swap_blocks  # host swap space, in pool blocks; None: unbounded
        self.num_swapped_blocks = 0
        self._swapped_this_step: set[str] = set()
        # measured step times per batch size: between two schedule() calls while sequences kept running
        self.step_times = StepTimes()
        self.clock = clock
        # (when the last step was scheduled, its decode batch, whether a prompt was in prefill beside it then)
        self._last_step: tuple[float, int, bool] = (0.0, 0, False)
        # whether a prompt is queued for or in prefill now (the engine sets it from its PriorityGate on a CPU): a step
        # beside prefill runs on half the threads or waits for it, so it says nothing of the curve's shape
        self.beside_prefill: Callable[[], bool] = lambda: False

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences that decode at a step: the running ones less the choices paused beyond their request's share
        (they hold KV but sit the steps out). What the stats report: the gateway reads it as "the engine decodes now"
        (the TTFT predictor's prefill-beside-decoding line) and the status page and gauges show it."""
        return len(self.running.keys() - self.paused)

    @property
    def num_paused(self) -> int:
        """Running choices paused by fair_share as of the last step (their KV stays in the pool)."""
        return len(self.paused & self.running.keys())

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self.waiting, (seq.rank, seq))

    def schedule(self) -> ScheduledStep:
        # The one idea: the running set is the best-ranked (priority, arrival) sequences that fit in the
        # KV pool; each step every running sequence decodes one token. When blocks run out, the worst-ranked
        # running sequence is preempted (swapped out, or freed for a recompute); a strictly higher-priority waiter
        # may preempt lower ones. Within one priority the earliest deadline ranks first (Sequence.rank); a waiter
        # without a TPOT objective joins only while the batch stays within the tightest running objective's measured
        # step time (batch_limit). A request's choices (n > 1) count against its share of the batch when others
        # want slots (fair_share): the choices beyond it are paused, keeping their blocks; where a step's cost grows
        # with its rows, the request with the most choices also takes no more rows than keep the others' step within
        # share_step_factor of their own (fair_share.step_budget).
        self._time_last_step()
        step = ScheduledStep()
        self._swapped_this_step: set[str] = set()
        self._grow_running(step)
        self._admit_waiting(step)
        step.decode = fair_share.choose(list(self.running.values()), self.config.max_num_seqs, self._rows_within)
        self.paused = set(self.running) - {s.seq_id for s in step.decode}
        self._last_step = (self.clock(), len(step.decode), self.beside_prefill())
        return step

    def _rows_within(self, base: int) -> int | None:
        """The largest batch whose measured step stays within share_step_factor of a step of `base` rows (None: no
        bound known, or none asked for)."""
        factor = self.config.share_step_factor
        return self.step_times.rows_within(base, factor) if factor else None

    def _time_last_step(self) -> None:
        """The previous step took from its scheduling until now, for sequences that kept running through it; when
        none did (every one ended, and the engine may have idled since), the interval says nothing. A step that had a
        prompt in prefill beside it (at its start or its end) counts for the times a sequence sees, not for the
        curve's shape that the fair share reads (StepTimes.shape): measured, 2-row steps learned beside a burst's
        prefills let a plain request beside an n = 32 one decode at 13 rows alone, 3x its own step."""
        started, batch, beside = self._last_step
        if batch and self.running:
            now = self.clock()
            self.step_times.record(batch, now - started, now, for_shape=not (beside or self.beside_prefill()))

    def batch_limit(self, joining: Sequence | None = None) -> int:
        """How many sequences may decode together: max_num_seqs, and for a sequence with no TPOT objective of its
        own, no more than the measured step times allow under the tightest TPOT objective among the running ones. A
        sequence with an objective always joins: its first token has gone out with its handoff, so a wait here would
        count in its own time per token (capping those too took the objectives' attainment at 3x overload from 86 %
        to 36 % in bench.slo_bench, docs/benchmarks.md). It bounds growth only: sequences already running are not
        preempted for it."""
        if joining is not None and joining.tpot_slo_ms:
            return self.config.max_num_seqs
        objectives = [s.tpot_slo_ms for s in self.running.values() if s.tpot_slo_ms]
        if not objectives:
            return self.config.max_num_seqs
        return max(1, min(self.config.max_num_seqs, self.step_times.batch_limit(min(objectives) / 1e3, self.clock())))

    @property
    def num_tpot_sequences(self) -> int:
        """Sequences running or waiting with a TPOT objective of their own (they always join the batch)."""
        return sum(1 for s in self.running.values() if s.tpot_slo_ms) + \
            sum(1 for _, s in self.waiting if s.tpot_slo_ms)

    def finish(self, seq: Sequence, reason: str) -> None:
        # an error may be a failed import: the blocks it named may hold garbage, so no later prompt may take them
        self._remove(seq, keep_names=reason != "error")
        seq.state, seq.finish_reason = SeqState.FINISHED, reason

    def abort(self, seq_id: str) -> Sequence | None:
        """Remove a sequence at any stage and free its blocks at once; returns it, or None if unknown."""
        seq = self.running.get(seq_id) or next((s for _, s in self.waiting if s.seq_id == seq_id), None)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def resume(self, seq: Sequence) -> None:
        """A sequence preempted by recompute has its handoff back (seq.handoff): it waits for admission again."""
        if seq.state is not SeqState.RECOMPUTING:
            raise ValueError(f"sequence {seq.seq_id} is {seq.state.value}, not waiting for a recompute")
        seq.state = SeqState.WAITING
        heapq.heappush(self.waiting, (seq.rank, seq))

    def can_swap_out(self, seq: Sequence) -> bool:
        """Does host swap space have room for this running sequence's blocks? (Always, when preempting by
        recompute: nothing is copied.)"""
        if self.max_swap_blocks is None or self.config.preemption_mode == "recompute":
            return True
        return self.num_swapped_blocks + self._holding_kv(seq) <= self.max_swap_blocks

    def _holding_kv(self, seq: Sequence) -> int:
        """How many of a running sequence's blocks hold its KV: the rest are reserved for positions it has not
        written (a draft's, or the next token's), and are not worth copying to host memory."""
        return self.blocks.blocks_for(seq.num_cached)

    def _remove(self, seq: Sequence, keep_names: bool = True) -> None:
        self.paused.discard(seq.seq_id)
        if self.running.pop(seq.seq_id, None) is None:
            self.waiting = [(rank, s) for rank, s in self.waiting if s is not seq]
            heapq.heapify(self.waiting)
        self.blocks.free(seq.seq_id, keep_names)
        self._release_swap(seq)

    def _release_swap(self, seq: Sequence) -> None:
        self.num_swapped_blocks -= seq.num_swapped_blocks
        seq.num_swapped_blocks = 0

    def _victim(self) -> Sequence:
        """The running sequence to preempt first: the worst-ranked paused one (it does not decode anyway), else at the
        worst priority a choice of the request running the most of them (a plain request does not lose its one slot
        to a request with n choices), else the worst-ranked."""
        paused = [s for s in self.running.values() if s.seq_id in self.paused]
        if paused:
            return max(paused, key=lambda s: s.rank)
        counts = collections.Counter(s.request_id for s in self.running.values())
        return max(self.running.values(), key=lambda s: (s.priority, counts[s.request_id], s.rank))

    def _grow_running(self, step: ScheduledStep) -> None:
        for seq in sorted(self.running.values(), key=lambda s: s.rank):
            if seq.seq_id not in self.running:
                continue  # swapped out earlier in this loop
            while not self.blocks.can_append(seq.seq_id, seq.num_cached + 1):
                victim = self._victim()
                self._preempt_or_fail(victim, step)
                if victim is seq:
                    break
            else:
                if copy := self.blocks.append(seq.seq_id, seq.num_cached + 1):
                    step.copies.append(copy)

    def _admit_waiting(self, step: ScheduledStep) -> None:
        import_budget = self.config.max_import_tokens
        passed: list[tuple[tuple[int, float, int], Sequence]] = []  # over their request's share: behind the others
        try:
            self._admit_in_order(step, import_budget, passed)
        finally:
            for item in passed:
                heapq.heappush(self.waiting, item)

    def _admit_in_order(self, step: ScheduledStep, import_budget: int, passed: list) -> None:
        while self.waiting:
            seq = self.waiting[0][1]
            if seq.seq_id in self._swapped_this_step:
                return  # it just lost its blocks; resuming it in the same step would only thrash
            # a waiting sequence imports its handoff: its prompt, or after a recompute its prompt and output
            n_import = seq.handoff.n_tokens if seq.handoff is not None else seq.prompt_len
            need = seq.num_cached + 1 if seq.state is SeqState.SWAPPED else n_import + 1
            need_blocks = self.blocks.blocks_for(need) + len(seq.forks)  # a fork copies the last block at once
            hashes = self._prefix_hashes(seq)
            if need_blocks > self.blocks.num_blocks:
                heapq.heappop(self.waiting)
                self.finish(seq, "error")
                step.failed.append((seq, f"needs {need} KV positions for each of {1 + len(seq.forks)} choices, the "
                                         f"whole pool holds {self.blocks.num_blocks * self.blocks.block_size}"))
                continue
            in_batch = self._fits_batch(seq)
            if in_batch is None:  # its request holds its share and more: the waiters behind it go first
                passed.append(heapq.heappop(self.waiting))
                continue
            fits = self.blocks.can_allocate(need, hashes, extra_blocks=len(seq.forks)) and in_batch
            if not fits:
                if not self._make_room_for(seq, step, gains=in_batch):
                    return
                continue
            if seq.state is SeqState.WAITING:
                if step.imports and n_import > import_budget:
                    return
                import_budget -= n_import
            heapq.heappop(self.waiting)
            blocks, cached = self.blocks.allocate_prefix(seq.seq_id, need, hashes)
            if seq.state is SeqState.SWAPPED:
                step.swap_in.append((seq.seq_id, list(blocks)))
                self._release_swap(seq)
            else:
                step.imports.append((seq, list(blocks)))
                step.cached_tokens[seq.seq_id] = cached
                seq.num_cached = n_import
            seq.state = SeqState.RUNNING
            self.running[seq.seq_id] = seq
            self._fork(seq, step)

    def _preempt_by_recompute(self, victim: Sequence, step: ScheduledStep) -> None:
        """Free the victim's blocks (its prompt's named blocks stay cached, so a recompute may find them) and ask
        for its tokens to be prefilled again; it waits outside the queue until that handoff comes back."""
        self.blocks.free(victim.seq_id)
        del self.running[victim.seq_id]
        self.paused.discard(victim.seq_id)
        victim.state, victim.num_cached = SeqState.RECOMPUTING, 0
        step.recompute.append(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1

    def _prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """The names of a waiting prompt's full blocks; none for a swapped sequence (its blocks come back from
        host memory), without prefix caching, or for a model with sliding-window layers, whose imported blocks
        hold zeros outside the request's own window. Hashed once per handoff: a waiter is looked at every step."""
        handoff = seq.handoff
        if seq.state is not SeqState.WAITING or not self.config.prefix_caching or handoff is None \
                or handoff.layout.swa_layers:
            return []
        # the KV values depend on the handoff's types, and only prompts of one cache salt (one tenant) may share
        salt = f"{handoff.layout.k_dtype}/{handoff.layout.v_dtype}/{handoff.cache_salt}"
        # keyed by what names the tokens (a recompute's handoff holds more of the sequence's tokens than its prompt),
        # not by the handoff itself, which must not outlive its import
        key = (handoff.n_tokens, salt)
        hashed_for, hashes = seq.meta.get("prefix_hashes", (None, []))
        if hashed_for != key:
            hashes = prefix_hashes(handoff.prompt_tokens, self.blocks.block_size, salt)
            seq.meta["prefix_hashes"] = (key, hashes)
        return hashes

    def _fork(self, seq: Sequence, step: ScheduledStep) -> None:
        """n > 1: the other choices share the prompt's blocks (copy-on-write); each copies the block its first
        token goes into, after the import has written it (ScheduledStep's field order)."""
        for child in seq.forks:
            self.blocks.fork(seq.seq_id, child.seq_id)
            if copy := self.blocks.append(child.seq_id, seq.prompt_len + 1):
                step.copies.append(copy)
            child.num_cached, child.state = seq.prompt_len, SeqState.RUNNING
            self.running[child.seq_id] = child
        seq.forks = []

    def _fits_batch(self, seq: Sequence) -> bool | None:
        """Whether the waiter (with its forks) may join the batch: within the batch limit, or, past it, when its
        request gains a slot by its share (fair_share; the choices beyond the shares are then paused). False: it
        waits, and so do the waiters behind it (a full batch); None: another choice of its request already holds its
        share, so the waiters behind it may go first."""
        choices, limit = 1 + len(seq.forks), self.batch_limit(seq)
        if len(self.running) + choices <= max(choices, limit):
            return True
        if fair_share.gains_slot(self.running.values(), seq, limit):
            return True
        others = any(s.request_id == seq.request_id for s in self.running.values())
        return None if others else False

    def _make_room_for(self, seq: Sequence, step: ScheduledStep, gains: bool = False) -> bool:
        """Preempt the worst running sequence if it has strictly lower priority than the waiter, or if it is paused
        and the waiter gains a slot by its share (gains). With swap space full (preemption by swap) the waiter waits
        instead: it loses time, nobody loses a request."""
        if not self.running:
            return False
        victim = self._victim()
        outranked = victim.priority > seq.priority or gains and victim.seq_id in self.paused
        if not outranked or not self.can_swap_out(victim):
            return False
        self._preempt(victim, step)
        return True

    def _preempt_or_fail(self, victim: Sequence, step: ScheduledStep) -> None:
        """A running sequence needs a block and none is free. Without room in swap space (preemption by swap; by
        recompute there is always room) the victim fails: swap mode does not fall back to a recompute, and letting
        the grower sit out instead would not guarantee progress (every running sequence may be waiting for a block)
        while lower-ranked ones kept taking freed blocks. Failing the worst-ranked sequence frees its blocks at once
        and tells its client why."""
        if self.can_swap_out(victim):
            self._preempt(victim, step)
            return
        swap = "no swap space" if not self.max_swap_blocks else "swap space is full"
        self.finish(victim, "error")
        step.failed.append((victim, f"{OUT_OF_KV}: the pool is full and {swap} for a preempted request "
                                    f"(--swap-space-gib)"))

    def _preempt(self, victim: Sequence, step: ScheduledStep) -> None:
        if self.config.preemption_mode == "recompute":
            self._preempt_by_recompute(victim, step)
            return
        blocks = self.blocks.block_tables[victim.seq_id][:self._holding_kv(victim)]
        step.swap_out.append((victim.seq_id, list(blocks)))
        victim.num_swapped_blocks = len(blocks)
        self.num_swapped_blocks += len(blocks)
        self.blocks.free(victim.seq_id)
        del self.running[victim.seq_id]
        self.paused.discard(victim.seq_id)
        victim.state = SeqState.SWAPPED
        self._swapped_this_step.add(victim.seq_id)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        heapq.heappush(self.waiting, (victim.rank, victim))
