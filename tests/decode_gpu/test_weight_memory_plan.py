"""The memory plan's limits on weight_dtype auto (contracts/memory_plan.py, decode_gpu/model/weight_plan.within_memory)
reach load_weights: a measured plan and a plan a quiet start recorded (which bypasses auto_weight_plan) both lose
their float set when the plan leaves no room for it. The measurement's timings are set by the test, as in
test_plan_record.py."""

import pytest
import torch

from contracts.cpu_window import CpuWindow
from contracts.identity import read_gguf_identity
from decode_gpu.model import ggml_linear, plan_record, weight_plan
from decode_gpu.model.weight_quant import held_weight_dtype, load_weights

CPU = torch.device("cpu")


def quiet_window() -> CpuWindow:
    clock = iter([0.0, 1.0])
    busy = iter([0.0, 0.0])
    return CpuWindow(busy=lambda: next(busy), own=lambda: 0.0, clock=lambda: next(clock))


@pytest.fixture
def identity(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(ggml_linear, "available", lambda: False)  # int8 alone is measured (an f32 GGUF)
    monkeypatch.setattr(plan_record, "measurement_window", quiet_window)
    return read_gguf_identity(str(tiny_gguf("llama", "f32")))


def timed(monkeypatch, quantized_s) -> list:
    """The measurement's passes: the float pass 1 s, the int8 one quantized_s(rows)."""
    calls = []

    def turns(floats, quantized, inputs, reps=3):
        rows = next(iter(inputs.values())).shape[0]  # [rows, in_features]
        calls.append(rows)
        return 1.0, quantized_s(rows)
    monkeypatch.setattr(weight_plan, "_turns", turns)
    return calls


def test_a_recorded_plan_loses_its_float_set_where_the_memory_plan_has_no_room(identity, monkeypatch):
    calls = timed(monkeypatch, lambda rows: 0.5 if rows <= 2 else 2.0)  # int8 up to batch 2, float above
    model, _ = load_weights(identity, CPU, torch.float32, "auto", 8)
    assert calls and held_weight_dtype(model) == "int8 up to batch 2, float32 above"
    monkeypatch.setattr(weight_plan, "_turns", lambda *a, **k: pytest.fail("measured again"))
    for second_set, float_set in ((False, True), (True, False)):
        model, report = load_weights(identity, CPU, torch.float32, "auto", 8, second_set=second_set,
                                     float_set=float_set)
        assert "recorded by a quiet start" in report.why and "the memory plan leaves no room" in report.why
        assert held_weight_dtype(model) == "int8"
        assert set(report.bytes_by_dtype) == {"int8", "float32"}  # scales and norms float32, no float weight set
        assert report.bytes_by_dtype["float32"] < report.bytes_by_dtype["int8"]
    model, report = load_weights(identity, CPU, torch.float32, "auto", 8)  # room again: the record as it was
    assert held_weight_dtype(model) == "int8 up to batch 2, float32 above"


def test_float_weights_measured_fastest_become_int8_without_room_for_them(identity, monkeypatch):
    timed(monkeypatch, lambda rows: 2.0)  # int8 slower at every batch: float weights alone
    model, _ = load_weights(identity, CPU, torch.float32, "auto", 8)
    assert held_weight_dtype(model) == "float32"
    model, report = load_weights(identity, CPU, torch.float32, "auto", 8, float_set=False)
    assert held_weight_dtype(model) == "int8" and "int8: the memory plan leaves no room" in report.why
    model, _ = load_weights(identity, CPU, torch.float32, "auto", 8, second_set=False)
    assert held_weight_dtype(model) == "float32"  # one set: the float one, as measured fastest


def test_the_engine_process_passes_the_plans_fields_to_load_weights(tiny_gguf, monkeypatch):
    from contracts.process_config import EngineProcessConfig
    from decode_gpu.service import server
    seen = {}

    class Stop(Exception):
        pass

    def load(*args, **kwargs):
        seen.update(kwargs)
        raise Stop
    monkeypatch.setattr(server, "load_weights", load)
    config = EngineProcessConfig(model=str(tiny_gguf("llama", "f32")), listen="unix:/e", device="cpu",
                                 weight_second_set=False, weight_float_set=False)
    with pytest.raises(Stop):
        server.build_engine(config)
    assert (seen["second_set"], seen["float_set"]) == (False, False)
