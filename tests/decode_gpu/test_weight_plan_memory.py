"""decode_gpu/model/weight_plan.py within_memory: the memory plan's decisions (contracts/memory_plan.py) applied to
auto's weight plan; the defaults leave it as measured."""

from __future__ import annotations

import torch
from torch import nn

from decode_gpu.model import weight_plan
from decode_gpu.model.weight_plan import GGUFWeightTypes, WeightPlan, within_memory

BOTH = WeightPlan("int8", "measured", float_above=4, prebuilt={"a": 1}, packed={"a": 2})


def test_the_defaults_keep_the_plan_as_measured() -> None:
    assert within_memory(BOTH, "int8") is BOTH
    float_plan = WeightPlan("float", "measured", packed={"a": 2})
    assert within_memory(float_plan, "int8") is float_plan


def test_no_second_set_keeps_the_quantized_layers_at_every_batch_size() -> None:
    one = within_memory(BOTH, "int8", second_set=False)
    assert (one.weight_dtype, one.float_above, one.prebuilt, one.packed) == ("int8", None, {"a": 1}, {})
    assert one.why.startswith("measured; int8 at every batch size") and "memory plan" in one.why
    # a float plan is one set already: kept, packed layers and all
    float_plan = WeightPlan("float", "measured", packed={"a": 2})
    assert within_memory(float_plan, "int8", second_set=False) is float_plan


def test_no_float_set_turns_a_float_plan_into_the_measured_quantized_kind() -> None:
    held = within_memory(WeightPlan("float", "measured", packed={"a": 2}), "int4", float_set=False, head_int8=True)
    assert (held.weight_dtype, held.float_above, held.packed, held.head_int8) == ("int4", None, {}, True)
    assert "no room for the float weights" in held.why
    assert within_memory(BOTH, "int8", float_set=False).float_above is None


def test_auto_on_a_cpu_applies_the_plan_to_its_measurement(monkeypatch) -> None:
    monkeypatch.setattr(weight_plan, "_measured_cpu_plan", lambda model, max_batch, kinds, head_int8: BOTH)
    monkeypatch.setattr(weight_plan, "cpu_kinds", lambda types: ("int8",))
    model, cpu, types = nn.Linear(4, 4), torch.device("cpu"), GGUFWeightTypes(frozenset({"Q8_0"}), "Q8_0")
    assert weight_plan.auto_weight_plan(cpu, types, model, 8) is BOTH
    assert weight_plan.auto_weight_plan(cpu, types, model, 8, second_set=False).float_above is None
    # on CUDA, an unquantized GGUF's float plan becomes int8 where the plan has no room for float weights
    cuda = torch.device("cuda")
    assert weight_plan.auto_weight_plan(cuda, GGUFWeightTypes(frozenset({"F16"}), "F16")).weight_dtype == "float"
    assert weight_plan.auto_weight_plan(cuda, GGUFWeightTypes(frozenset({"F16"}), "F16"),
                                        float_set=False).weight_dtype == "int8"
