"""weight_dtype = auto on a CPU: a quiet start records its measured weight plan beside the converted weights, later
starts with the same settings build it without timing anything, a busy start measures but records nothing, and a
record that is broken or made for other settings is measured again. What other work used of the CPU through the
measurement and the kernels' timings are set by the tests (plan_record.measurement_window, weight_plan._turns), so
they do not depend on the machine running them."""

import json

import pytest
import torch

from contracts.cpu_window import CpuWindow
from contracts.identity import read_gguf_identity
from decode_gpu.model import ggml_linear, plan_record, weight_plan
from decode_gpu.model.quantized_linear import QuantizedLinear
from decode_gpu.model.weight_quant import held_weight_dtype, load_weights
from decode_gpu.runner.weight_switch import WeightSwitch

CPU = torch.device("cpu")
QUIET, BUSY = 0.0, 1.5  # cores other work used through the measurement: none, and most of a 2-core box


def window(others: float) -> CpuWindow:
    """A measurement window of 1 s in which other work used `others` cores and this process none."""
    def reading(first: float, then: float):
        calls = []

        def read() -> float:
            calls.append(None)
            return first if len(calls) == 1 else then
        return read
    return CpuWindow(busy=reading(0.0, others), own=lambda: 0.0, clock=reading(0.0, 1.0))


@pytest.fixture
def identity(tiny_gguf, tmp_path, monkeypatch):
    """The tiny Llama GGUF, with its converted weights and records in this test's own cache."""
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(ggml_linear, "available", lambda: False)  # int8 alone is measured (an f32 GGUF)
    return read_gguf_identity(str(tiny_gguf("llama", "f32")))


@pytest.fixture
def timings(monkeypatch):
    """The measurement's passes, counted: int8 half the float pass's time up to 2 rows, twice it from 4 rows on (a
    plan of int8 up to batch 2, float above)."""
    calls = []

    def turns(floats, quantized, inputs, reps=3):
        rows = next(iter(inputs.values())).shape[0]  # [rows, in_features]
        calls.append(rows)
        return 1.0, 0.5 if rows <= 2 else 2.0
    monkeypatch.setattr(weight_plan, "_turns", turns)
    return calls


@pytest.fixture
def start(identity, monkeypatch):
    """start(others): load_weights with weight_dtype auto on the CPU, other work using `others` cores through any
    measurement."""
    def start(others: float, max_batch: int = 8, dtype=torch.float32):
        monkeypatch.setattr(plan_record, "measurement_window", lambda: window(others))
        return load_weights(identity, CPU, dtype, "auto", max_batch)
    return start


def records(identity) -> list:
    from contracts.cache import converted_dir
    return sorted((converted_dir(identity) / plan_record.RECORDS).glob("*"))


def test_a_quiet_start_records_its_plan_and_the_next_start_builds_it_without_measuring(
        identity, start, timings, monkeypatch, caplog):
    measured, report = start(QUIET)
    assert timings and held_weight_dtype(measured) == "int8 up to batch 2, float32 above"
    [path] = records(identity)
    assert path.name == f"cpu-{torch.backends.cpu.get_cpu_capability()}-t{torch.get_num_threads()}-float32-b8-int8.json"
    record = json.loads(path.read_text())
    assert (record["weight_dtype"], record["float_above"], record["why"]) == ("int8", 2, report.why)
    monkeypatch.setattr(weight_plan, "_turns", lambda *a, **k: pytest.fail("measured again"))
    caplog.set_level("INFO")
    reused, again = start(BUSY)  # reused whatever the load now
    assert f"weight plan recorded by a quiet start ({path}): int8 up to batch 2, float above" in caplog.text
    assert held_weight_dtype(reused) == held_weight_dtype(measured) and "recorded by a quiet start" in again.why
    with torch.inference_mode():
        for shape in ((1, 2), (2, 3)):  # 2 rows: int8 layers; 6 rows: the float ones. The layers measured, rebuilt
            ids = torch.randint(3, 300, shape)
            assert torch.equal(reused(ids).logits, measured(ids).logits)


def test_the_live_switch_moves_a_reused_plan(identity, start, timings, monkeypatch):
    """The reused model holds the float weights too, so the batch-size switch can move its cut-off."""
    start(QUIET)
    model, report = start(QUIET)
    floats, _ = load_weights(identity, CPU, torch.float32, "float32", 8)
    floats.set_input_embeddings(model.get_input_embeddings())  # the int8 table the quantized model reads either way
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.float_above is not None]
    assert "recorded by a quiet start" in report.why and layers and layers[0].float_above == 2
    ids = torch.randint(3, 300, (1, 2))  # 2 rows
    with torch.inference_mode():
        assert not torch.equal(model(ids).logits, floats(ids).logits)  # int8 up to 2 rows
        switch = WeightSwitch(layers, layers[0].float_above, 8, min_samples=1)
        switch.compared(2, "float", 5.0, 10.0)  # float faster at 2 rows, past the hysteresis: float at 2 rows
        assert switch.planned(2) == "float" and all(m.float_above == 1 for m in layers)
        assert torch.equal(model(ids).logits, floats(ids).logits)


def test_a_start_with_other_work_through_its_measurement_records_nothing(identity, start, timings, caplog):
    caplog.set_level("INFO")
    model, _ = start(BUSY)
    assert timings and held_weight_dtype(model) == "int8 up to batch 2, float32 above"
    assert records(identity) == []
    assert "busy machine (other work used 1.50 of" in caplog.text and "used, not recorded" in caplog.text


def _corrupt(record: dict) -> str:
    return "{not json"


def _other_torch(record: dict) -> str:
    return json.dumps({**record, "settings": {**record["settings"], "torch": "0.0"}})


def _unmeasured_kind(record: dict) -> str:
    return json.dumps({**record, "weight_dtype": "int4"})


def _cut_off_past_the_batch(record: dict) -> str:
    return json.dumps({**record, "float_above": 8})


def _no_cut_off_field(record: dict) -> str:
    return json.dumps({k: v for k, v in record.items() if k != "float_above"})


@pytest.mark.parametrize("spoil", [_corrupt, _other_torch, _unmeasured_kind, _cut_off_past_the_batch,
                                   _no_cut_off_field])
def test_a_broken_or_mismatched_record_is_ignored_and_measured_again(identity, start, timings, caplog, spoil):
    start(QUIET)
    [path] = records(identity)
    good = path.read_text()
    path.write_text(spoil(json.loads(good)))
    timings.clear()
    model, report = start(QUIET)
    assert timings and "ignoring the recorded weight plan" in caplog.text
    assert "recorded by a quiet start" not in report.why
    assert held_weight_dtype(model) == "int8 up to batch 2, float32 above"
    assert json.loads(path.read_text())["settings"] == json.loads(good)["settings"]  # recorded anew


@pytest.mark.parametrize("change", ["max_batch", "threads", "dtype"])
def test_a_record_made_for_other_settings_is_not_reused(identity, start, timings, change):
    start(QUIET)
    timings.clear()
    threads = torch.get_num_threads()
    try:
        if change == "threads":
            torch.set_num_threads(threads + 1)
        model, report = start(QUIET, max_batch=4 if change == "max_batch" else 8,
                             dtype=torch.bfloat16 if change == "dtype" else torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert timings and "recorded by a quiet start" not in report.why
    assert len(records(identity)) == 2


def test_a_model_without_a_gguf_file_records_nothing(tmp_path, timings, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from contracts.identity import GGUFIdentity
    from tiny_llama import TINY_LLAMA
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    monkeypatch.setattr(plan_record, "measurement_window", lambda: window(QUIET))
    monkeypatch.setattr(ggml_linear, "available", lambda: False)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    identity = GGUFIdentity(path="tiny-llama", fingerprint="sha256:tiny", arch="llama", n_layer=2, n_head=6,
                            num_kv_heads=2, head_dim_k=64, head_dim_v=64, rope_layout="neox")
    plan = plan_record.cpu_weight_plan(identity, weight_plan.GGUFWeightTypes(), model, torch.float32, 8)
    assert timings and plan.weight_dtype == "int8" and plan.float_above == 2
    assert not list(tmp_path.rglob("*.json"))
