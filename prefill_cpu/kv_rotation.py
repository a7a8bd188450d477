"""Which Hadamard rotation llama.cpp applies to the quantized KV it stores, read from its context log."""

from __future__ import annotations

import re

from contracts.identity import GGUFIdentity


def rotations_from_log(text: str, ident: GGUFIdentity) -> tuple[int, int] | None:
    """(K block, V block) of the rotation llama.cpp applied, 0 for none, as it logged it with the block sizes it
    uses; None when the log does not say (another llama-cpp-python than the pinned one)."""
    k_flag = re.search(r"attn_rot_k = (\d)", text)
    v_flag = re.search(r"attn_rot_v = (\d)", text)
    if not k_flag or not v_flag:
        return None
    k_block = _largest_pow2_block(ident.head_dim_k) if k_flag.group(1) == "1" else 0
    v_block = 64 if v_flag.group(1) == "1" else 0  # llama.cpp rotates V in blocks of 64
    return k_block, v_block


def _largest_pow2_block(head_dim: int) -> int:
    """llama.cpp rotates K in the largest power-of-two block (at least 64) that divides the head size."""
    block = 64
    while head_dim % (block * 2) == 0:
        block *= 2
    return block
