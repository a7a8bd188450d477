"""The weight plan's batch-size switch follows step times measured while serving (decode_gpu.runner.weight_switch):
its estimates move with injected step times, it explores the other precision now and then, and it moves the plan
only past the hysteresis."""

from types import SimpleNamespace

from decode_gpu.core.throughput import StepTimes
from decode_gpu.runner.weight_switch import WeightSwitch


def _switch(float_above: int = 8, explore_every: int = 5, min_samples: int = 1) -> WeightSwitch:
    layers = [SimpleNamespace(float_above=float_above) for _ in range(3)]  # what the switch sets on QuantizedLinear
    return WeightSwitch(layers, float_above, 32, explore_every=explore_every, min_samples=min_samples)


def _serve(switch: WeightSwitch, rows: int, ms: dict[str, float], steps: int, mode: str = "") -> list[str]:
    """Steps as the model runner takes them: an explored step runs again on the plan, and the pair is compared."""
    used = []
    for _ in range(steps):
        precision = switch.before_step(rows, mode)
        # the layers hold what this step uses: float for more rows than their float_above
        assert ("float" if rows > switch.layers[0].float_above else "quantized") == precision
        if precision == switch.planned(rows):
            switch.after_step(rows, precision, ms[precision])
        else:
            switch.back_to_plan(rows)
            plan = switch.planned(rows)
            assert ("float" if rows > switch.layers[0].float_above else "quantized") == plan
            switch.compared(rows, precision, ms[precision], ms[plan])
        used.append(precision)
    return used


def test_the_estimates_move_with_injected_step_times():
    times = StepTimes()
    times.record("a", 10.0)
    assert times.get("a") == 10.0
    for _ in range(30):
        times.record("a", 20.0)
    assert abs(times.get("a") - 20.0) < 0.1
    times.record("a", 1e6)  # a stall counts as 8x the estimate at most
    assert abs(times.get("a") - (20.0 + 0.2 * (160.0 - 20.0))) < 0.1


def test_it_explores_the_other_precision_every_few_steps_and_goes_back_to_the_plan():
    switch = _switch()
    used = _serve(switch, 4, {"quantized": 10.0, "float": 10.5}, 10)
    assert used == ["quantized"] * 4 + ["float"] + ["quantized"] * 4 + ["float"]
    assert switch.planned(4) == "quantized" and switch.layers[0].float_above == 4  # within the hysteresis: no move


def test_a_faster_float_step_moves_the_plan_past_that_batch_size_and_back():
    switch = _switch()
    _serve(switch, 4, {"quantized": 10.0, "float": 8.5}, 5)  # float 15% faster at 4 rows
    assert switch.planned(4) == "float" and switch.layers[0].float_above == 3
    assert switch.moved() == {"4": "float"} and switch.planned(3) == "quantized"  # other sizes keep the cut-off
    assert _serve(switch, 4, {"quantized": 10.0, "float": 8.5}, 4) == ["float"] * 4
    # the machine changes: the quantized step (explored) is now faster by far, and the plan moves back
    _serve(switch, 4, {"quantized": 5.0, "float": 8.5}, 40)
    assert switch.planned(4) == "quantized" and switch.moved() == {}
    assert "(4, 'quantized', '')" in switch.describe()


def test_within_the_hysteresis_the_plan_stays():
    switch = _switch()
    _serve(switch, 12, {"quantized": 9.5, "float": 10.0}, 30)  # quantized 5% faster above the plan: not enough
    assert switch.planned(12) == "float" and switch.moved() == {}


def test_a_move_waits_for_min_samples_steps_of_each_precision():
    """One explored step, however fast, does not move the plan: a noisy second must not decide."""
    switch = _switch(min_samples=3)
    _serve(switch, 4, {"quantized": 10.0, "float": 5.0}, 14)  # steps 5 and 10 explored float: two samples
    assert switch.planned(4) == "quantized"
    _serve(switch, 4, {"quantized": 10.0, "float": 5.0}, 1)  # the third
    assert switch.planned(4) == "float"


def test_each_size_and_thread_mode_follows_its_own_steps_without_flapping(caplog):
    """Steps beside a prefill (halved threads) and steps alone disagree on which precision wins at 2 rows, and the
    sizes do not order as a cut-off can (float wins at 1 row alone, quantized at 2): each (size, mode) follows its
    own steps, and serving them in turn moves each once."""
    caplog.set_level("INFO", logger="decode_gpu.runner.weight_switch")
    switch = _switch(float_above=4, min_samples=2)
    one, alone, halved = {"quantized": 12.0, "float": 7.0}, {"quantized": 10.0, "float": 7.0}, \
        {"quantized": 10.0, "float": 14.0}
    for _ in range(40):
        _serve(switch, 1, one, 2, "alone")
        _serve(switch, 2, alone, 3, "alone")
        _serve(switch, 2, halved, 2, "halved")
    assert switch.moved() == {"1/alone": "float", "2/alone": "float"} and switch.planned(2, "halved") == "quantized"
    assert len([r for r in caplog.records if "weight plan" in r.message]) == 2
    assert _serve(switch, 2, alone, 4, "alone") == ["float"] * 4 and switch.layers[0].float_above == 1
    assert _serve(switch, 2, halved, 4, "halved") == ["quantized"] * 4 and switch.layers[0].float_above == 2
    assert "moved: 1/alone: float, 2/alone: float" in switch.describe()


def test_the_start_up_plan_measures_torch_int_kernels_only_where_they_can_win(monkeypatch):
    """Without AVX-512 torch's packed int4/int8 kernels lose to float (2-13x at batch 1 on an AVX2 CPU): auto measures
    only ggml's q8_0 there, which saves building and timing them at every start; with AVX-512 both are measured."""
    import torch

    from decode_gpu.model import ggml_linear, weight_plan
    measured = []
    monkeypatch.setattr(weight_plan, "_measured_cpu_plan", lambda model, max_batch, kinds, head: measured.append(kinds))
    monkeypatch.setattr(ggml_linear, "available", lambda: True)
    types = weight_plan.GGUFWeightTypes(frozenset({"Q4_1"}), "Q8_0")
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        weight_plan.auto_weight_plan(torch.device("cpu"), types, object(), 8)
    assert measured == [("q8_0",), ("int4", "q8_0")]


def _run(switch: WeightSwitch, rows: int, ms: dict[str, float], steps: int) -> tuple[list[str], int]:
    """Steps through the model runner's _switched: each forward reports the precision its layers held (and the time
    the switch is to see, through a fake clock); returns (what each step gave, forwards run)."""
    from decode_gpu.runner import model_runner
    clock, calls = [0.0], []

    def forward() -> str:
        held = "float" if rows > switch.layers[0].float_above else "quantized"
        calls.append(held)
        clock[0] += ms[held] / 1e3
        return held
    runner = SimpleNamespace(weight_switch=switch)
    real = model_runner.time.perf_counter
    model_runner.time.perf_counter = lambda: clock[0]
    try:
        return [model_runner.ModelRunner._switched(runner, rows, forward) for _ in range(steps)], len(calls)
    finally:
        model_runner.time.perf_counter = real


def test_an_explored_step_is_only_timed_and_its_tokens_come_from_the_plan():
    switch = _switch()
    given, forwards = _run(switch, 4, {"quantized": 10.0, "float": 10.5}, 10)
    assert given == ["quantized"] * 10 and forwards == 12  # steps 5 and 10 explored float, then ran on the plan
    assert switch.times.get((4, "float", "")) == 10.5 and switch.planned(4) == "quantized"


def test_an_explored_step_that_moves_the_plan_still_gives_the_plans_tokens_and_the_move_comes_next():
    switch = _switch()
    given, forwards = _run(switch, 4, {"quantized": 10.0, "float": 5.0}, 6)
    assert given == ["quantized"] * 5 + ["float"] and forwards == 7  # step 5 explored float and moved the plan
    assert switch.planned(4) == "float"


def test_pairs_compare_like_with_like_when_the_machine_changes_between_them():
    """The plan's steps run 3x slower (a long prefill beside them) and each explored step falls in a quiet moment:
    a moving estimate of each precision would put float's quiet 10.5 ms against quantized's busy ones and move; the
    pairs, each on the same batch moments apart, say float is 1.05x the time and hold the plan."""
    switch = _switch(min_samples=3)
    busy, quiet = {"quantized": 30.0, "float": 31.5}, {"quantized": 10.0, "float": 10.5}
    for _ in range(10):
        _serve(switch, 4, busy, 4)
        assert _serve(switch, 4, quiet, 1) == ["float"]  # every 5th step explores
    assert switch.times.get((4, "quantized", "")) > 15 > switch.times.get((4, "float", ""))
    assert switch.planned(4) == "quantized" and switch.moved() == {}
