"""Device-side dequantization and un-rotation agree with independent references."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from decode_gpu.kv.dequant import dequantize
from decode_gpu.kv.importer import hadamard, unpermute_interleaved, unrotate

CPU = torch.device("cpu")


@pytest.mark.parametrize("name,qtype", [("q8_0", GGMLQuantizationType.Q8_0), ("q4_0", GGMLQuantizationType.Q4_0)])
def test_dequantize_matches_gguf_reference(name, qtype):
    values = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    blocks = quants.quantize(values, qtype)  # [6, row bytes]
    ours = dequantize(blocks.tobytes(), name, 128, CPU)
    reference = quants.dequantize(blocks, qtype)
    torch.testing.assert_close(ours, torch.from_numpy(reference.reshape(6, 128)), rtol=0, atol=1e-6)


def test_dequantize_f16():
    values = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float16)
    assert torch.equal(dequantize(values.tobytes(), "f16", 64, CPU), torch.from_numpy(values.astype(np.float32)))


@pytest.mark.parametrize("n", [64, 128])
def test_hadamard_is_orthonormal_involution(n):
    h = hadamard(n, CPU)
    torch.testing.assert_close(h @ h, torch.eye(n), atol=1e-6, rtol=0)
    torch.testing.assert_close(h, h.T)
    assert torch.allclose(h.abs(), torch.full((n, n), n ** -0.5))


def test_unrotate_undoes_blockwise_rotation():
    x = torch.randn(5, 3, 128)
    rotated = (x.reshape(5, 3, 2, 64) @ hadamard(64, CPU)).reshape(5, 3, 128)
    assert not torch.allclose(rotated, x)
    torch.testing.assert_close(unrotate(rotated, 64), x, atol=1e-5, rtol=0)


def test_unpermute_inverts_the_converter_permutation():
    d = 8
    hf = torch.arange(d, dtype=torch.float32)[None, None]  # [1, 1, d]
    interleaved = torch.stack([hf[..., : d // 2], hf[..., d // 2:]], dim=-1).reshape(1, 1, d)  # 0,4,1,5,...
    assert torch.equal(unpermute_interleaved(interleaved), hf)
