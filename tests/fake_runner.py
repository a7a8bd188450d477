"""A model runner that fabricates outputs (vLLM's pattern for scheduler tests), with a token-level fake pool.

The pool stores token ids per slot, so every decode step checks that the sequence's context, read
through its block table, is exactly its tokens: swaps, copies and imports must all be right.
Failures can be injected per sequence (its import, its logits) or for the whole batched forward.
"""

from __future__ import annotations

import torch

from contracts.handoff import KVHandoff, KVLayout, SamplingParams
from contracts.identity import GGUFIdentity
from decode_gpu.core.scheduler import ScheduledStep
from decode_gpu.core.sequence import Sequence

VOCAB = 1000
IDENTITY = GGUFIdentity(path="fake.gguf", fingerprint="sha256:fake", arch="llama", n_layer=1, n_head=1,
                        num_kv_heads=1, head_dim_k=32, head_dim_v=32, rope_layout="interleaved")
LAYOUT = KVLayout(n_layer=1, num_kv_heads=1, head_dim_k=32, head_dim_v=32, k_dtype="f16", v_dtype="f16",
                  v_transposed=False, k_rotation=0, v_rotation=0, rope_layout="interleaved")


def next_token(context: list[int]) -> int:
    """The fabricated model: a deterministic function of the whole context."""
    return (7 * sum(context) + 13 * len(context)) % (VOCAB - 3) + 3


def fake_handoff(request_id: str, prompt: list[int], max_tokens: int, priority: int = 0,
                 temperature: float = 0.0) -> KVHandoff:
    row = b"\0" * 64  # one token's K (or V) row: 32 f16 values
    return KVHandoff(request_id=request_id, model_fingerprint=IDENTITY.fingerprint, layout=LAYOUT,
                     positions=tuple(range(len(prompt))), prompt_tokens=tuple(prompt), first_token=next_token(prompt),
                     k_layers=(row * len(prompt),), v_layers=(row * len(prompt),),
                     sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens), priority=priority)


BYTES_PER_TOKEN = 64  # what the fake pool claims a token's K and V take (swap space is counted with it)


class _Shape:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def bytes_per_token(self) -> int:
        return BYTES_PER_TOKEN

    def bytes_per_block(self) -> int:
        return self.block_size * BYTES_PER_TOKEN


class _Pool:
    def __init__(self, block_size: int) -> None:
        self.shape = _Shape(block_size)


class FakeRunner:
    device = torch.device("cpu")
    identity = IDENTITY
    gate = None  # no PriorityGate unless a test sets one

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.pool = _Pool(block_size)
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.swap_space: dict[str, list[list[int | None]]] = {}
        self.decoded_order: list[str] = []  # seq ids in the order of their first decode step
        self.fail_import: set[str] = set()  # these sequences' imports raise, as a bad payload would
        self.poison_logits: dict[str, float] = {}  # seq id -> a value (nan, inf) filling its logits row
        self.num_forward_failures = 0  # this many coming forwards raise (a failure of the whole batch)
        self.num_forwards = 0

    def prepare(self, step: ScheduledStep) -> list[tuple[str, str]]:
        bs = self.pool.shape.block_size
        failed = []
        for seq_id, blocks in step.swap_out:
            self.swap_space[seq_id] = [self.slots[b * bs:(b + 1) * bs] for b in blocks]
        for seq, blocks in step.imports:
            if seq.seq_id in self.fail_import:
                failed.append((seq.seq_id, "importing its KV handoff failed: injected bad payload"))
                continue
            for pos, token in enumerate(seq.handoff.prompt_tokens):
                self.slots[self._slot(blocks, pos)] = token
        for seq_id, blocks in step.swap_in:
            for block, saved in zip(blocks, self.swap_space.pop(seq_id)):
                self.slots[block * bs:(block + 1) * bs] = saved
        for copy in step.copies:
            self.slots[copy.dst * bs:(copy.dst + 1) * bs] = self.slots[copy.src * bs:(copy.src + 1) * bs]
        return failed

    def forward(self, seqs: list[Sequence], block_tables: dict[str, list[int]]) -> torch.Tensor:
        self.num_forwards += 1
        if self.num_forward_failures:
            self.num_forward_failures -= 1
            raise RuntimeError("injected failure of the batched forward")
        logits = torch.full((len(seqs), VOCAB), -10.0)  # [len(seqs), VOCAB]
        for row, seq in enumerate(seqs):
            table = block_tables[seq.seq_id]
            context = [self.slots[self._slot(table, p)] for p in range(seq.num_cached)]
            assert context == seq.tokens[:seq.num_cached], f"{seq.seq_id}: pool context differs from its tokens"
            self.slots[self._slot(table, seq.num_cached)] = seq.tokens[seq.num_cached]
            logits[row, next_token(seq.tokens[:seq.num_cached + 1])] = 10.0
            if seq.seq_id in self.poison_logits:
                logits[row] = self.poison_logits[seq.seq_id]
            if seq.seq_id not in self.decoded_order:
                self.decoded_order.append(seq.seq_id)
        return logits

    def forget(self, seq_id: str) -> None:
        self.swap_space.pop(seq_id, None)

    def _slot(self, table: list[int], pos: int) -> int:
        bs = self.pool.shape.block_size
        return table[pos // bs] * bs + pos % bs


def make_engine(num_blocks=64, block_size=4, max_num_seqs=32, **config):
    """A decode engine over the fake runner; `config` goes to EngineConfig."""
    from decode_gpu.core.scheduler import SchedulerConfig
    from decode_gpu.engine import DecodeEngine, EngineConfig
    runner = FakeRunner(num_blocks, block_size)
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
                                               max_model_len=10_000, **config))
    return engine, runner


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What the fabricated model generates after `prompt`, greedily."""
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_tokens:
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]
