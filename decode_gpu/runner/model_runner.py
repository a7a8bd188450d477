"""The model runner: the only owner of device tensors (model weights, the paged KV pool, the step inputs).

It carries out a ScheduledStep in field order: `prepare` swaps out, imports handoffs, swaps in and
copies on write, one sequence at a time, so that one sequence's bad bytes fail only that sequence; then
`forward` runs one batched forward for every decoding sequence, returning their next-token logits
(`verify` instead, when some sequences feed draft tokens too: speculative decoding).

The forward is static: its inputs live in persistent buffers filled with one host-to-device copy
(step_inputs.py), nothing in it reads back to the host, and on CUDA it replays a captured graph per
batch-size bucket (cuda_graphs.py) unless `enforce_eager`. Between two decoder layers an eager forward
may wait on a PriorityGate, to give the CPU to a more important prefill; with graphs the wait is between
steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from contracts.cache import write_record
from contracts.handoff import SamplingParams
from contracts.identity import GGUFIdentity
from decode_gpu.attention.backend import resolve_backend
from decode_gpu.attention.paged_attention import use_paged_attention
from decode_gpu.attention.paged_batch import build_paged_batch
from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.core.scheduler import ScheduledStep
from decode_gpu.core.sequence import Sequence
from decode_gpu.core.speculative import StepCosts, measurement_rows
from decode_gpu.core.step_times import ALONE, EVERY, HALVED, ThreadShare
from decode_gpu.kv.importer import import_handoff
from decode_gpu.kv.pool import KVPool, PoolShape, device_index
from decode_gpu.model.native_decoder import NativeDecoder, resolve_forward
from decode_gpu.model.plan_record import measurement_window as _window  # a module name of its own: tests replace it
from decode_gpu.model.quantized_linear import QuantizedLinear
from decode_gpu.runner.cuda_graphs import DecodeGraphs, graph_buckets
from decode_gpu.runner.kv_sizing import MemoryProfile, kv_budget_bytes
from decode_gpu.runner.step_inputs import StepInputs
from decode_gpu.runner.weight_switch import WeightSwitch
from sampling.sampler import sample_rows
from sampling.sampling_params import SamplingBatch, SamplingRow

log = logging.getLogger(__name__)
PROFILE_LOGPROBS = 20  # the profiling forward samples with this many top logprobs, OpenAI's maximum
COST_CONTEXT = 256  # the context of the dummy sequences speculative decoding's cost model is measured on
PROBE_BUDGET_S = 3.0  # the start-up probe of that cost model: rounds past this are left out


@dataclass
class _Probe:
    """A dummy sequence for measuring a step (what forward and verify read of a Sequence)."""
    seq_id: str
    tokens: list[int]
    num_cached: int
    priority: int = 0


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int = 16
    kv_storage: str = "auto"  # float32 | float16 | bfloat16 | int8 | int4; auto: the model's dtype
    kv_cache_tokens: int | None = None  # pool size in tokens (takes precedence)
    kv_cache_bytes: int | None = None  # pool size in bytes
    gpu_memory_utilization: float = 0.9  # on CUDA without an explicit size: this fraction of total memory
    cpu_default_tokens: int = 16384  # on the CPU without an explicit size
    max_num_seqs: int = 32  # the largest batch: step inputs, CUDA graph buckets and the profiling forward
    max_model_len: int = 4096  # the longest context: block table width and the graphs' KV splits
    enforce_eager: bool = False  # no CUDA graphs
    # native: our own decoder forward (decode_gpu.model.native_decoder); transformers: the model's own forward with
    # the paged attention plugged in (kept for the comparison); None: EDGE_DECODE_FORWARD, else native
    forward: str | None = None
    # a sequence's logits independent of the batch: matmuls on fixed row blocks, each sequence attended on its own,
    # fixed KV splits (docs/decode.md, "Reproducible numerics"); native forward only
    deterministic: bool = False
    # draft tokens a sequence may feed per step: the profiling forward samples that many more rows
    num_speculative_tokens: int = 0


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


class ModelRunner:
    def __init__(self, model: nn.Module, identity: GGUFIdentity, config: RunnerConfig,
                 device: torch.device, gate: PriorityGate | None = None) -> None:
        self.model = model
        self.identity = identity
        self.config = config
        self.device = device
        self.gate = gate
        self.backend = resolve_backend(device)
        self.forward_name = resolve_forward(config.forward)
        # the native forward reads the model's own modules (no weight copies) and leaves the model as it is; its
        # rotary table covers max_model_len
        self.native = NativeDecoder(model, config.max_model_len, config.deterministic) \
            if self.forward_name == "native" else None
        if config.deterministic and self.native is None:
            raise ValueError("deterministic decoding needs the native forward, not the transformers one")
        if self.native is None:
            use_paged_attention(model)
        storage = _storage_name(model.dtype) if config.kv_storage == "auto" else config.kv_storage
        self._shape = PoolShape(identity.n_layer, 2, config.block_size, identity.num_kv_heads, identity.head_dim_k,
                                storage)  # num_blocks replaced below
        use_graphs = device.type == "cuda" and self.backend == "triton" and not config.enforce_eager
        self._buckets = graph_buckets(config.max_num_seqs) if use_graphs else []
        capacity = max([config.max_num_seqs, *self._buckets])
        self._max_blocks = -(-config.max_model_len // config.block_size)
        blocks = self._budget_blocks(config, capacity)
        # one block more than the budget: the scratch block, which padded batch rows write and no sequence owns
        self.pool = KVPool(dataclasses.replace(self._shape, num_blocks=blocks + 1), device)
        self.inputs = StepInputs(self.pool, blocks, capacity, self._max_blocks, device, self.backend,
                                 config.deterministic)
        self._batch_priority = 0  # the best priority in the batch being decoded
        self.graphs = None
        if use_graphs:
            self.graphs = DecodeGraphs(self._buckets, self._forward_rows, self._pad)
            self.graphs.capture()
            self._graphs_generation = self.inputs.generation  # the buffers the graphs read
        elif gate is not None and gate.enabled:
            if self.native is not None:
                self.native.between_layers = self._wait_turn
            else:
                for layer in model.model.layers:  # the decoder layers of every supported family (docs/models.md)
                    layer.register_forward_pre_hook(self._between_layers)
        self.weight_switch = self._weight_switch(model, capacity)
        self.swap_space: dict[str, list[torch.Tensor]] = {}  # host copies of preempted sequences' blocks
        self._threads = _shared_threads(device, gate)
        # which thread count keeps a TPOT objective beside prefill, from the steps measured with each
        self.thread_share = ThreadShare() if self._threads else None
        self._last_forward: tuple[float, int, str, frozenset[str]] | None = None  # (when, batch, mode, seq ids)
        self.clock = time.monotonic

    @property
    def shares_cpu(self) -> bool:
        """Whether this runner halves its threads while a prompt is in prefill (decode on the CPU, yielding; a batch
        with a TPOT objective may keep them all, see _set_threads)."""
        return self._threads is not None

    @property
    def num_blocks(self) -> int:
        """Blocks sequences may own (the scratch block is not one of them)."""
        return self.pool.shape.num_blocks - 1

    @torch.inference_mode()
    def prepare(self, step: ScheduledStep) -> list[tuple[str, str]]:
        """The step's memory moves; returns (seq id, why) for each sequence whose own move failed. Its
        blocks then hold garbage that no other sequence reads: the engine fails it and frees them."""
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

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], block_tables: dict[str, list[int]]) -> torch.Tensor:
        """Next-token logits for seqs, in order. # [len(seqs), vocab] float32"""
        n = len(seqs)
        self._before_forward(seqs)
        rows = self.graphs.bucket_for(n) if self.graphs else None
        longest = self.inputs.fill(seqs, [block_tables[s.seq_id] for s in seqs], rows or n)
        if self.graphs and self.inputs.generation != self._graphs_generation:
            log.warning("decode step inputs were reallocated for a batch of %d (max_num_seqs %d, max_model_len "
                        "%d): CUDA graphs off from now on", n, self.config.max_num_seqs, self.config.max_model_len)
            self.graphs = rows = None
        if rows is None:
            return self._switched(n, lambda: self._forward_rows(n, longest))
        if self.gate is not None and self.gate.enabled:
            self.gate.wait_turn(self._batch_priority)  # a graph replays no hook: wait between steps
        return self.graphs.replay(rows)[:n]

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], block_tables: dict[str, list[int]],
               drafts: list[list[int]]) -> torch.Tensor:
        """Logits at every fed position: each sequence feeds its newest token, then its draft tokens, as one ragged
        multi-token query (eager: the captured graphs are for one token per sequence). Positions past what is
        accepted later hold stale K/V that no context length reaches; the next step overwrites them.
        # [sum(1 + len(draft)), vocab] float32"""
        self._before_forward(seqs)
        fed = [[seq.tokens[seq.num_cached], *draft] for seq, draft in zip(seqs, drafts)]
        positions = [p for seq, ids in zip(seqs, fed) for p in range(seq.num_cached, seq.num_cached + len(ids))]
        paged = build_paged_batch(self.pool, [block_tables[s.seq_id] for s in seqs],
                                  [seq.num_cached + len(ids) for seq, ids in zip(seqs, fed)], list(map(len, fed)),
                                  self.device, self.backend, deterministic=self.config.deterministic)
        # one host-to-device copy for ids and positions, before the forward
        ids_and_positions = torch.tensor([[t for ids in fed for t in ids], positions]).to(self.device)  # [2, n_fed]
        return self._switched(len(positions),
                              lambda: self._model_forward(ids_and_positions[0], ids_and_positions[1], paged))

    def step_costs(self, max_num_seqs: int, num_draft: int, reps: int = 5, budget_s: float = PROBE_BUDGET_S,
                   record: Path | None = None) -> StepCosts:
        """Speculation's start-up cost model: the one recorded in `record` by an earlier quiet start of the same
        model, weights, device, threads and batch limits if there is one, else a probe (measure_step_costs) within
        about budget_s, recorded there when nothing else used the CPU through it (contracts/cpu_window.py).
        The engine corrects it by its real steps from then on (core.speculative.LiveCosts)."""
        if record is not None and record.is_file():
            try:
                costs = StepCosts.from_json(record.read_text())
                log.info("speculative decoding's cost model recorded by a quiet start (%s): %s", record,
                         costs.describe())
                return costs
            except (ValueError, KeyError, TypeError) as err:
                log.warning("ignoring the recorded cost model %s: %s", record, err)
        window = _window()
        costs = self.measure_step_costs(max_num_seqs, num_draft, reps, budget_s)
        if record is not None and window.quiet():
            write_record(record, costs.to_json())
            log.info("recorded the cost model in %s (a quiet start): later starts reuse it", record)
        elif record is not None:
            log.info("speculation's cost model measured on a busy machine (%s): used, not recorded; a quiet start "
                     "records one", window.describe())
        return costs

    def cost_record_key(self, max_num_seqs: int, num_draft: int) -> str:
        """What a recorded cost model must match: weights, device, threads, batch limits."""
        from decode_gpu.model.weight_quant import held_weight_dtype
        held = held_weight_dtype(self.model).replace(" ", "_").replace("(", "").replace(")", "")
        return (f"{self.device.type}-{held}-{self.forward_name}-t{torch.get_num_threads()}-s{max_num_seqs}-"
                f"k{num_draft}-{self.pool.shape.storage}")

    @torch.inference_mode()
    def measure_step_costs(self, max_num_seqs: int, num_draft: int, reps: int = 5,
                           budget_s: float = PROBE_BUDGET_S) -> StepCosts:
        """What a plain step and a verify step cost by rows fed (speculative decoding plans its drafts with it),
        measured before any request: dummy sequences of COST_CONTEXT tokens (fewer when the pool is small) write
        into the pool's blocks, which nothing holds yet; a verify of r rows feeds 1 + num_draft tokens per
        sequence. Each point is the median of up to `reps` forwards after a warm-up, taken in rounds over every
        point, so that a burst of other work on the machine (a prefill worker starting on the same cores) lands on
        all of them alike rather than on a few; as many rounds as fit in budget_s (at least one)."""
        bs = self.pool.shape.block_size
        limit = max_num_seqs * (1 + num_draft)
        per_seq = max(1, min(-(-(COST_CONTEXT + 1 + num_draft) // bs), self.num_blocks // max_num_seqs,
                             self._max_blocks))
        # within max_model_len too: the rotary table and the block tables end there
        context = max(1, min(per_seq * bs, self.config.max_model_len) - 1 - num_draft)

        def probes(n: int) -> tuple[list[_Probe], dict[str, list[int]]]:
            seqs = [_Probe(str(i), [0] * (context + 1 + num_draft), context) for i in range(n)]
            return seqs, {p.seq_id: [(i * per_seq + b) % self.num_blocks for b in range(per_seq)]
                          for i, p in enumerate(seqs)}

        def plain(rows: int):
            seqs, tables = probes(rows)
            return lambda: self.forward(seqs, tables)

        def verify(rows: int, n: int | None = None):
            """rows fed by n sequences (by default as few as can feed them), all but the last as many as can"""
            seqs, tables = probes(n or -(-rows // (1 + num_draft)))
            width = -(-rows // len(seqs))
            drafts = [[0] * (width - 1) for _ in seqs]
            drafts[-1] = drafts[-1][:rows - 1 - (len(seqs) - 1) * width]
            return lambda: self.verify(seqs, tables, drafts)

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
        ms = self._median_ms(points, reps, budget_s)
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

    def _median_ms(self, forwards: dict, reps: int, budget_s: float = float("inf"),
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
                    self._timed(forward)  # the warm-up
                elif not times[key]:
                    continue  # not reached in the first round
                times[key].append(self._timed(forward))
        return {key: sorted(t)[len(t) // 2] * 1e3 for key, t in times.items() if t}

    def _timed(self, forward) -> float:
        started = time.perf_counter()
        forward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _before_forward(self, seqs: list[Sequence]) -> None:
        """Thread count (decode on the CPU next to llama.cpp prefill) and the priority the gate waits with."""
        if self._threads:
            self._set_threads(seqs)
        self._batch_priority = min(s.priority for s in seqs)

    def _set_threads(self, seqs: list[Sequence]) -> None:
        """Halve the threads while a prompt is queued for or in prefill, unless the batch's tightest TPOT objective
        needs every one (ThreadShare) and the prompts waiting all rank below the sequences with that objective; the
        previous step is timed under the threads it ran with, from its forward to this one, when a sequence of it is
        still decoding (else the engine may have idled in between)."""
        now, ids = self.clock(), frozenset(s.seq_id for s in seqs)
        last = self._last_forward
        if last is not None and last[3] & ids:
            self.thread_share.record(last[2], last[1], now - last[0], now)
        objectives = [s for s in seqs if getattr(s, "tpot_slo_ms", 0)]
        tpot_s = min((s.tpot_slo_ms for s in objectives), default=0) / 1e3
        held = getattr(self.gate, "held_for", None)
        if not self.gate.prefill_active:
            mode = ALONE
        elif objectives and held is not None and held <= min(s.priority for s in objectives):
            # a prompt as important as the objective's sequences is queued or in prefill: its first token has an
            # objective too, so decode takes half the cores, not every one beside it (at 0.5x load, keeping every
            # thread then put interactive TTFT p99 at 0.33 s against 0.22 s for priorities only, bench.slo_bench)
            mode = HALVED
        else:
            mode = EVERY if self.thread_share.keep_threads(len(seqs), tpot_s, now) else HALVED
        threads = self._threads[1] if mode == HALVED else self._threads[0]
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self._last_forward = (now, len(seqs), mode, ids)

    def _forward_rows(self, rows: int, longest: int | None = None) -> torch.Tensor:
        """The eager forward over the first `rows` rows of the step inputs. Without `longest` (graph capture,
        profiling) the KV splits are sized for max_model_len. # [rows, vocab] float32"""
        inputs = self.inputs
        paged = inputs.batch(rows, longest or self.config.max_model_len)  # its KV splits follow that length
        return self._model_forward(inputs.input_ids[:rows], inputs.positions[:rows], paged)

    def _switched(self, rows: int, forward) -> torch.Tensor:
        """forward(), timed for the weight switch when there is one (eager steps on the CPU with two precisions)."""
        if self.weight_switch is None:
            return forward()
        switch = self.weight_switch
        # the thread mode _before_forward set for this step (each size chooses per mode); "" when not sharing
        mode = self._last_forward[2] if getattr(self, "_threads", None) and self._last_forward else ""
        precision = switch.before_step(rows, mode)
        started = time.perf_counter()
        logits = forward()
        ms = (time.perf_counter() - started) * 1e3
        if precision == switch.planned(rows):
            switch.after_step(rows, precision, ms)
            return logits
        # an explored step is only timed: its tokens come from the plan's weights (the step runs again and writes the
        # same KV slots), so a request's answer does not depend on where the explore_every-th step fell; the run
        # again on the plan, on the same batch just after, is what the explored time is compared with
        switch.back_to_plan(rows)
        started = time.perf_counter()
        logits = forward()
        switch.compared(rows, precision, ms, (time.perf_counter() - started) * 1e3)
        return logits

    def _weight_switch(self, model, capacity: int) -> WeightSwitch | None:
        """A live switch between the quantized and float weights by batch size, when the model holds both (weight_dtype
        auto on a CPU) and steps are eager; deterministic decoding keeps one precision."""
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.float_above is not None]
        if not layers or self.graphs is not None or self.config.deterministic:
            return None
        return WeightSwitch(layers, layers[0].float_above, capacity)

    def _model_forward(self, ids: torch.Tensor, positions: torch.Tensor, paged) -> torch.Tensor:
        """Logits of a batch of new tokens (ids, positions: [n]) through the configured forward. # [n, vocab] float32"""
        if self.native is not None:
            return self.native(ids, positions, paged)
        out = self.model(input_ids=ids[None], position_ids=positions[None], paged=paged, use_cache=False)
        return out.logits[0].float()

    def _pad(self, rows: int) -> None:
        self.inputs.fill_padding(0, rows)
        self.inputs.upload(rows)

    def _between_layers(self, _module, _args) -> None:
        self.gate.wait_turn(self._batch_priority)

    def _wait_turn(self) -> None:
        self.gate.wait_turn(self._batch_priority)

    def _budget_blocks(self, config: RunnerConfig, capacity: int) -> int:
        per_token = self._shape.bytes_per_token()
        if config.kv_cache_tokens:
            tokens = config.kv_cache_tokens
        elif config.kv_cache_bytes:
            tokens = config.kv_cache_bytes // per_token
        elif self.device.type == "cuda":
            tokens = kv_budget_bytes(self._profile(capacity), config.gpu_memory_utilization, per_token) // per_token
        else:
            tokens = config.cpu_default_tokens
        blocks = tokens // config.block_size
        if blocks < 1:
            raise ValueError(f"the KV budget holds {tokens} tokens, less than one block of {config.block_size}")
        return blocks

    @torch.inference_mode()
    def _profile(self, rows: int) -> MemoryProfile:
        """One forward and sampling at the largest batch over a two-block pool, measuring the peak memory
        above the weights (vLLM's profile run)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        self.pool = KVPool(self._shape, self.device)
        self.inputs = StepInputs(self.pool, 1, rows, self._max_blocks, self.device, self.backend)
        self._pad(rows)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=PROFILE_LOGPROBS)
        logits = self._forward_rows(rows)
        # a speculative step samples every fed position: 1 + K rows per sequence
        logits = logits.repeat(1 + self.config.num_speculative_tokens, 1)  # [rows * (1 + K), vocab]
        sample_rows(logits, SamplingBatch.build([SamplingRow(params, i, 0) for i in range(len(logits))], self.device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - weights
        del logits
        self.pool = self.inputs = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryProfile(total, free, weights, torch.cuda.memory_reserved(self.device), peak)


def _shared_threads(device: torch.device, gate: PriorityGate | None) -> tuple[int, int] | None:
    """(threads alone, threads while a prompt is in prefill) for decode on the CPU, or None. Two thread pools
    on the same cores slow each other far more than splitting the cores costs (contracts/cpu_share.py)."""
    if device.type != "cpu" or gate is None or not gate.enabled:
        return None
    alone = torch.get_num_threads()
    shared = max(1, alone // 2)
    log.info("decode on the CPU: %d threads, %d while a prompt is queued for or in prefill", alone, shared)
    return alone, shared


def _attempt(failed: list[tuple[str, str]], seq_id: str, what: str, action, *args) -> None:
    try:
        action(*args)
    except Exception as err:  # a bad payload or a failed copy of one sequence: that sequence fails, not the step
        log.exception("request %s failed %s", seq_id, what)
        failed.append((seq_id, f"{what} failed: {type(err).__name__}: {err}"))


def _storage_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
