"""The model runner: the only owner of device tensors (model weights, the paged KV pool, the step inputs).

It carries out a ScheduledStep in field order: `prepare` swaps out, imports handoffs, swaps in and
copies on write, one sequence at a time, so that one sequence's bad bytes fail only that sequence
(memory_moves.py); then `forward` runs one batched forward for every decoding sequence, returning their
next-token logits (`verify` instead, when some sequences feed draft tokens too: speculative decoding, whose
start-up cost model times this runner's forward and verify, cost_probe.py).

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

from contracts.handoff import SamplingParams
from contracts.identity import GGUFIdentity
from decode_gpu.attention.backend import resolve_backend
from decode_gpu.attention.paged_attention import use_paged_attention
from decode_gpu.attention.paged_batch import build_paged_batch
from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.core.scheduler import ScheduledStep
from decode_gpu.core.sequence import Sequence
from decode_gpu.core.speculative import StepCosts
from decode_gpu.core.step_times import EVERY, HALVED, ThreadShare
from decode_gpu.kv.pool import KVPool, PoolShape
from decode_gpu.model.native_decoder import NativeDecoder, resolve_forward
from decode_gpu.model.quantized_linear import QuantizedLinear
from decode_gpu.runner import cost_probe
from decode_gpu.runner.alone_threads import ALONE_HALVED, AloneThreads
from decode_gpu.runner.cost_probe import PROBE_BUDGET_S
from decode_gpu.runner.cuda_graphs import DecodeGraphs, graph_buckets
from decode_gpu.runner.kv_sizing import MemoryProfile, kv_budget_bytes
from decode_gpu.runner.memory_moves import MemoryMoves
from decode_gpu.runner.step_inputs import StepInputs
from decode_gpu.runner.weight_switch import WeightSwitch
from sampling.sampler import sample_rows
from sampling.sampling_params import SamplingBatch, SamplingRow

log = logging.getLogger(__name__)
PROFILE_LOGPROBS = 20  # the profiling forward samples with this many top logprobs, OpenAI's maximum


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
        self._batch_priority = 0.0  # the best decode priority in the batch (Sequence.decode_priority)
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
        self.moves = MemoryMoves(self.pool, identity, device)
        self._threads = _shared_threads(device, gate)
        # which thread count keeps a TPOT objective beside prefill, from the steps measured with each
        self.thread_share = ThreadShare() if self._threads else None
        # with no prompt in prefill: every thread, or half where half measured faster (another process on a core)
        self.alone_threads = AloneThreads() if self._threads else None
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

    @property
    def swap_space(self) -> dict[str, list[torch.Tensor]]:
        """Host copies of preempted sequences' blocks, by seq id."""
        return self.moves.swap_space

    def prepare(self, step: ScheduledStep) -> list[tuple[str, str]]:
        """The step's memory moves; returns (seq id, why) for each sequence whose own move failed. Its
        blocks then hold garbage that no other sequence reads: the engine fails it and frees them."""
        return self.moves.prepare(step)

    def forget(self, seq_id: str) -> None:
        """Drop host swap space of an aborted or failed sequence."""
        self.moves.forget(seq_id)

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
        return cost_probe.step_costs(self, max_num_seqs, num_draft, reps, budget_s, record)

    def cost_record_key(self, max_num_seqs: int, num_draft: int) -> str:
        """What a recorded cost model must match: weights, device, threads, batch limits."""
        return cost_probe.cost_record_key(self, max_num_seqs, num_draft)

    def measure_step_costs(self, max_num_seqs: int, num_draft: int, reps: int = 5,
                           budget_s: float = PROBE_BUDGET_S) -> StepCosts:
        """What a plain step and a verify step cost by rows fed (speculative decoding plans its drafts with it),
        measured before any request (cost_probe.py)."""
        return cost_probe.measure_step_costs(self, max_num_seqs, num_draft, reps, budget_s)

    def _before_forward(self, seqs: list[Sequence]) -> None:
        """Thread count (decode on the CPU next to llama.cpp prefill) and the priority the gate waits with."""
        if self._threads:
            self._set_threads(seqs)
        self._batch_priority = min(s.decode_priority for s in seqs)

    def _set_threads(self, seqs: list[Sequence]) -> None:
        """Halve the threads while a prompt is queued for or in prefill, unless the batch's tightest TPOT objective
        needs every one (ThreadShare) and the prompts waiting all rank below the sequences with that objective; the
        previous step is timed under the threads it ran with, from its forward to this one, when a sequence of it is
        still decoding (else the engine may have idled in between)."""
        now, ids = self.clock(), frozenset(s.seq_id for s in seqs)
        last = self._last_forward
        if last is not None and last[3] & ids:
            self.thread_share.record(last[2], last[1], now - last[0], now)
            self.alone_threads.record(last[2], last[1], now - last[0], now)
        objectives = [s for s in seqs if getattr(s, "tpot_slo_ms", 0)]
        tpot_s = min((s.tpot_slo_ms for s in objectives), default=0) / 1e3
        held = getattr(self.gate, "held_for", None)
        if not self.gate.prefill_active:
            mode = self.alone_threads.mode(len(seqs), now)
        elif objectives and held is not None and held <= min(s.priority for s in objectives):
            # a prompt as important as the objective's sequences is queued or in prefill: its first token has an
            # objective too, so decode takes half the cores, not every one beside it (at 0.5x load, keeping every
            # thread then put interactive TTFT p99 at 0.33 s against 0.22 s for priorities only, bench.slo_bench)
            mode = HALVED
        else:
            mode = EVERY if self.thread_share.keep_threads(len(seqs), tpot_s, now) else HALVED
        threads = self._threads[1] if mode in (HALVED, ALONE_HALVED) else self._threads[0]
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


def _storage_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
