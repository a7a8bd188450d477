"""Build llama_state_seq_get_data bytes by hand, to test the parser on layouts and corruptions."""

from __future__ import annotations

import struct


def state_bytes(n_tokens=3, n_layer=2, n_embd=64, ggml_type=1, type_size=2, v_trans=False, seq_id=0,
                magic=0xAF143CD8, positions=None, n_seq=1, layers_in_state=None, row_bytes=None,
                numbered_cells=False) -> bytes:
    """numbered_cells: each cell's K/V bytes are 10 * layer + cell index (+100 for V), to follow reordering."""
    out = struct.pack("<IiI", magic, seq_id, 1)
    out += struct.pack("<I", n_tokens)
    if n_tokens == 0:  # llama.cpp writes nothing more for an empty stream
        return out
    for pos in positions if positions is not None else range(n_tokens):
        out += struct.pack("<iI", pos, n_seq) + struct.pack("<i", seq_id) * n_seq
    out += struct.pack("<II", int(v_trans), layers_in_state if layers_in_state is not None else n_layer)
    row = row_bytes if row_bytes is not None else n_embd * type_size
    def cells(base: int, size: int) -> bytes:  # n_tokens cells of size bytes each
        if numbered_cells:
            return b"".join(bytes([base + 10 * (base % 100) + c]) * size for c in range(n_tokens))
        return bytes([base]) * (size * n_tokens)

    for il in range(n_layer):
        out += struct.pack("<iQ", ggml_type, row) + cells(il + 1, row)
    for il in range(n_layer):
        if v_trans:  # n_embd rows, each holding one element per cell
            out += struct.pack("<iII", ggml_type, type_size, n_embd) + cells(il + 100, type_size) * n_embd
        else:
            out += struct.pack("<iQ", ggml_type, row) + cells(il + 100, row)
    return out
