"""The decode step's inputs in persistent buffers: input ids, positions, slot mapping, context lengths and
block tables of up to `capacity` sequences (one new token each).

The host fills a pinned buffer (numpy writes, no tensor per step) and one host-to-device copy of its used
prefix brings it to a device buffer whose address never changes, which is what lets a CUDA graph replay
read it. Rows past the batch (padding up to a graph's batch size) decode a dummy token into the reserved
scratch block, which no sequence owns; their outputs are dropped.

Layout of both buffers, int32: [ids | positions | slots | context lengths] (capacity each), then the block
tables, capacity x max_blocks row-major, so the rows in use form one contiguous prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from decode_gpu.attention.length_groups import length_groups
from decode_gpu.attention.paged_batch import PagedBatch, choose_num_splits, deterministic_splits
from decode_gpu.core.sequence import Sequence
from decode_gpu.kv.pool import KVPool

log = logging.getLogger(__name__)
IDS, POSITIONS, SLOTS, CONTEXT = range(4)
# the CPU's unmasked decode view (PagedBatch.decode_len) for batches of equal lengths up to this many rows: a batch
# of one, a deterministic step's rows each alone; measured faster at 1 and 8 rows, not measured clean at 32 (a run on
# a loaded machine had it 2x slower there, a synthetic run equal), so larger batches keep the masked view
EXACT_MAX_ROWS = 8


class StepInputs:
    def __init__(self, pool: KVPool, scratch_block: int, capacity: int, max_blocks: int,
                 device: torch.device, backend: str, deterministic: bool = False) -> None:
        """deterministic: batches whose attention of a row does not depend on the other rows (build_paged_batch)."""
        self.pool = pool
        self.deterministic = deterministic
        self.block_size = pool.shape.block_size
        self.scratch_block = scratch_block
        self.device = device
        self.backend = backend
        self.generation = 0  # counts reallocations: a CUDA graph reads the buffers of the generation it saw
        self._allocate(capacity, max_blocks)

    def _allocate(self, capacity: int, max_blocks: int) -> None:
        self.capacity, self.max_blocks = capacity, max_blocks
        size = capacity * (4 + max_blocks)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")  # [size]
        self._np = self.host.numpy()
        self._columns = self._np[:4 * capacity].reshape(4, capacity)  # [4, capacity] numpy views of the host
        self._tables = self._np[4 * capacity:].reshape(capacity, max_blocks)  # [capacity, max_blocks]
        on_host = self.device.type == "cpu"
        self.buffer = self.host if on_host else torch.zeros(size, dtype=torch.int32, device=self.device)  # [size]
        columns = self.buffer[:4 * capacity].view(4, capacity)  # [4, capacity] on the device
        self.input_ids, self.positions, self.slots, self.context_lens = columns
        self.block_tables = self.buffer[4 * capacity:].view(capacity, max_blocks)  # [capacity, max_blocks]
        self.query_start = torch.arange(capacity, dtype=torch.int32, device=self.device)  # one new token per row
        self.query_lens = torch.ones(capacity, dtype=torch.int32, device=self.device)
        self.fill_padding(0, capacity)

    def ensure(self, rows: int, blocks: int) -> None:
        """Grow the buffers for a batch they cannot hold (eager steps only: a graph keeps the old ones)."""
        if rows > self.capacity or blocks > self.max_blocks:
            capacity, max_blocks = max(rows, self.capacity), max(blocks, self.max_blocks)
            log.warning("decode step inputs grow to %d rows x %d blocks", capacity, max_blocks)
            self._allocate(capacity, max_blocks)
            self.generation += 1

    def fill(self, seqs: Seq[Sequence], tables: Seq[list[int]], rows: int) -> int:
        """Write the batch's rows on the host, pad to `rows`, copy to the device; returns the longest context."""
        self.ensure(rows, max(map(len, tables)))
        bs = self.block_size
        ids, positions, slots, context = self._columns
        longest = 1
        for i, (seq, table) in enumerate(zip(seqs, tables)):
            pos = seq.num_cached
            ids[i], positions[i], context[i] = seq.tokens[pos], pos, pos + 1
            slots[i] = table[pos // bs] * bs + pos % bs
            self._tables[i, :len(table)] = table
            longest = max(longest, pos + 1)
        self.fill_padding(len(seqs), rows)
        self.upload(rows)
        return longest

    def fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) decode token 0 at position 0 into the scratch block (context 1)."""
        ids, positions, slots, context = self._columns
        ids[start:end], positions[start:end], context[start:end] = 0, 0, 1
        slots[start:end] = self.scratch_block * self.block_size
        self._tables[start:end, 0] = self.scratch_block

    def upload(self, rows: int) -> None:
        """One copy of everything the first `rows` rows use (a no-op on the CPU, where host is the buffer)."""
        if self.buffer is self.host:
            return
        self.buffer[:4 * self.capacity].copy_(self.host[:4 * self.capacity], non_blocking=True)
        end = 4 * self.capacity + rows * self.max_blocks
        self.buffer[4 * self.capacity:end].copy_(self.host[4 * self.capacity:end], non_blocking=True)

    def batch(self, rows: int, max_context: int, num_splits: int | None = None) -> PagedBatch:
        """The PagedBatch of the first `rows` rows. On the torch path it also carries the block view its decode
        attention gathers (blocks up to max_context) and the mask of each row's context; on the CPU, rows of very
        different lengths get them in groups (PagedBatch.groups), each up to its own longest context."""
        if self.deterministic:
            num_splits = deterministic_splits(self.device)
        num_splits = num_splits or choose_num_splits(rows, self.pool.shape.num_kv_heads, max_context, self.device)
        dense = {}
        if self.backend == "torch" and self.deterministic and self.device.type == "cpu":
            # one masked attention over the batch, on one thread (PagedBatch.one_thread): a row's bits depend neither
            # on the others nor on the padding, and no row is attended alone (2.0-2.7x the default step when they were)
            dense = {**self._decode_view(self.block_tables[:rows], self.context_lens[:rows], max_context),
                     "one_thread": True}
        elif self.backend == "torch":
            # on the CPU the host buffer is the device's: the lengths read without a sync
            groups = length_groups(self._columns[CONTEXT, :rows].tolist(), self.block_size) \
                if self.device.type == "cpu" and rows > 1 else []
            if self.deterministic and rows > 1:  # each row its own group, padded to its own context only
                groups = [[i] for i in range(rows)]
            if len(groups) > 1:
                dense["groups"] = tuple(self._group(rows_, num_splits) for rows_ in groups)
            else:
                dense = self._decode_view(self.block_tables[:rows], self.context_lens[:rows], max_context,
                                          self._equal_length(slice(0, rows), max_context))
        return PagedBatch(self.pool, self.backend, self.slots[:rows], self.block_tables[:rows],
                          self.context_lens[:rows], self.query_start[:rows], self.query_lens[:rows], 1, num_splits,
                          **dense)

    def _decode_view(self, tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                     exact: int | None = None) -> dict:
        """The torch path's decode view of these rows: their blocks up to max_context, and each row's mask; with
        `exact` (every row's context is that long), the blocks up to it and no mask."""
        if exact is not None:
            n_blocks = -(-exact // self.block_size)
            return {"decode_blocks": tables[:, :n_blocks].reshape(-1), "decode_len": exact}  # [rows * n_blocks]
        n_blocks = -(-max_context // self.block_size)
        span = torch.arange(n_blocks * self.block_size, device=self.device)  # [n_blocks * block_size]
        return {"decode_blocks": tables[:, :n_blocks].reshape(-1),  # [rows * n_blocks]
                "decode_mask": (span[None, :] < context_lens[:, None])[:, None, None]}  # [rows, 1, 1, span]

    def _equal_length(self, rows, max_context: int) -> int | None:
        """The context length every one of these rows has, when they all have the same one and it is no longer than
        max_context; None otherwise, and off the CPU (where the lengths are not on the host without a sync)."""
        if self.device.type != "cpu":
            return None
        lengths = self._columns[CONTEXT, rows]
        if len(lengths) > EXACT_MAX_ROWS:
            return None  # numpy: the host buffer is the device's on the CPU
        first = int(lengths[0])
        return first if first <= max_context and bool((lengths == first).all()) else None

    def _group(self, rows: list[int], num_splits: int) -> tuple[torch.Tensor, PagedBatch]:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)  # [g]
        tables, context_lens = self.block_tables.index_select(0, index), self.context_lens.index_select(0, index)
        longest = int(self._columns[CONTEXT, rows].max())
        group = PagedBatch(self.pool, self.backend, self.slots[:0], tables, context_lens, self.query_start[:len(rows)],
                           self.query_lens[:len(rows)], 1, num_splits,
                           **self._decode_view(tables, context_lens, longest, self._equal_length(rows, longest)))
        return index, group
