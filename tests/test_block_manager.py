"""Block manager: capacity pairs, copy-on-write, and integrity under random operation sequences."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_gpu.block_manager import BlockManager, OutOfBlocksError


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
