"""The model runner: the only owner of device tensors (model weights and the paged KV pool).

It carries out a ScheduledStep in field order: `prepare` swaps out, imports handoffs, swaps in and
copies on write, one sequence at a time, so that one sequence's bad bytes fail only that sequence; then
`forward` runs one batched forward for every decoding sequence, returning their next-token logits.
Between two decoder layers the forward may wait on a PriorityGate, to give the CPU to a more important
prefill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from decode_gpu.kv_import import import_handoff
from decode_gpu.kv_pool import KVPool, PoolShape, bytes_per_token
from decode_gpu.paged_attention import ATTN_IMPLEMENTATION, build_paged_batch
from decode_gpu.priority_gate import PriorityGate
from decode_gpu.scheduler import ScheduledStep
from decode_gpu.sequence import Sequence
from contracts.identity import GGUFIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int = 16
    kv_storage: str = "auto"  # float32 | float16 | bfloat16 | int8; auto: the model's dtype
    kv_cache_tokens: int | None = None  # pool size in tokens (takes precedence)
    kv_cache_bytes: int | None = None  # pool size in bytes
    gpu_memory_utilization: float = 0.9  # on CUDA without an explicit size: this fraction of free memory
    cpu_default_tokens: int = 16384  # on the CPU without an explicit size


class PagedKVWriter:
    """KVWriter that lands an imported handoff directly in the sequence's pool blocks."""

    def __init__(self, pool: KVPool, blocks: list[int], n_tokens: int, device: torch.device) -> None:
        bs = pool.shape.block_size
        positions = torch.arange(n_tokens)
        self.slots = (torch.tensor(blocks)[positions // bs] * bs + positions % bs).to(device)  # [n_tokens]
        self.pool = pool

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.pool.write(layer, self.slots, keys, values)


class ModelRunner:
    def __init__(self, model: PreTrainedModel, identity: GGUFIdentity, config: RunnerConfig,
                 device: torch.device, gate: PriorityGate | None = None) -> None:
        self.model = model
        self.gate = gate
        self._batch_priority = 0  # the best priority in the batch being decoded
        if gate is not None and gate.enabled:
            for layer in model.model.layers:  # LLaMA and Qwen2 decoder stacks
                layer.register_forward_pre_hook(self._between_layers)
        self.identity = identity
        self.device = device
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        storage = _storage_name(model.dtype) if config.kv_storage == "auto" else config.kv_storage
        per_token = bytes_per_token(identity.n_layer, identity.num_kv_heads, identity.head_dim_k, storage)
        num_blocks = _num_blocks(config, per_token, device)
        self.pool = KVPool(PoolShape(identity.n_layer, num_blocks, config.block_size, identity.num_kv_heads,
                                     identity.head_dim_k, storage), device)
        self.swap_space: dict[str, list[torch.Tensor]] = {}  # host copies of preempted sequences' blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.shape.num_blocks

    @torch.inference_mode()
    def prepare(self, step: ScheduledStep) -> list[tuple[str, str]]:
        """The step's memory moves; returns (seq id, why) for each sequence whose own move failed. Its
        blocks then hold garbage that no other sequence reads: the engine fails it and frees them."""
        failed: list[tuple[str, str]] = []
        for seq_id, blocks in step.swap_out:
            _attempt(failed, seq_id, "swapping out its KV", self._swap_out, seq_id, blocks)
        for seq, blocks in step.imports:
            _attempt(failed, seq.seq_id, "importing its KV handoff", self._import, seq, blocks)
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

    def _import(self, seq: Sequence, blocks: list[int]) -> None:
        writer = PagedKVWriter(self.pool, blocks, seq.prompt_len, self.device)
        import_handoff(seq.handoff, self.identity, writer, self.device)

    def _swap_in(self, seq_id: str, blocks: list[int]) -> None:
        saved = self.swap_space.pop(seq_id)
        self.pool.write_blocks(blocks[:saved[0].shape[0]], saved)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], block_tables: dict[str, list[int]]) -> torch.Tensor:
        """Next-token logits for seqs, in order. # [len(seqs), vocab]"""
        paged = build_paged_batch(self.pool, [block_tables[s.seq_id] for s in seqs],
                                  [s.num_cached + 1 for s in seqs], [1] * len(seqs), self.device)
        input_ids = torch.tensor([[s.tokens[s.num_cached] for s in seqs]], device=self.device)  # [1, n_seqs]
        positions = torch.tensor([[s.num_cached for s in seqs]], device=self.device)  # [1, n_seqs]
        self._batch_priority = min(s.priority for s in seqs)
        out = self.model(input_ids=input_ids, position_ids=positions, paged=paged, use_cache=False)
        return out.logits[0].float()  # [n_seqs, vocab]

    def _between_layers(self, _module, _args) -> None:
        self.gate.wait_turn(self._batch_priority)


def _attempt(failed: list[tuple[str, str]], seq_id: str, what: str, action, *args) -> None:
    try:
        action(*args)
    except Exception as err:  # a bad payload or a failed copy of one sequence: that sequence fails, not the step
        log.exception("request %s failed %s", seq_id, what)
        failed.append((seq_id, f"{what} failed: {type(err).__name__}: {err}"))


def _storage_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]


def _num_blocks(config: RunnerConfig, per_token: int, device: torch.device) -> int:
    if config.kv_cache_tokens:
        tokens = config.kv_cache_tokens
    elif config.kv_cache_bytes:
        tokens = config.kv_cache_bytes // per_token
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = int(free * config.gpu_memory_utilization) // per_token
    else:
        tokens = config.cpu_default_tokens
    blocks = tokens // config.block_size
    if blocks < 1:
        raise ValueError(f"the KV budget holds {tokens} tokens, less than one block of {config.block_size}")
    return blocks
