"""q/k/v and gate/up stacked into one matrix each (decode_gpu.model.fused_projections): the same numbers as the separate
layers, as float, prepacked bfloat16 and int4 weights, and in the engine."""

import copy

import pytest
import torch
from torch import nn

from decode_gpu.model.fused_projections import FusedSlice, fuse_projections
from decode_gpu.model.packed_linear import pack_linears, packs
from decode_gpu.model.weight_quant import quantize_model, weight_bytes
from tiny_llama import TINY_LLAMA, greedy_tokens, tiny_engine_setup

CPU = torch.device("cpu")
IDS = (torch.tensor([[5, 9, 200, 31]]), torch.randint(0, 300, (3, 6), generator=torch.Generator().manual_seed(1)))


def _tiny(family: str = "llama") -> nn.Module:
    torch.manual_seed(0)
    if family == "qwen2":  # q/k/v with a bias
        from transformers import Qwen2Config, Qwen2ForCausalLM
        return Qwen2ForCausalLM(Qwen2Config(**TINY_LLAMA)).eval()
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


def _logits(model: nn.Module) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(ids).logits for ids in IDS]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stacked_projections_give_the_separate_layers_numbers(family):
    plain = _tiny(family)
    model = copy.deepcopy(plain)
    layers = TINY_LLAMA["num_hidden_layers"]
    assert fuse_projections(model) == 2 * layers
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(getattr(attention, n), FusedSlice) for n in ("q_proj", "k_proj", "v_proj"))
    assert all(isinstance(getattr(mlp, n), FusedSlice) for n in ("gate_proj", "up_proj"))
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 4 * layers + 1  # qkv, gate_up, o, down; lm_head
    assert weight_bytes(model) == weight_bytes(plain)  # the same weights, stacked
    for fused, separate in zip(_logits(model), _logits(plain)):
        torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packs(CPU, torch.bfloat16), reason="no oneDNN bfloat16 kernels on this CPU")
def test_stacked_prepacked_bfloat16_is_bit_for_bit_the_separate_layers():
    plain = _tiny().to(torch.bfloat16)
    model = copy.deepcopy(plain)
    fuse_projections(model)
    pack_linears(model)
    pack_linears(plain)
    for fused, separate in zip(_logits(model), _logits(plain)):
        assert torch.equal(fused, separate)


def test_stacked_int4_layers_quantize_each_row_as_the_separate_ones():
    plain = _tiny()
    model = copy.deepcopy(plain)
    fuse_projections(model)
    for m in (model, plain):
        quantize_model(m, "int4", CPU, torch.bfloat16)
        m.to(torch.bfloat16)
    assert weight_bytes(model) == weight_bytes(plain)
    for fused, separate in zip(_logits(model), _logits(plain)):
        torch.testing.assert_close(fused, separate, rtol=0.02, atol=0.02)  # the same codes; kernel order may differ


def test_a_slice_handed_another_input_computes_it_rather_than_reuse_a_product():
    model = _tiny()
    attention = model.model.layers[0].self_attn
    k_proj = copy.deepcopy(attention.k_proj)
    fuse_projections(model)
    x, other = torch.randn(2, 384), torch.randn(2, 384)
    with torch.inference_mode():
        attention.q_proj(x)
        torch.testing.assert_close(attention.k_proj(other), k_proj(other))
        torch.testing.assert_close(attention.k_proj(x), k_proj(x))
        attention.v_proj(x)  # the last of the group drops the kept product
    assert attention.q_proj._group.output is None


@pytest.mark.slow
def test_the_engine_decodes_the_same_tokens_with_stacked_projections():
    model, identity, handoffs = tiny_engine_setup("cpu")
    expected = greedy_tokens(copy.deepcopy(model), identity, handoffs, "cpu", "float32")
    assert fuse_projections(model) == 2 * TINY_LLAMA["num_hidden_layers"]
    assert greedy_tokens(model, identity, handoffs, "cpu", "float32") == expected


def test_fusion_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("EDGE_FUSED_PROJECTIONS", "0")
    model = _tiny()
    assert fuse_projections(model) == 0
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
