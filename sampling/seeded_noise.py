"""Counter-based sampling noise: a pure function of (seed, position, token id), computed on the device.

Why not a torch.Generator per request: that forces a loop over rows, and a generator's stream depends on
how many draws came before. Here a row's noise depends only on its seed and the position it samples, so a
seeded request gives the same tokens alone or in any batch, at any row, after preemption, in one batched op.

The hash is splitmix64 (Steele et al., "Fast splittable pseudorandom number generators", 2014) in int64
arithmetic: torch's int64 multiply wraps modulo 2**64 on the CPU and on CUDA, and its right shift is
arithmetic, so every shift is masked to make it logical.
"""

from __future__ import annotations

import torch


def _signed(constant: int) -> int:
    """A 64-bit constant as the int64 that has its bits."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


GOLDEN = _signed(0x9E3779B97F4A7C15)  # splitmix64's stream increment
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
_MANTISSA_BITS = 53  # random bits per draw: float32 keeps 24 of them, more where the value is small


def _shift_right(x: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of int64 values (into `out` when given)."""
    return torch.bitwise_right_shift(x, bits, out=out).bitwise_and_((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of int64 whose every output bit depends on every input bit."""
    return _mix64_(x.clone())


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """mix64 in place, with one scratch tensor: at [n, vocab], a fresh tensor per op costs more than the op."""
    shifted = torch.empty_like(x)
    for bits, multiplier in ((30, _MUL1), (27, _MUL2)):
        x.bitwise_xor_(_shift_right(x, bits, out=shifted)).mul_(multiplier)
    return x.bitwise_xor_(_shift_right(x, 31, out=shifted))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One key per row from its seed and the position it samples. # seeds, positions, result: [n] int64"""
    return _mix64_(mix64(seeds) + positions * GOLDEN)


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """-log(E) for E ~ Exp(1), independent per (row, token). # keys: [n] int64; result: [n, vocab] float32

    argmax(log p + noise) draws a token with probability p (the Gumbel-max trick, as an exponential race:
    the token whose E / p is smallest wins)."""
    counters = torch.arange(1, vocab + 1, device=keys.device) * GOLDEN  # [vocab] int64: splitmix64 stream steps
    bits = _mix64_(keys[:, None] + counters)  # [n, vocab] int64
    bits = _shift_right(bits, 64 - _MANTISSA_BITS, out=bits)  # [n, vocab]: the top 53 bits
    # a rare token wins only when its E is tiny, so E needs relative precision near 0: E = -log(1 - u) with u
    # small keeps it (float32 is fine-grained near 0), where -log(u) with u near 1 would round it away. The
    # clamp keeps u off 0 and 1: E = 0 would give a masked (-inf) token a NaN score, E = inf a kept one -inf
    uniform = bits.float().mul_(2.0 ** -_MANTISSA_BITS).clamp_(2.0 ** -_MANTISSA_BITS, 1 - 2.0 ** -24)  # [n, vocab]
    return uniform.neg_().log1p_().neg_().log_().neg_()  # [n, vocab]: -log(E), E = -log(1 - u) > 0
