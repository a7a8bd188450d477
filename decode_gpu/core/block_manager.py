"""KV block accounting (pure Python, no torch): which pool blocks each sequence owns.

Blocks hold `block_size` consecutive token positions. Reference counts let a block be shared (n choices,
prefix sharing); a shared block is copied before it is written (`append` reports the copy to make).

Prefix caching (vLLM's automatic prefix caching scheme): a full block of an imported prompt is named by a hash
chain over the token ids of every block up to it, salted with what else decides its contents (the handoff's KV
types). A new sequence whose prompt starts with named blocks takes them by reference and imports only the rest.
A named block whose last holder is freed stays named, on an LRU list, and is reused only when no free block is
left: `num_free_blocks` counts both, since either can be handed out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """allocate/append was called without its can_* check; a scheduler bug, never a user error."""


@dataclass(frozen=True)
class BlockCopy:
    src: int  # shared block whose contents the sequence had
    dst: int  # private block the sequence writes from now on


def prefix_hashes(tokens: Seq[int], block_size: int, salt: str) -> list[bytes]:
    """The hash chain of every full block of `tokens`: block i's name covers the salt and blocks 0..i."""
    hashes, parent = [], hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = ",".join(map(str, tokens[start:start + block_size])).encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.cached: dict[bytes, int] = {}  # prefix hash -> the block holding that prefix's last block of tokens
        self.block_hash: dict[int, bytes] = {}  # the inverse, for named blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # named blocks nobody holds, least recently freed first
        self.num_cache_queries = 0  # full prompt blocks looked up
        self.num_cache_hits = 0  # ... and found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int, hashes: Seq[bytes] = (), extra_blocks: int = 0) -> bool:
        """Room for n_tokens positions (and extra_blocks more), the named blocks of `hashes` already in the pool
        taken by reference?"""
        hits = self._hits(hashes)
        idle_hits = sum(1 for block in hits if block in self.evictable)  # reusing them takes them off the LRU
        return self.blocks_for(n_tokens) - len(hits) + extra_blocks <= self.num_free_blocks - idle_hits

    def allocate(self, seq_id: str, n_tokens: int) -> list[int]:
        """Give a new sequence fresh blocks for its first n_tokens positions."""
        return self.allocate_prefix(seq_id, n_tokens, ())[0]

    def allocate_prefix(self, seq_id: str, n_tokens: int, hashes: Seq[bytes]) -> tuple[list[int], int]:
        """Give a new sequence blocks for its first n_tokens positions: the longest run of named blocks that
        `hashes` (its prompt's prefix_hashes) finds, by reference, then fresh blocks, which take the names of the
        rest of `hashes` (the caller fills them). Returns the table and how many tokens it found cached."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not self.can_allocate(n_tokens, hashes):
            raise OutOfBlocksError(f"{self.blocks_for(n_tokens)} blocks needed, {self.num_free_blocks} free")
        hits = self._hits(hashes)
        self.num_cache_queries += len(hashes)
        self.num_cache_hits += len(hits)
        for block in hits:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
        table = hits + [self._take() for _ in range(self.blocks_for(n_tokens) - len(hits))]
        for block, name in zip(table[len(hits):], hashes[len(hits):]):
            self._name(block, name)
        self.block_tables[seq_id] = table
        return table, len(hits) * self.block_size

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

    def free(self, seq_id: str, keep_names: bool = True) -> int:
        """Release a sequence's blocks; returns how many nobody holds any more. Named ones stay cached (LRU) unless
        keep_names is False (their contents may be wrong: a failed import). Unknown ids are a no-op."""
        freed = 0
        for block in self.block_tables.pop(seq_id, []):
            self.ref_counts[block] -= 1
            if not keep_names and self.ref_counts[block] == 0:
                self._unname(block)
            if self.ref_counts[block] == 0:
                if block in self.block_hash:
                    self.evictable[block] = None  # newest at the end
                else:
                    self.free_blocks.append(block)
                freed += 1
        return freed

    def check_integrity(self) -> None:
        """free + idle named + used == total; ref counts >= 0 and equal to the number of tables holding each
        block; the name maps are inverse to each other, and every idle named block is named."""
        holders = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block in table:
                holders[block] += 1
        free, idle = set(self.free_blocks), set(self.evictable)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert all(count >= 0 for count in self.ref_counts), "negative reference count"
        assert holders == self.ref_counts, "reference counts disagree with block tables"
        used = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert not (free & used) and not (idle & used) and not (free & idle), "a block is in two states"
        assert len(free) + len(idle) + len(used) == self.num_blocks, "a block is neither free, idle nor used"
        assert {b: h for h, b in self.cached.items()} == self.block_hash, "the name maps disagree"
        assert idle <= set(self.block_hash) and not (free & set(self.block_hash)), "an idle block has no name"

    def _hits(self, hashes: Seq[bytes]) -> list[int]:
        """The blocks of the longest prefix of `hashes` that is cached."""
        hits = []
        for name in hashes:
            block = self.cached.get(name)
            if block is None:
                break
            hits.append(block)
        return hits

    def _name(self, block: int, name: bytes) -> None:
        if name in self.cached:  # another sequence imported the same block in the meantime: keep the first
            return
        self.cached[name] = block
        self.block_hash[block] = name

    def _unname(self, block: int) -> None:
        name = self.block_hash.pop(block, None)
        if name is not None:
            del self.cached[name]

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # only idle named blocks are left: the least recently freed loses its name
            block, _ = self.evictable.popitem(last=False)
            self._unname(block)
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
