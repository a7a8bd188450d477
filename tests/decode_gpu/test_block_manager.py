"""Block manager: capacity pairs, copy-on-write, and integrity under random operation sequences."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_gpu.core.block_manager import BlockManager, OutOfBlocksError, prefix_hashes


def test_allocate_append_free_round_trip():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.can_allocate(33) and not bm.can_allocate(65)
    assert len(bm.allocate("a", 33)) == 3
    assert bm.can_append("a", 48) and bm.append("a", 48) is None
    assert bm.num_used_blocks == 3
    assert bm.can_append("a", 49)
    bm.append("a", 49)
    assert not bm.can_append("a", 65)
    with pytest.raises(OutOfBlocksError):
        bm.append("a", 65)
    assert bm.free("a") == 4 and bm.num_free_blocks == 4
    bm.check_integrity()


def test_shared_block_is_copied_before_it_is_written():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("parent", 6)  # blocks: full + half-full
    bm.fork("parent", "child")
    assert bm.ref_counts[bm.block_tables["child"][1]] == 2
    copy = bm.append("child", 7)  # writes position 6, inside the shared half-full block
    assert copy is not None and copy.src == bm.block_tables["parent"][1] and copy.dst == bm.block_tables["child"][1]
    assert bm.block_tables["child"][0] == bm.block_tables["parent"][0]  # the full block stays shared
    bm.check_integrity()
    bm.free("parent")
    bm.free("child")
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_allocate_refuses_without_room():
    bm = BlockManager(num_blocks=2, block_size=8)
    with pytest.raises(OutOfBlocksError):
        bm.allocate("a", 17)
    bm.check_integrity()


operations = st.lists(st.tuples(st.sampled_from(["allocate", "append", "free", "fork"]),
                                st.integers(0, 5), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_integrity_holds_for_any_operation_sequence(ops):
    bm = BlockManager(num_blocks=12, block_size=4)
    lengths: dict[str, int] = {}
    for op, who, n in ops:
        seq = f"s{who}"
        if op == "allocate" and seq not in lengths and bm.can_allocate(n):
            bm.allocate(seq, n)
            lengths[seq] = n
        elif op == "append" and seq in lengths and bm.can_append(seq, lengths[seq] + n % 6):
            bm.append(seq, lengths[seq] + n % 6)
            lengths[seq] += n % 6
        elif op == "free":
            bm.free(seq)
            lengths.pop(seq, None)
        elif op == "fork" and seq in lengths and f"{seq}c" not in lengths:
            bm.fork(seq, f"{seq}c")
            lengths[f"{seq}c"] = lengths[seq]
        bm.check_integrity()
        for s, length in lengths.items():
            assert len(bm.block_tables[s]) >= bm.blocks_for(length)
    for seq in list(lengths):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == 12


# Prefix caching: prompts are drawn from a few shared prefixes so that hits, evictions and reuse all happen.
PREFIXES = [list(range(100, 112)), list(range(200, 212)), list(range(100, 106)) + list(range(300, 306))]


def _prompt(which: int, extra: int) -> list[int]:
    return PREFIXES[which % 3] + list(range(500, 500 + extra))


def test_a_shared_prefix_is_held_once_and_stays_cached_after_its_holders_finish():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = _prompt(0, 3)  # 15 tokens: three full blocks, one partial
    hashes = prefix_hashes(prompt, 4, "f16")
    assert len(hashes) == 3
    first, cached = bm.allocate_prefix("a", len(prompt) + 1, hashes)
    assert cached == 0 and bm.num_used_blocks == 4
    second, cached = bm.allocate_prefix("b", len(prompt) + 1, hashes)
    assert cached == 12 and second[:3] == first[:3] and second[3] != first[3]
    assert bm.num_used_blocks == 5 and (bm.num_cache_queries, bm.num_cache_hits) == (6, 3)
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 3  # idle, still named
    third, cached = bm.allocate_prefix("c", len(prompt) + 1, hashes)
    assert cached == 12 and third[:3] == first[:3]
    bm.check_integrity()


def test_the_salt_and_every_earlier_block_name_a_block():
    """Same tokens under another KV type, or after a different first block, are different blocks."""
    base = prefix_hashes(_prompt(0, 0), 4, "f16")
    assert prefix_hashes(_prompt(0, 0), 4, "q8_0") != base
    other = prefix_hashes(_prompt(2, 0), 4, "f16")  # the same first 4 tokens, then different ones
    assert other[0] == base[0] and other[1:] != base[1:]


def test_idle_named_blocks_are_reused_least_recently_freed_first_and_lose_their_names():
    bm = BlockManager(num_blocks=4, block_size=4)
    for i, which in enumerate((0, 1)):
        prompt = _prompt(which, 0)[:8]
        bm.allocate_prefix(f"s{i}", 8, prefix_hashes(prompt, 4, "f16"))
        bm.free(f"s{i}")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    bm.allocate("fresh", 5)  # two blocks: the oldest idle ones, s0's
    assert bm.num_cached_blocks == 2
    _, cached = bm.allocate_prefix("again", 8, prefix_hashes(_prompt(1, 0)[:8], 4, "f16"))
    assert cached == 8  # s1's blocks were kept
    bm.check_integrity()


def test_a_failed_import_forgets_its_names():
    bm = BlockManager(num_blocks=4, block_size=4)
    hashes = prefix_hashes(_prompt(0, 0), 4, "f16")
    bm.allocate_prefix("a", 13, hashes)
    bm.free("a", keep_names=False)
    assert bm.num_cached_blocks == 0 and len(bm.free_blocks) == 4
    bm.check_integrity()


cached_operations = st.lists(st.tuples(st.sampled_from(["allocate", "append", "free", "fork", "fail"]),
                                       st.integers(0, 5), st.integers(0, 20)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(cached_operations)
def test_integrity_holds_with_prefix_caching_for_any_operation_sequence(ops):
    """Fork, append, free (keeping or dropping names) and eviction in any order keep the books straight, and a
    hit always hands out the block that was named for exactly that prefix."""
    bm = BlockManager(num_blocks=12, block_size=4)
    lengths: dict[str, int] = {}
    named: dict[bytes, list[int]] = {}  # a prefix hash -> the prompt tokens it was made from
    for op, who, n in ops:
        seq = f"s{who}"
        if op == "allocate" and seq not in lengths:
            prompt = _prompt(who, n % 7)
            hashes = prefix_hashes(prompt, 4, "f16")
            if bm.can_allocate(len(prompt) + 1, hashes):
                table, cached = bm.allocate_prefix(seq, len(prompt) + 1, hashes)
                for i, name in enumerate(hashes[:cached // 4]):
                    assert named[name] == prompt[:4 * (i + 1)] and bm.cached[name] == table[i]
                named.update({name: prompt[:4 * (i + 1)] for i, name in enumerate(hashes)})
                lengths[seq] = len(prompt) + 1
        elif op == "append" and seq in lengths and bm.can_append(seq, lengths[seq] + n % 6):
            bm.append(seq, lengths[seq] + n % 6)
            lengths[seq] += n % 6
        elif op in ("free", "fail"):
            bm.free(seq, keep_names=op == "free")
            lengths.pop(seq, None)
        elif op == "fork" and seq in lengths and f"{seq}c" not in lengths:
            bm.fork(seq, f"{seq}c")
            lengths[f"{seq}c"] = lengths[seq]
        bm.check_integrity()
        for s, length in lengths.items():
            assert len(bm.block_tables[s]) >= bm.blocks_for(length)
    for seq in list(lengths):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == 12
