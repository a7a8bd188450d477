"""The exporter is the importer's inverse: pool KV -> llama.cpp rows -> import gives the pool's KV back."""

import numpy as np
import pytest
import torch

from contracts.handoff import KVHandoff, KVLayout
from contracts.identity import GGUFIdentity
from decode_gpu.kv.dequant import dequantize
from decode_gpu.kv.exporter import export_layers, permute_interleaved, quantize_rows
from decode_gpu.kv.importer import import_handoff, unpermute_interleaved
from decode_gpu.kv.pool import KVPool, PoolShape

HEADS, HEAD_DIM, LAYERS, BLOCK = 2, 64, 2, 4
IDENT = GGUFIdentity("m.gguf", "fp", "llama", LAYERS, 4, HEADS, HEAD_DIM, HEAD_DIM, "interleaved")


class Capture:
    def __init__(self):
        self.layers = {}

    def write_layer(self, layer, keys, values):
        self.layers[layer] = (keys.clone(), values.clone())


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "f16"])
def test_quantize_rows_is_dequantize_s_inverse(dtype):
    """Values already on a type's grid come back as the same bytes (ggml's reference rounding)."""
    x = torch.randn(6, 128)
    once = quantize_rows(x, dtype)
    grid = dequantize(once, dtype, 128, torch.device("cpu"))
    assert quantize_rows(grid, dtype) == once
    tolerance = {"q8_0": 0.02, "q4_0": 0.3, "f16": 1e-3}[dtype]
    assert (grid - x).abs().max().item() < tolerance * x.abs().max().item()


def test_q8_0_matches_ggml_rounding_half_away_from_zero():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, -0.5  # d = 1: 0.5 rounds to 1 and -0.5 to -1 (roundf), not to 0
    raw = np.frombuffer(quantize_rows(x, "q8_0"), dtype=np.uint8)
    assert raw[2:5].view(np.int8).tolist() == [127, 1, -1]


def test_permutation_inverts_the_importer_s():
    k = torch.randn(3, HEADS, HEAD_DIM)
    assert torch.equal(unpermute_interleaved(permute_interleaved(k)), k)


@pytest.mark.parametrize("storage", ["float32", "int8", "int4"])
@pytest.mark.parametrize("kv, rotation", [("f16", 0), ("q8_0", 64), ("q4_0", 64)])
def test_pool_to_rows_to_pool(storage, kv, rotation):
    """A sequence's KV written into the pool, exported, then imported again gives the pool's values back, within
    the wire type's rounding."""
    n = 10
    shape = PoolShape(LAYERS, 8, BLOCK, HEADS, HEAD_DIM, storage)
    pool = KVPool(shape, torch.device("cpu"))
    blocks = [5, 2, 7]
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    for layer in range(LAYERS):
        pool.write(layer, slots, torch.randn(n, HEADS, HEAD_DIM), torch.randn(n, HEADS, HEAD_DIM))
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM, HEAD_DIM, kv, kv, False, rotation, rotation, "interleaved")
    k_layers, v_layers = export_layers(pool.read_blocks(blocks), shape, n, layout)
    handoff = KVHandoff("r", "fp", layout, tuple(range(n)), tuple(range(n)), 0, k_layers, v_layers)
    got = Capture()
    import_handoff(handoff, IDENT, got, torch.device("cpu"))
    tolerance = {"f16": 2e-3, "q8_0": 0.03, "q4_0": 0.35}[kv]
    for layer in range(LAYERS):
        want_k, want_v = pool.gather(layer, slots, torch.float32)
        keys, values = got.layers[layer]
        keys = pool.rotate_k(keys)  # the pool gives int4 K back in its own rotated basis
        assert (keys - want_k).abs().max().item() < tolerance * want_k.abs().max().item()
        assert (values - want_v).abs().max().item() < tolerance * want_v.abs().max().item()
