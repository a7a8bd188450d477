"""Parser for the bytes of llama.cpp's `llama_state_seq_get_data` (llama-cpp-python 0.3.36).

Layout (vendor/llama.cpp/src/llama-context.cpp and llama-kv-cache.cpp, `state_write*`):
    u32 magic 0xaf143cd8, i32 seq_id, u32 n_stream, then per stream:
      u32 cell_count; if cell_count: cell_count x (i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id),
      u32 v_trans, u32 n_layer,
      n_layer x (i32 k_type, u64 k_row_bytes, cell_count rows of K),
      if v_trans == 0: n_layer x (i32 v_type, u64 v_row_bytes, cell_count rows of V)
      else:            n_layer x (i32 v_type, u32 elem_bytes, u32 n_embd_v, n_embd_v x cell_count elements)
Cells come in cell order, which is position order for a fresh prompt but not for one that reused cached
cells (prefill_cpu.prefix_cache); the parser puts them in position order. Any other deviation raises
KVStateFormatError: we never hand garbage to the decoder.

A model with sliding-window layers (Gemma 2/3) has two caches (llama-kv-cache-iswa.cpp): after the header come
the global layers' streams, then the sliding layers' streams, each as above with its own layer count. The
sliding cache exports only the cells its window still sees: the last positions of the prompt.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from contracts.handoff import KVHandoff
from contracts.kv_dtypes import KVDType, kv_dtype, kv_dtype_for_ggml_type

STATE_SEQ_MAGIC = 0xAF143CD8


class KVStateFormatError(ValueError):
    """llama.cpp's sequence state is not laid out as this parser (and llama-cpp-python 0.3.36) expects."""


@dataclass(frozen=True)
class SeqKVState:
    seq_id: int
    positions: tuple[int, ...]  # position of each exported cell: 0..n-1 (cells are put in position order)
    v_transposed: bool  # True: V stored [n_embd_v, n_cells] (flash attention off)
    k_dtype: KVDType
    v_dtype: KVDType
    k_layers: tuple[bytes, ...]  # per layer: n_cells rows of n_embd_k elements, as llama.cpp stores them
    v_layers: tuple[bytes, ...]  # per layer: rows (v_transposed False) or n_embd_v columns of n_cells elements
    swa_layers: tuple[int, ...] = ()  # sliding-window layers: their cells are positions swa_start .. n-1 only
    swa_start: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.positions)


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise KVStateFormatError(f"state ends at byte {len(self.buf)} while reading {what} at byte {self.pos}")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def take(self, size: int, what: str) -> bytes:
        if self.pos + size > len(self.buf):
            raise KVStateFormatError(
                f"state ends at byte {len(self.buf)}, {what} needs {size} bytes from byte {self.pos}")
        out = bytes(self.buf[self.pos:self.pos + size])
        self.pos += size
        return out


def parse_seq_state(buf: bytes, n_layer: int, n_embd_k: int, n_embd_v: int,
                    swa_layers: tuple[int, ...] = ()) -> SeqKVState:
    """Parse one sequence's exported state; n_layer/n_embd_* come from the GGUF and are checked, not trusted."""
    r = _Reader(buf)
    magic, seq_id = r.unpack("<Ii", "header")
    if magic != STATE_SEQ_MAGIC:
        raise KVStateFormatError(f"bad magic 0x{magic:08x}, expected 0x{STATE_SEQ_MAGIC:08x} "
                                 "(is llama-cpp-python pinned to 0.3.36?)")
    found = _parse_cache(r, seq_id, n_layer - len(swa_layers), n_embd_k, n_embd_v, "the KV cache")
    if swa_layers:
        window = _parse_cache(r, seq_id, len(swa_layers), n_embd_k, n_embd_v, "the sliding-window KV cache",
                              n_tokens=found.n_tokens)
        found = _merge_window(found, window, n_layer, swa_layers)
    if r.pos != len(r.buf):
        raise KVStateFormatError(f"{len(r.buf) - r.pos} trailing bytes after the last stream")
    return found


def _parse_cache(r: _Reader, seq_id: int, n_layer: int, n_embd_k: int, n_embd_v: int, what: str,
                 n_tokens: int | None = None) -> SeqKVState:
    """One cache's streams. n_tokens: the prompt's length, for a sliding-window cache that holds its tail only."""
    (n_stream,) = r.unpack("<I", f"stream count of {what}")
    if not 1 <= n_stream <= 4096:
        raise KVStateFormatError(f"implausible stream count {n_stream} in {what}")
    found = None
    for _ in range(n_stream):
        (cell_count,) = r.unpack("<I", "cell count")
        if cell_count == 0:
            continue
        if found is not None:
            raise KVStateFormatError(f"more than one stream of {what} holds cells for one sequence")
        first = 0 if n_tokens is None else n_tokens - cell_count
        found = _parse_stream(r, seq_id, cell_count, n_layer, n_embd_k, n_embd_v, first)
    if found is None:
        raise KVStateFormatError(f"sequence {seq_id} has no cells in {what}")
    return found


def _merge_window(base: SeqKVState, window: SeqKVState, n_layer: int, swa_layers: tuple[int, ...]) -> SeqKVState:
    """The model's layers in order: the global ones from the base cache, the sliding ones from the window's."""
    if (window.k_dtype, window.v_dtype, window.v_transposed) != (base.k_dtype, base.v_dtype, base.v_transposed):
        raise KVStateFormatError("the sliding-window cache's types or V layout differ from the base cache's")
    layers = (base.k_layers, base.v_layers, window.k_layers, window.v_layers)
    k_base, v_base, k_window, v_window = (iter(x) for x in layers)
    k_layers = tuple(next(k_window if il in swa_layers else k_base) for il in range(n_layer))
    v_layers = tuple(next(v_window if il in swa_layers else v_base) for il in range(n_layer))
    return SeqKVState(base.seq_id, base.positions, base.v_transposed, base.k_dtype, base.v_dtype, k_layers, v_layers,
                      tuple(swa_layers), window.positions[0])


def _parse_stream(r: _Reader, seq_id: int, cell_count: int, n_layer: int, n_embd_k: int, n_embd_v: int,
                  first: int = 0) -> SeqKVState:
    order = _parse_cells(r, seq_id, cell_count, first)  # cell indices in position order
    v_trans, layers_in_state = r.unpack("<II", "v_trans and n_layer")
    if v_trans not in (0, 1):
        raise KVStateFormatError(f"v_trans is {v_trans}, expected 0 or 1")
    if layers_in_state != n_layer:
        raise KVStateFormatError(f"state has {layers_in_state} layers, the model has {n_layer}")
    k_dtype, k_layers = _parse_row_layers(r, "K", cell_count, n_layer, n_embd_k)
    if v_trans:
        v_dtype, v_layers = _parse_transposed_layers(r, cell_count, n_layer, n_embd_v)
    else:
        v_dtype, v_layers = _parse_row_layers(r, "V", cell_count, n_layer, n_embd_v)
    if order is not None:
        k_layers = tuple(_reorder_rows(layer, order) for layer in k_layers)
        v_layers = tuple(_reorder_columns(layer, order, n_embd_v) if v_trans else _reorder_rows(layer, order)
                         for layer in v_layers)
    return SeqKVState(seq_id, tuple(range(first, first + cell_count)), bool(v_trans), k_dtype, v_dtype, k_layers,
                      v_layers)


def _reorder_rows(layer: bytes, order: np.ndarray) -> bytes:
    rows = np.frombuffer(layer, dtype=np.uint8).reshape(len(order), -1)
    return rows[order].tobytes()


def _reorder_columns(layer: bytes, order: np.ndarray, n_embd: int) -> bytes:
    columns = np.frombuffer(layer, dtype=np.uint8).reshape(n_embd, len(order), -1)
    return columns[:, order, :].tobytes()


def _parse_cells(r: _Reader, seq_id: int, cell_count: int, first: int) -> np.ndarray | None:
    """None when the cells are already in position order first..first+n-1, else the cell order that makes them so."""
    positions = []
    for i in range(cell_count):
        pos, n_seq = r.unpack("<iI", f"cell {i}")
        if n_seq != 1:
            raise KVStateFormatError(f"cell {i} belongs to {n_seq} sequences, expected exactly 1")
        (owner,) = r.unpack("<i", f"cell {i} seq id")
        if owner != seq_id:
            raise KVStateFormatError(f"cell {i} belongs to sequence {owner}, expected {seq_id}")
        positions.append(pos)
    expected = list(range(first, first + cell_count))
    if positions == expected:
        return None
    if sorted(positions) != expected:
        raise KVStateFormatError(f"cell positions are not a permutation of {first}..{first + cell_count - 1}; "
                                 "the sequence is not one prompt")
    return np.argsort(np.asarray(positions), kind="stable")


def _parse_row_layers(r: _Reader, name: str, cell_count: int, n_layer: int, n_embd: int):
    dtype, layers = None, []
    for il in range(n_layer):
        type_id, row_bytes = r.unpack("<iQ", f"{name} header of layer {il}")
        dtype = _same_dtype(dtype, type_id, name, il)
        if row_bytes != dtype.row_bytes(n_embd):
            raise KVStateFormatError(f"{name} row of layer {il} is {row_bytes} bytes, "
                                     f"expected {dtype.row_bytes(n_embd)} for {n_embd} {dtype.name} elements")
        layers.append(r.take(row_bytes * cell_count, f"{name} of layer {il}"))
    return dtype, tuple(layers)


def _parse_transposed_layers(r: _Reader, cell_count: int, n_layer: int, n_embd: int):
    dtype, layers = None, []
    for il in range(n_layer):
        type_id, elem_bytes, n_embd_state = r.unpack("<iII", f"V header of layer {il}")
        dtype = _same_dtype(dtype, type_id, "V", il)
        if dtype.quantized or elem_bytes != dtype.block_bytes or n_embd_state != n_embd:
            raise KVStateFormatError(f"transposed V of layer {il}: type {dtype.name}, {elem_bytes}-byte elements, "
                                     f"{n_embd_state} rows; expected unquantized, {n_embd} rows")
        layers.append(r.take(elem_bytes * n_embd * cell_count, f"V of layer {il}"))
    return dtype, tuple(layers)


def _same_dtype(previous: KVDType | None, type_id: int, name: str, il: int) -> KVDType:
    try:
        dtype = kv_dtype_for_ggml_type(type_id)
    except ValueError as err:
        raise KVStateFormatError(f"{name} of layer {il}: {err}") from None
    if previous is not None and dtype != previous:
        raise KVStateFormatError(f"{name} of layer {il} is {dtype.name}, earlier layers are {previous.name}")
    return dtype


def serialize_seq_state(state: SeqKVState, n_embd_k: int, n_embd_v: int) -> bytes:
    """The inverse of parse_seq_state for a state whose cells are in position order 0..n-1 (what the parser gives
    back): bytes llama_state_seq_set_data accepts, so that KV made elsewhere (the decode engine's answer, a handoff)
    becomes a llama.cpp sequence again. One stream; sliding-window states are refused (their second cache holds only
    the window, and the prompt cache is off for such models anyway)."""
    if state.swa_layers:
        raise KVStateFormatError("a state with sliding-window layers cannot be written back")
    n, n_layer = state.n_tokens, len(state.k_layers)
    if state.positions != tuple(range(n)) or n == 0:
        raise KVStateFormatError("only a state of positions 0..n-1 (n > 0) is written back")
    if len(state.v_layers) != n_layer:
        raise KVStateFormatError(f"{n_layer} K layers but {len(state.v_layers)} V layers")
    parts = [struct.pack("<IiII", STATE_SEQ_MAGIC, state.seq_id, 1, n)]
    parts.append(b"".join(struct.pack("<iIi", pos, 1, state.seq_id) for pos in state.positions))
    parts.append(struct.pack("<II", int(state.v_transposed), n_layer))
    k_row = state.k_dtype.row_bytes(n_embd_k)
    for il, layer in enumerate(state.k_layers):
        _check_size(layer, k_row * n, "K", il)
        parts += [struct.pack("<iQ", state.k_dtype.ggml_type, k_row), layer]
    for il, layer in enumerate(state.v_layers):
        if state.v_transposed:
            if state.v_dtype.quantized:
                raise KVStateFormatError("a transposed V cannot be quantized")
            _check_size(layer, state.v_dtype.block_bytes * n_embd_v * n, "V", il)
            parts += [struct.pack("<iII", state.v_dtype.ggml_type, state.v_dtype.block_bytes, n_embd_v), layer]
        else:
            v_row = state.v_dtype.row_bytes(n_embd_v)
            _check_size(layer, v_row * n, "V", il)
            parts += [struct.pack("<iQ", state.v_dtype.ggml_type, v_row), layer]
    return b"".join(parts)


def state_from_handoff(handoff: KVHandoff, seq_id: int = 0) -> SeqKVState:
    """A handoff's KV (its own encoding: llama.cpp's rows) as a sequence state, for serialize_seq_state."""
    lay = handoff.layout
    return SeqKVState(seq_id, tuple(handoff.positions), lay.v_transposed, kv_dtype(lay.k_dtype), kv_dtype(lay.v_dtype),
                      tuple(handoff.k_layers), tuple(handoff.v_layers), tuple(lay.swa_layers), lay.swa_start)


def _check_size(layer: bytes, expected: int, name: str, il: int) -> None:
    if len(layer) != expected:
        raise KVStateFormatError(f"{name} of layer {il} is {len(layer)} bytes, expected {expected}")
