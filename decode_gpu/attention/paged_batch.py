"""The attention metadata of one forward (PagedBatch), built from block tables on the host: the index tensors
both backends read, and on the torch path the dense view (gather blocks, query index, causal mask)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from decode_gpu.attention.backend import resolve_backend
from decode_gpu.attention.length_groups import length_groups
from decode_gpu.kv.pool import KVPool

MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # shorter splits cost more in the merge than their parallelism gains


@dataclass(frozen=True)
class PagedBatch:
    """Attention metadata for one forward; the model runner builds it, the attention function reads it."""
    pool: KVPool
    backend: str  # "torch" or "triton"
    # [n_new] int32 pool slot of each new token, in batch order (negative: not stored, Triton path)
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [n_seqs, max_blocks] int32 pool blocks of each sequence, padded with 0
    context_lens: torch.Tensor  # [n_seqs] int32 context length of each sequence, new tokens included
    query_start: torch.Tensor  # [n_seqs] int32 index of each sequence's first new token in the batch
    query_lens: torch.Tensor  # [n_seqs] int32 new tokens of each sequence
    max_query_len: int
    num_splits: int  # KV splits per sequence in the Triton kernel, a power of two
    # the torch path's dense view (None on the triton path, which needs none of it)
    gather_blocks: torch.Tensor | None = None  # [n_seqs * n_blocks] each sequence's context's pool blocks, padded
    # [n_seqs, max_query] index into the new tokens of each sequence's queries, padded
    query_index: torch.Tensor | None = None
    query_valid: torch.Tensor | None = None  # [n_seqs, max_query] False on padding rows
    output_rows: torch.Tensor | None = None  # [n_new] index of each new token's row in the [n_seqs * max_query] output
    # [n_seqs, max_query, n_blocks * block_size] True where a query may attend to a key
    query_mask: torch.Tensor | None = None
    # the torch path's decode view (one new token per sequence, step_inputs.StepInputs builds it)
    decode_blocks: torch.Tensor | None = None  # [n_seqs * n_blocks] each sequence's first n_blocks pool blocks
    decode_mask: torch.Tensor | None = None  # [n_seqs, 1, 1, n_blocks * block_size] True inside the context
    # the CPU's decode view when every row's context is exactly this long (a batch of one, equal lengths, a length
    # group of one): the gathered blocks are cut to it and attended with no mask (decode_mask is then None)
    decode_len: int | None = None
    # the torch path on the CPU: sequences of similar context length attended apart, each group padded to its own
    # longest context: (the group's new tokens [g] long, in batch order, and its own PagedBatch, which holds the
    # dense view; this batch's is then left out); empty: all together
    groups: tuple[tuple[torch.Tensor, PagedBatch], ...] = ()
    # deterministic on the CPU: the decode attention of the whole batch runs on one thread under decode_mask. torch's
    # CPU SDPA (and the soft-capped matmuls) then give a row the same bits whatever the other rows and however far
    # its keys are padded with masked ones; on two threads float32 SDPA splits the work by the batch's shape and
    # does not (tests/decode_gpu/test_deterministic.py holds both)
    one_thread: bool = False
    # the torch path's masks cut to a sliding window, by window: built by the first sliding layer of the forward
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, compare=False, repr=False)
    # the same as additive float masks for torch_attention._attend_grouped, by (window, group, dtype): built by
    # the first layer
    additive_masks: dict[tuple, torch.Tensor] = field(default_factory=dict, init=False, compare=False, repr=False)


@dataclass(frozen=True)
class Extras:
    """A layer's attention options beyond the batch: Gemma's sliding window and soft-capping (None: off)."""
    window: int | None
    softcap: float | None


NO_EXTRAS = Extras(None, None)


def build_paged_batch(pool: KVPool, block_tables: list[list[int]], context_lens: list[int],
                      query_lens: list[int], device: torch.device, backend: str | None = None,
                      num_splits: int | None = None, deterministic: bool = False) -> PagedBatch:
    """Sequence i has context_lens[i] tokens after this step, of which the last query_lens[i] are new.
    A sequence may have no new tokens (a padded row): it is attended for nobody and stores nothing.
    deterministic: each sequence attended on its own (torch path), KV splits by deterministic_splits (Triton), so
    that a sequence's attention does not depend on the others in the batch."""
    backend = backend or resolve_backend(device)
    bs = pool.shape.block_size
    starts = list(itertools.accumulate(query_lens, initial=0))[:-1]
    slots = [table[p // bs] * bs + p % bs for table, n_ctx, n_q in zip(block_tables, context_lens, query_lens)
             for p in range(n_ctx - n_q, n_ctx)]
    width = max(1, *map(len, block_tables))
    tables = [x for table in block_tables for x in (*table, *[0] * (width - len(table)))]
    # one host-to-device copy for every index tensor
    packed = torch.tensor(slots + context_lens + starts + query_lens + tables, dtype=torch.int32).to(device)
    n_seqs = len(block_tables)
    slot_mapping, ctx, start, q_lens, flat_tables = packed.split([len(slots), n_seqs, n_seqs, n_seqs, n_seqs * width])
    if deterministic:
        num_splits = deterministic_splits(device)
    num_splits = num_splits or choose_num_splits(n_seqs, pool.shape.num_kv_heads, max(context_lens), device)
    dense = {}
    if backend == "torch":
        groups = length_groups(context_lens, bs) if device.type == "cpu" and n_seqs > 1 else []
        if deterministic and n_seqs > 1:
            groups = [[i] for i in range(n_seqs)]
        if len(groups) > 1:
            dense["groups"] = tuple(_query_group(pool, [block_tables[i] for i in rows], [context_lens[i] for i in rows],
                                                 [query_lens[i] for i in rows], [starts[i] for i in rows], device)
                                    for rows in groups)
        else:
            dense = _dense_index(bs, block_tables, context_lens, query_lens, device)
    return PagedBatch(pool, backend, slot_mapping, flat_tables.view(n_seqs, width), ctx, start, q_lens,
                      max(query_lens), num_splits, **dense)


def _query_group(pool: KVPool, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                 starts: list[int], device: torch.device) -> tuple[torch.Tensor, PagedBatch]:
    """Some sequences of a multi-token batch as a batch of their own (torch path): (their new tokens' rows in the
    whole batch, in order, and the PagedBatch whose queries are those rows)."""
    rows = torch.tensor([r for start, n_q in zip(starts, query_lens) for r in range(start, start + n_q)],
                        dtype=torch.long, device=device)  # [g_new]
    group_starts = list(itertools.accumulate(query_lens, initial=0))[:-1]
    width = max(map(len, block_tables))
    tables = torch.tensor([[*t, *[0] * (width - len(t))] for t in block_tables], dtype=torch.int32, device=device)
    as_tensor = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    group = PagedBatch(pool, "torch", as_tensor([]), tables, as_tensor(context_lens), as_tensor(group_starts),
                       as_tensor(query_lens), max(query_lens), 1,
                       **_dense_index(pool.shape.block_size, block_tables, context_lens, query_lens, device))
    return rows, group


def choose_num_splits(n_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough programs for about two waves over the GPU's SMs, no split shorter than MIN_SPLIT_TOKENS;
    a power of two so the kernel compiles for few values."""
    want = -(-2 * _num_sms(device) // max(1, n_seqs * num_kv_heads))
    n = max(1, min(want, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def deterministic_splits(device: torch.device) -> int:
    """The KV splits of every deterministic forward: one count for any batch and context (a split's length follows
    the sequence's own context inside the kernel), enough for a long context to use the GPU."""
    return MAX_SPLITS if device.type == "cuda" else 1


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splits only add work
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _dense_index(bs: int, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The torch path's gather blocks, query index and causal mask, padded to the longest context (in whole
    blocks: one copy per block, as the decode path reads them) and the longest query."""
    n_seqs, max_q = len(block_tables), max(query_lens)
    n_blocks = -(-max(context_lens) // bs)
    gather = torch.zeros(n_seqs, n_blocks, dtype=torch.long)  # [n_seqs, n_blocks] padded with block 0, masked
    query_index = torch.zeros(n_seqs, max_q, dtype=torch.long)  # [n_seqs, max_q]
    valid = torch.zeros(n_seqs, max_q, dtype=torch.bool)  # [n_seqs, max_q]
    output_rows = torch.cat([torch.arange(i * max_q, i * max_q + n_q) for i, n_q in enumerate(query_lens)])  # [n_new]
    mask = torch.zeros(n_seqs, max_q, n_blocks * bs, dtype=torch.bool)  # [n_seqs, max_q, span]
    start = 0
    for i, (table, n_ctx, n_q) in enumerate(zip(block_tables, context_lens, query_lens)):
        positions = torch.arange(n_ctx)  # [n_ctx]
        used = -(-n_ctx // bs)
        gather[i, :used] = torch.tensor(table[:used], dtype=torch.long)
        query_index[i, :n_q] = torch.arange(start, start + n_q)
        valid[i, :n_q] = True
        query_pos = torch.arange(n_ctx - n_q, n_ctx)  # [n_q]
        mask[i, :n_q, :n_ctx] = positions[None, :] <= query_pos[:, None]  # causal within the context
        mask[i, n_q:, 0] = True  # padded query rows attend somewhere (dropped later) so softmax stays finite
        start += n_q
    return {"gather_blocks": gather.flatten().to(device), "query_index": query_index.to(device),
            "query_valid": valid.to(device), "output_rows": output_rows.to(device), "query_mask": mask.to(device)}
