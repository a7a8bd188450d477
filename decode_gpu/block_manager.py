"""KV block accounting (pure Python, no torch): which pool blocks each sequence owns.

Blocks hold `block_size` consecutive token positions. Reference counts let a block be shared (prefix
sharing); a shared block is copied before it is written (`append` reports the copy to make).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """allocate/append was called without its can_* check; a scheduler bug, never a user error."""


@dataclass(frozen=True)
class BlockCopy:
    src: int  # shared block whose contents the sequence had
    dst: int  # private block the sequence writes from now on


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: str, n_tokens: int) -> list[int]:
        """Give a new sequence blocks for its first n_tokens positions."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not self.can_allocate(n_tokens):
            raise OutOfBlocksError(f"{self.blocks_for(n_tokens)} blocks needed, {self.num_free_blocks} free")
        self.block_tables[seq_id] = [self._take() for _ in range(self.blocks_for(n_tokens))]
        return self.block_tables[seq_id]

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Share all of the parent's blocks with a new sequence (copy-on-write)."""
        table = list(self.block_tables[parent_id])
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[child_id] = table
        return table

    def can_append(self, seq_id: str, n_tokens: int) -> bool:
        """Can the sequence grow to n_tokens positions (including a copy of a shared last block)?"""
        return self._blocks_needed_to_grow(seq_id, n_tokens) <= self.num_free_blocks

    def append(self, seq_id: str, n_tokens: int) -> BlockCopy | None:
        """Grow the sequence to n_tokens positions; return the copy to make if its last block was shared."""
        if not self.can_append(seq_id, n_tokens):
            raise OutOfBlocksError(f"sequence {seq_id} cannot grow to {n_tokens} tokens")
        table = self.block_tables[seq_id]
        copy = None
        index = self._shared_write_target(seq_id, n_tokens)
        if index is not None:
            shared = table[index]
            self.ref_counts[shared] -= 1
            table[index] = self._take()
            copy = BlockCopy(src=shared, dst=table[index])
        while len(table) < self.blocks_for(n_tokens):
            table.append(self._take())
        return copy

    def free(self, seq_id: str) -> int:
        """Release a sequence's blocks; returns how many returned to the free list. Unknown ids are a no-op."""
        freed = 0
        for block in self.block_tables.pop(seq_id, []):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
                freed += 1
        return freed

    def check_integrity(self) -> None:
        """free + used == total; ref counts >= 0 and equal to the number of tables holding each block."""
        holders = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block in table:
                holders[block] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert all(count >= 0 for count in self.ref_counts), "negative reference count"
        assert holders == self.ref_counts, "reference counts disagree with block tables"
        used = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert not (free & used), "a used block is on the free list"
        assert len(free) + len(used) == self.num_blocks, "a block is neither free nor used"

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def _shared_write_target(self, seq_id: str, n_tokens: int) -> int | None:
        """Index in the block table of a shared block that growing to n_tokens would write into."""
        table = self.block_tables[seq_id]
        index = (n_tokens - 1) // self.block_size  # the block holding the newest position
        if 0 <= index < len(table) and self.ref_counts[table[index]] > 1:
            return index
        return None

    def _blocks_needed_to_grow(self, seq_id: str, n_tokens: int) -> int:
        table = self.block_tables[seq_id]
        copy = self._shared_write_target(seq_id, n_tokens) is not None
        return max(0, self.blocks_for(n_tokens) - len(table)) + int(copy)
