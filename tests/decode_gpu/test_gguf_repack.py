"""The engine's repacked GGUF matrices (weight_repack, the memory plan's choice where the copy fits): llama.cpp's CPU
repack of a matrix's blocks into its interleaved layout, multiplied by ggml's repacked kernels, gives the products
of the mapped blocks (to float rounding) at every row count; a matrix with no repacked layout for its type or shape
stays mapped (never an abort in ggml); the loader reports the repacked bytes apart from the mapped ones."""

import pytest
import torch

from decode_gpu.model import ggml_linear
from decode_gpu.model.gguf_layers import GGUFLinear

Q4_0, Q8_0, Q2_K, Q4_K, Q6_K = 2, 8, 10, 12, 14  # ggml_type ids


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return " avx2" in fh.read()
    except OSError:
        return False


pytestmark = [pytest.mark.skipif(not ggml_linear.available(), reason="llama-cpp-python's ggml libraries not found"),
              pytest.mark.skipif(not _has_avx2(), reason="ggml's repacked layouts are chosen for x86 with AVX2 here")]


def blocks_of(ggml_type: int, out_features: int, in_features: int = 512) -> torch.Tensor:
    """A random [out, in] matrix quantized by ggml itself to `ggml_type` blocks. # [out * row bytes] uint8"""
    lib = ggml_linear.library()
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features))
    blocks = torch.empty(lib.row_size(ggml_type, in_features) * out_features, dtype=torch.uint8)
    lib.quantize_chunk(ggml_type, weight.data_ptr(), blocks.data_ptr(), 0, out_features, in_features, None)
    return blocks


@pytest.mark.parametrize("ggml_type", [Q4_K, Q4_0, Q2_K])  # contracts.model_sizes.ENGINE_REPACKED
def test_repacked_blocks_give_the_mapped_blocks_products_at_every_row_count(ggml_type):
    blocks = blocks_of(ggml_type, 64)
    mapped = GGUFLinear(blocks, ggml_type, 512, 64, None, torch.float32)
    repacked = GGUFLinear(blocks, ggml_type, 512, 64, None, torch.float32, repack=True)
    assert mapped.repacked is None and repacked.repacked is not None
    assert repacked.repacked.nbytes >= blocks.numel()  # memory of its own, beside the blocks
    for rows in (1, 3, 4, 16, 17):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(repacked.product(x), mapped.product(x), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("ggml_type,out_features", [(Q4_K, 36), (Q6_K, 64), (Q8_0, 64)])
def test_a_matrix_with_no_repacked_layout_stays_mapped(ggml_type, out_features):
    """36 output rows: not a multiple of the 8 rows Q4_K's layout interleaves; Q6_K and Q8_0: no x86 layout."""
    blocks = blocks_of(ggml_type, out_features)
    layer = GGUFLinear(blocks, ggml_type, 512, out_features, None, torch.float32, repack=True)
    mapped = GGUFLinear(blocks, ggml_type, 512, out_features, None, torch.float32)
    assert layer.repacked is None
    x = torch.randn(2, 512)
    torch.testing.assert_close(layer.product(x), mapped.product(x))


def test_a_copy_of_a_repacked_layer_multiplies_its_mapped_blocks():
    import copy
    blocks = blocks_of(Q4_K, 64)
    layer = GGUFLinear(blocks, Q4_K, 512, 64, None, torch.float32, repack=True)
    twin = copy.deepcopy(layer)
    assert twin.repacked is None
    x = torch.randn(4, 512)
    torch.testing.assert_close(twin.product(x), layer.product(x), rtol=1e-4, atol=1e-3)
