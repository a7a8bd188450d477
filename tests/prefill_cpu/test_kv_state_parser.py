"""The llama.cpp state parser accepts both V layouts and refuses every malformed layout clearly."""

import pytest

from kv_state_bytes import state_bytes
from prefill_cpu.kv_state import KVStateFormatError, parse_seq_state


def test_parses_row_layout():
    state = parse_seq_state(state_bytes(n_tokens=3), n_layer=2, n_embd_k=64, n_embd_v=64)
    assert state.positions == (0, 1, 2)
    assert not state.v_transposed
    assert state.k_dtype.name == "f16" and state.v_dtype.name == "f16"
    assert state.k_layers[1] == bytes([2]) * (3 * 128)
    assert state.v_layers[0] == bytes([100]) * (3 * 128)


def test_parses_transposed_v_layout():
    state = parse_seq_state(state_bytes(n_tokens=5, v_trans=True), n_layer=2, n_embd_k=64, n_embd_v=64)
    assert state.v_transposed
    assert len(state.v_layers[1]) == 5 * 64 * 2


def test_parses_q8_0_rows():
    state = parse_seq_state(state_bytes(n_tokens=2, ggml_type=8, row_bytes=68), n_layer=2, n_embd_k=64, n_embd_v=64)
    assert state.k_dtype.name == "q8_0"
    assert len(state.k_layers[0]) == 2 * 68


@pytest.mark.parametrize("v_trans", [False, True])
def test_cells_out_of_position_order_are_put_in_order(v_trans):
    """A prompt that reused cached cells can be exported with its cells in any order."""
    plain = parse_seq_state(state_bytes(n_tokens=3, numbered_cells=True, v_trans=v_trans), 2, 64, 64)
    shuffled = parse_seq_state(state_bytes(n_tokens=3, numbered_cells=True, v_trans=v_trans, positions=[2, 0, 1]),
                               2, 64, 64)
    assert shuffled.positions == (0, 1, 2)
    # cell c of the shuffled state holds position positions[c]: position 0 is cell 1, 1 is cell 2, 2 is cell 0
    for plain_layer, shuffled_layer in zip(plain.k_layers + plain.v_layers, shuffled.k_layers + shuffled.v_layers):
        cell_size = len(plain_layer) // 3
        if v_trans and plain_layer in plain.v_layers:
            continue  # checked below, column-wise
        cells = [shuffled_layer[i * cell_size:(i + 1) * cell_size] for i in range(3)]
        want = [plain_layer[i * cell_size:(i + 1) * cell_size] for i in (1, 2, 0)]
        assert cells == want
    if v_trans:
        row = shuffled.v_layers[0][:3 * 2]  # the first embedding row: one 2-byte element per position
        plain_row = plain.v_layers[0][:3 * 2]
        assert row == plain_row[2:4] + plain_row[4:6] + plain_row[0:2]


BAD_STATES = [
    (dict(magic=0xDEADBEEF), "bad magic"),
    (dict(layers_in_state=3), "state has 3 layers, the model has 2"),
    (dict(row_bytes=100), "row of layer 0 is 100 bytes, expected 128"),
    (dict(ggml_type=23), "ggml type 23"),
    (dict(n_seq=2), "belongs to 2 sequences"),
    (dict(positions=[0, 2, 3]), "positions are not a permutation of 0..2"),
    (dict(positions=[0, 1, 1]), "positions are not a permutation of 0..2"),
    (dict(n_tokens=0), "has no cells"),
    (dict(ggml_type=8, type_size=34, row_bytes=68, v_trans=True), "transposed V of layer 0"),
]


@pytest.mark.parametrize("kwargs,message", BAD_STATES, ids=[m for _, m in BAD_STATES])
def test_refuses_malformed_state(kwargs, message):
    with pytest.raises(KVStateFormatError, match=message):
        parse_seq_state(state_bytes(**kwargs), n_layer=2, n_embd_k=64, n_embd_v=64)


def test_refuses_truncated_state():
    data = state_bytes(n_tokens=4)
    for cut in (3, 20, len(data) // 2, len(data) - 1):
        with pytest.raises(KVStateFormatError, match="state ends at byte"):
            parse_seq_state(data[:cut], n_layer=2, n_embd_k=64, n_embd_v=64)


def test_refuses_trailing_bytes():
    with pytest.raises(KVStateFormatError, match="trailing bytes"):
        parse_seq_state(state_bytes() + b"\0\0\0\0", n_layer=2, n_embd_k=64, n_embd_v=64)


def test_refuses_shape_other_than_the_model():
    with pytest.raises(KVStateFormatError, match="expected 256 for 128 f16"):
        parse_seq_state(state_bytes(), n_layer=2, n_embd_k=128, n_embd_v=64)


def test_parses_a_sliding_window_cache_after_the_base_cache():
    """Gemma: the global layers' cache, then the sliding layers' cache holding the window's tail of the prompt.
    The layers come back in model order: 0 and 2 global (from the base), 1 sliding (from the window)."""
    base = state_bytes(n_tokens=4, n_layer=2)
    window = state_bytes(n_tokens=2, n_layer=1, positions=[2, 3])[8:]  # no second header: n_stream onwards
    state = parse_seq_state(base + window, n_layer=3, n_embd_k=64, n_embd_v=64, swa_layers=(1,))
    assert state.positions == (0, 1, 2, 3) and state.swa_layers == (1,) and state.swa_start == 2
    assert state.k_layers[0] == bytes([1]) * (4 * 128) and state.k_layers[2] == bytes([2]) * (4 * 128)
    assert state.k_layers[1] == bytes([1]) * (2 * 128) and state.v_layers[1] == bytes([100]) * (2 * 128)


def test_a_window_that_is_not_the_prompt_tail_is_refused():
    base = state_bytes(n_tokens=4, n_layer=2)
    window = state_bytes(n_tokens=2, n_layer=1, positions=[1, 2])[8:]
    with pytest.raises(KVStateFormatError, match="not a permutation of 2..3"):
        parse_seq_state(base + window, n_layer=3, n_embd_k=64, n_embd_v=64, swa_layers=(1,))
