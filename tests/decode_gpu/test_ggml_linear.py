"""q8_0 decode weights on ggml's CPU kernels: the layer computes its dequantized blocks' product, graphs are built per
row count and give the same rows whatever the batch, the model and the engine decode with them, the CPU measurement
weighs them against torch's kernels, and they are refused off the CPU."""

import copy

import pytest
import torch
from torch import nn

from decode_gpu.model import ggml_linear
from decode_gpu.model.weight_plan import _measured_cpu_plan
from decode_gpu.model.weight_quant import held_weight_dtype, quantize_model, weight_bytes
from tiny_llama import TINY_LLAMA

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not ggml_linear.available(), reason="llama-cpp-python's ggml libraries not found")


def dequantized_q8_0(blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """ggml's block_q8_0 (a float16 scale, then 32 int8 codes) read back in torch: [out, in] float32."""
    raw = blocks.reshape(out_features, in_features // 32, 34)
    scales = raw[..., :2].contiguous().view(torch.float16).float()  # [out, in / 32, 1]
    codes = raw[..., 2:].contiguous().view(torch.int8).float()  # [out, in / 32, 32]
    return (codes * scales).reshape(out_features, in_features)


def test_a_q8_0_layer_is_the_product_of_its_dequantized_blocks():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    layer = ggml_linear.GGMLLinear(linear.weight, linear.bias, torch.float32)
    weight = dequantized_q8_0(layer.qweight, 96, 256)
    step = linear.weight.detach().abs().reshape(96, 8, 32).amax(-1, keepdim=True) / 127  # [out, blocks, 1]
    # half a step, and the float16 scale's rounding
    assert ((weight - linear.weight.detach()).reshape(96, 8, 32).abs() <= step * 0.6).all()
    x = torch.randn(5, 3, 256)
    expected = x @ weight.T + linear.bias.detach()
    got = layer(x)
    assert got.shape == (5, 3, 96) and got.dtype == torch.float32
    # ggml multiplies Q8_0 weights by activations it quantizes to Q8_0 too: about 0.5% of the norm
    assert (got - expected).norm() / expected.norm() < 0.02
    assert (got - x @ linear.weight.detach().T - linear.bias.detach()).norm() / expected.norm() < 0.02


def test_rows_do_not_depend_on_the_batch_and_graphs_are_reused():
    torch.manual_seed(1)
    layer = ggml_linear.GGMLLinear(torch.randn(64, 128), None, torch.float32)
    x = torch.randn(9, 128)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(9)])
    assert torch.equal(layer(x), alone)  # row by row as in a batch of 9: batch-invariant greedy text
    assert torch.equal(layer(x), layer(x.clone()))
    assert sorted(rows for rows, _ in layer._graphs) == [1, 9]
    twin = copy.deepcopy(layer)  # its own bytes, its own graphs
    assert twin.qweight.data_ptr() != layer.qweight.data_ptr() and not twin._graphs
    assert torch.equal(twin(x), layer(x))


def test_bfloat16_activations_come_back_in_bfloat16():
    torch.manual_seed(2)
    weight = torch.randn(32, 64)
    layer = ggml_linear.GGMLLinear(weight, None, torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    expected = x.float() @ weight.T
    assert (got.float() - expected).norm() / expected.norm() < 0.02


def test_a_quantized_model_holds_q8_0_and_keeps_its_logits():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    ids = torch.tensor([[5, 9, 200, 31]])
    reference = model(ids).logits
    before = sum(weight_bytes(model).values())
    quantize_model(model, "q8_0", CPU, torch.float32, float_above=2)
    assert held_weight_dtype(model) == "q8_0 up to batch 2, float32 above"
    assert isinstance(model.lm_head, ggml_linear.GGMLLinear)
    cosine = nn.functional.cosine_similarity(model(ids).logits.flatten(), reference.flatten(), dim=0)
    assert cosine > 0.999
    bare = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    quantize_model(bare, "q8_0", CPU, torch.float32)
    assert sum(weight_bytes(bare).values()) < 0.4 * before  # 34 bytes per 32 weights, and the int8 embedding


def test_a_partial_block_is_refused_before_ggml_sees_it():
    with pytest.raises(ValueError, match="divisible by 32"):
        ggml_linear.GGMLLinear(torch.randn(8, 48), None, torch.float32)


def test_q8_0_weights_are_refused_off_the_cpu():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    with pytest.raises(ValueError, match="q8_0"):
        quantize_model(model, "q8_0", torch.device("meta"), torch.float32)


def test_the_cpu_measurement_weighs_q8_0_against_torch_kernels_and_float():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    plan = _measured_cpu_plan(model, 4, ("int8", "q8_0"))
    assert "float/int8 by batch 1:" in plan.why and "float/q8_0 by batch 1:" in plan.why
    assert plan.weight_dtype in ("float", "int8", "q8_0")
    if plan.weight_dtype == "q8_0":
        assert all(isinstance(m, ggml_linear.GGMLLinear) for m in plan.prebuilt.values())
    if plan.weight_dtype != "float":
        candidate = copy.deepcopy(model)
        quantize_model(candidate, plan.weight_dtype, CPU, torch.float32, plan.float_above, plan.prebuilt)
        assert held_weight_dtype(candidate).startswith(plan.weight_dtype)


def test_auto_on_the_cpu_measures_q8_0_only_where_ggml_loads(monkeypatch):
    from decode_gpu.model import weight_plan
    seen = []

    def measured(model, max_batch, kinds, head_int8):
        seen.append(kinds)
        return weight_plan.WeightPlan("float", "measured")

    monkeypatch.setattr(weight_plan, "_measured_cpu_plan", measured)
    # an AVX-512 CPU, where torch's int4 is measured too (without it only ggml's q8_0: test_weight_switch.py)
    monkeypatch.setattr(weight_plan.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    types = weight_plan.GGUFWeightTypes(frozenset({"Q4_1"}), "Q8_0")
    weight_plan.auto_weight_plan(CPU, types, model=nn.Linear(32, 32))
    monkeypatch.setattr(ggml_linear, "available", lambda: False)
    weight_plan.auto_weight_plan(CPU, types, model=nn.Linear(32, 32))
    assert seen == [("int4", "q8_0"), ("int4",)]
