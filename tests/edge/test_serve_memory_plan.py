"""`edge serve` plans the box's memory before anything loads (edge/check_model/memory.py, contracts/memory_plan.py): a
model that cannot fit is refused at start with each part's bytes and the budget, one line, no traceback; one that
fits starts with the plan's decisions in the config, and from there in the engine's and workers' process configs."""

from __future__ import annotations

import logging

import pytest

from contracts.memory_plan import MIB, Machine, MemoryRefused, plan_memory
from contracts.model_sizes import model_sizes
from edge.check_model import memory
from edge.check_model.memory import cpu_has_bfloat16, machine, plan_config, planned_config
from edge.cli import main
from edge.config import ServeConfig, load_config
from edge.launch.launcher import engine_config, worker_config

BUDGET_MIB = 2550  # the embedded model at 3 workers: one worker, int4 weights alone, no prefill copy (with the
# default 8192-token prompt cache, contracts/prompt_cache.py)
BOX = Machine("cpu", 64 * 2**30)


def serve(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *map(str, argv)])
    assert "Traceback" not in capsys.readouterr().err
    return str(exit_info.value.code)


@pytest.fixture
def started(monkeypatch):
    """The config make_app was given; nothing is started."""
    import edge.app
    seen = []

    def stop_here(config):
        seen.append(config)
        raise ValueError("stopped before the server starts")
    monkeypatch.setattr(edge.app, "make_app", stop_here)
    monkeypatch.setattr(memory, "gpu_memory_bytes", lambda: 0)  # a CPU box whatever runs the test
    return seen


def test_a_model_that_cannot_fit_is_refused_at_start_with_each_part(capsys, started, embedded_model_path):
    message = serve(capsys, "--memory-budget", 300 * MIB)
    assert not started
    assert message.startswith("edge: ") and "does not fit the memory budget" in message
    sizes = model_sizes(embedded_model_path)
    with pytest.raises(MemoryRefused) as refused:
        plan_memory(sizes, machine("cpu"), plan_config(ServeConfig(memory_budget=300 * MIB), machine("cpu"), "f16"))
    expected = str(refused.value)
    assert message == f"edge: {expected}"
    for part in ("decode weights, the GGUF's own blocks, mapped", "engine runtime", "swap space", "gateway runtime",
                 "prefill weights, the given GGUF", "prefill workers x1", "decode KV pool, 16384 tokens"):
        assert part in message
    # the engine's one set is the given file's pages, counted once under the workers' mapping
    assert "budget host 300 MiB, " in message and "decode weights, the GGUF's own blocks, mapped 0 MiB (host)" in message


def test_the_plans_decisions_reach_the_process_configs(capsys, caplog, started, embedded_model_path):
    with caplog.at_level(logging.INFO, logger="edge"):
        assert serve(capsys, "--memory-budget", BUDGET_MIB * MIB, "--prefill-workers", 3) == \
            "edge: stopped before the server starts"
    [config] = started
    box = machine("cpu")
    plan = plan_memory(model_sizes(embedded_model_path), box,
                       plan_config(ServeConfig(memory_budget=BUDGET_MIB * MIB, prefill_workers=3), box, "f16"))
    assert (plan.prefill_workers, plan.weight_dtype, plan.second_set, plan.float_set, plan.prefill_copy_kinds) == \
        (1, "auto", False, False, ())  # the budget leaves each choice at its least: one set, the file's blocks
    assert config.prefill_workers == 1 and config.kv_cache_tokens == plan.kv_cache_tokens > 8192
    assert config.swap_space_gib * 2**30 == plan.swap_bytes
    engine = engine_config(config, "m.gguf", "unix:/e")
    assert (engine.weight_dtype, engine.weight_second_set, engine.weight_float_set, engine.kv_cache_tokens) == \
        ("auto", False, False, plan.kv_cache_tokens)
    worker = worker_config(config, "m.gguf", "prefill-0", "unix:/w", "unix:/e", "f16", 2)
    assert worker.prefill_copy_kinds == ()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"memory plan (memory_budget {BUDGET_MIB * MIB}" in logged and plan.describe() in logged


def test_with_room_the_plan_leaves_every_choice_open(capsys, started):
    assert serve(capsys) == "edge: stopped before the server starts"
    [config] = started
    engine = engine_config(config, "m.gguf", "unix:/e")
    assert (engine.weight_dtype, engine.weight_second_set, engine.weight_float_set) == ("auto", True, True)
    worker = worker_config(config, "m.gguf", "prefill-0", "unix:/w", "unix:/e", "f16", 2)
    assert worker.prefill_copy_kinds == ("f16", "q8_0")  # the embedded GGUF is Q4_1: either copy fits


def test_a_named_prefill_copy_is_not_narrowed(embedded_model_path):
    config = ServeConfig(prefill_weights="given")
    box = machine("cpu")
    plan = plan_memory(model_sizes(embedded_model_path), box, plan_config(config, box, "f16"))
    assert planned_config(config, plan, box).prefill_copy_kinds is None  # auto's own rule, which "given" skips


def test_the_budget_is_a_config_key_and_the_plan_fields_are_not(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("memory_budget = 17179869184\n")
    assert load_config(str(path), {}).memory_budget == 16 * 2**30
    path.write_text("weight_second_set = false\n")
    with pytest.raises(Exception, match="weight_second_set"):
        load_config(str(path), {})


def test_the_plans_dtype_is_the_engines(embedded_model_path, tmp_path):
    cpu = plan_config(ServeConfig(), BOX, "f16")
    assert cpu.dtype == ("bfloat16" if cpu_has_bfloat16() else "float32")
    assert plan_config(ServeConfig(), Machine("cuda", 2**34, 2**34), "f16").dtype == "bfloat16"
    assert plan_config(ServeConfig(weight_dtype="float32"), BOX, "f16").dtype == "float32"
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor : 0\nflags : fpu avx512f avx512_bf16\n")
    assert cpu_has_bfloat16(flags)
    flags.write_text("processor : 0\nflags : fpu avx2\n")
    assert not cpu_has_bfloat16(flags)


def test_on_cuda_the_budget_bounds_the_engines_share_of_the_device(embedded_model_path):
    box = Machine("cuda", 64 * 2**30, 16 * 2**30)
    config = ServeConfig(memory_budget=8 * 2**30, device="cuda")
    plan = plan_memory(model_sizes(embedded_model_path), box, plan_config(config, box, "f16"))
    planned = planned_config(config, plan, box)
    assert planned.gpu_memory_utilization == 0.5 and planned.kv_cache_tokens is None  # the engine sizes its pool
    assert planned_config(ServeConfig(device="cuda"), plan, box).gpu_memory_utilization == 0.9


def test_device_cuda_without_a_gpu_is_refused_with_a_message(capsys, started):
    assert serve(capsys, "--device", "cuda").startswith("edge: device = \"cuda\", but no GPU's memory could be read")
