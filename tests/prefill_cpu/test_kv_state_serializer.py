"""serialize_seq_state is the exact inverse of parse_seq_state: llama.cpp's own bytes come back byte for byte."""

import os
import struct

import pytest

from contracts.handoff import KVHandoff, KVLayout
from kv_state_bytes import state_bytes
from prefill_cpu.kv_state import KVStateFormatError, parse_seq_state, serialize_seq_state, state_from_handoff


@pytest.mark.parametrize("kwargs", [
    dict(n_tokens=3),
    dict(n_tokens=5, v_trans=True),
    dict(n_tokens=4, ggml_type=8, type_size=34, row_bytes=68),
    dict(n_tokens=2, ggml_type=2, type_size=18, row_bytes=36, n_layer=3),
    dict(n_tokens=7, numbered_cells=True, seq_id=3),
])
def test_serialize_gives_back_the_parsed_bytes(kwargs):
    raw = state_bytes(**kwargs)
    n_layer = kwargs.get("n_layer", 2)
    state = parse_seq_state(raw, n_layer, 64, 64)
    assert serialize_seq_state(state, 64, 64) == raw


def test_random_payloads_round_trip():
    """Random K/V bytes of every layer survive serialize -> parse unchanged."""
    state = parse_seq_state(state_bytes(n_tokens=6, ggml_type=8, type_size=34, row_bytes=68), 2, 64, 64)
    k = tuple(os.urandom(6 * 68) for _ in range(2))
    v = tuple(os.urandom(6 * 68) for _ in range(2))
    again = parse_seq_state(serialize_seq_state(state.__class__(0, state.positions, False, state.k_dtype,
                                                                state.v_dtype, k, v), 64, 64), 2, 64, 64)
    assert again.k_layers == k and again.v_layers == v and again.positions == tuple(range(6))


def test_shuffled_cells_serialize_in_position_order():
    """A state parsed from cells out of order is written in position order (what llama.cpp reads back alike)."""
    shuffled = parse_seq_state(state_bytes(n_tokens=3, numbered_cells=True, positions=[2, 0, 1]), 2, 64, 64)
    raw = serialize_seq_state(shuffled, 64, 64)
    assert [struct.unpack_from("<i", raw, 16 + 12 * i)[0] for i in range(3)] == [0, 1, 2]
    assert parse_seq_state(raw, 2, 64, 64) == shuffled


def test_from_a_handoff():
    layout = KVLayout(n_layer=2, num_kv_heads=1, head_dim_k=64, head_dim_v=64, k_dtype="q8_0", v_dtype="q8_0",
                      v_transposed=False, k_rotation=64, v_rotation=64, rope_layout="interleaved")
    k = tuple(os.urandom(4 * 68) for _ in range(2))
    v = tuple(os.urandom(4 * 68) for _ in range(2))
    handoff = KVHandoff("r", "fp", layout, (0, 1, 2, 3), (5, 6, 7, 8), 9, k, v)
    state = parse_seq_state(serialize_seq_state(state_from_handoff(handoff), 64, 64), 2, 64, 64)
    assert state.k_layers == k and state.v_layers == v and state.k_dtype.name == "q8_0"


@pytest.mark.parametrize("change, message", [
    (dict(positions=(1, 2, 3)), "positions 0..n-1"),
    (dict(positions=()), "positions 0..n-1"),
    (dict(k_layers=(b"\0" * 10, b"\0" * 10)), "K of layer 0 is 10 bytes"),
    (dict(swa_layers=(1,)), "sliding-window"),
])
def test_refuses_what_llama_cpp_would_misread(change, message):
    state = parse_seq_state(state_bytes(n_tokens=3), 2, 64, 64)
    with pytest.raises(KVStateFormatError, match=message):
        serialize_seq_state(state.__class__(**{**state.__dict__, **change}), 64, 64)
