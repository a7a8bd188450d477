"""contracts/memory_plan.py and model_sizes.py: one budget per box, planned from the GGUF header before anything
loads. The 1B, 3B and 8B are the size ladder's projections (bench/gguf_ladder.py, exact against llama.cpp's own
Q4_K_M files in tests/checks/test_gguf_ladder.py); the 135M is the embedded model's header."""

from __future__ import annotations

import dataclasses

import pytest

from bench.gguf_ladder import ladder_sizes
from contracts.memory_plan import (
    GIB,
    MIB,
    Machine,
    MemoryRefused,
    PlanConfig,
    plan_memory,
)
from contracts.model_sizes import copy_may_pay, model_sizes, worker_repacks

CPU_BOX = Machine("cpu", 24 * GIB)


@pytest.fixture(scope="module")
def models(embedded_model_path) -> dict:
    return {"135m": model_sizes(embedded_model_path), **{size: ladder_sizes(size, "q4_k_m") for size in ("1b", "3b", "8b")}}


def _plan(sizes, budget_gib: float, machine: Machine = CPU_BOX, **config):
    return plan_memory(sizes, machine, PlanConfig(memory_budget=int(budget_gib * GIB), **config))


def test_engine_weight_bytes_are_what_check_model_reports_for_the_embedded_model(models) -> None:
    # `edge check-model` sizes the engine's own layers on the meta device (docs/models.md's table, MiB)
    sizes = models["135m"]
    assert {dtype: round(sizes.decode_weight_bytes(dtype) / MIB, 1) for dtype in ("bfloat16", "int8", "int4")} == \
        {"bfloat16": 256.6, "int8": 128.7, "int4": 90.4}
    assert round(sizes.decode_weight_bytes("float32", "float32") / MIB, 1) == 513.1
    assert sizes.n_params == 134_515_008  # "parameters 134.5 M"
    # "KV per token: handoff f16 22.5 KiB, q8_0 12.0 KiB, q4_0 6.3 KiB; pool float32 45.0 ... int8 12.0, int4 7.0"
    assert [round(sizes.handoff_kv_bytes(kv) / 1024, 1) for kv in ("f16", "q8_0", "q4_0")] == [22.5, 12.0, 6.3]
    assert [round(sizes.pool_kv_bytes(s) / 1024, 1) for s in ("float32", "bfloat16", "int8", "int4")] == \
        [45.0, 22.5, 12.0, 7.0]


@pytest.mark.slow
def test_engine_weight_bytes_match_the_engines_own_sizing(tmp_path) -> None:
    """Against edge/check_model/sizes.py (the engine's quantizer on the meta device) on a Q4_K_M ladder rung: its
    Q6_K head keeps an int4 model's lm_head int8, shared with the tied embedding. Within the RoPE buffers' bytes."""
    from bench.gguf_ladder import build
    from decode_gpu.kv.pool import bytes_per_token
    from decode_gpu.model.weight_plan import gguf_weight_types
    from edge.check_model.command import _meta_model
    from edge.check_model.sizes import decode_weight_bytes
    path = build(tmp_path, "tiny", ("q4_k_m",), check=False)["q4_k_m"]["path"]
    engine = decode_weight_bytes(_meta_model(path), gguf_weight_types(path).head_int8)
    sizes = model_sizes(path)
    for dtype, held in engine.items():
        compute = dtype if dtype in ("float32", "float16") else "bfloat16"
        assert abs(sizes.decode_weight_bytes(dtype, compute) - held) <= 1024, dtype
    for storage in ("float32", "bfloat16", "int8", "int4"):
        assert sizes.pool_kv_bytes(storage) == bytes_per_token(sizes.n_layer, sizes.num_kv_heads, sizes.head_dim_k,
                                                               storage)


# (model, budget GiB) -> (weight_dtype told, both sets, float set allowed, prefill copy) or None: refused. Defaults:
# one worker, max_model_len 4096 (KV floor 16384 tokens), swap 4 GiB (capped at the floor's bytes)
EXPECTED = {
    ("135m", 4): ("auto", True, True, "f16"), ("135m", 8): ("auto", True, True, "f16"),
    ("135m", 16): ("auto", True, True, "f16"), ("135m", 24): ("auto", True, True, "f16"),
    # one set, where both do not fit: the GGUF's own blocks, mapped (the engine holds no copy of its own)
    ("1b", 4): ("auto", False, False, None), ("1b", 8): ("auto", False, False, "f16"),
    ("1b", 16): ("auto", True, True, "f16"), ("1b", 24): ("auto", True, True, "f16"),
    ("3b", 4): None, ("3b", 8): ("auto", False, False, "q8_0"), ("3b", 16): ("auto", False, False, "f16"),
    ("3b", 24): ("auto", True, True, "f16"),
    ("8b", 4): None, ("8b", 8): None, ("8b", 16): ("auto", False, False, None), ("8b", 24): ("auto", False, False, "q8_0"),
}


@pytest.mark.parametrize(("model", "budget"), list(EXPECTED))
def test_the_planners_choices_on_a_cpu_box(models, model: str, budget: int) -> None:
    expected = EXPECTED[(model, budget)]
    if expected is None:
        with pytest.raises(MemoryRefused):
            _plan(models[model], budget)
        return
    plan = _plan(models[model], budget)
    assert (plan.weight_dtype, plan.second_set, plan.float_set, plan.prefill_copy) == expected
    assert plan.used("host") <= budget * GIB
    assert 16384 <= plan.kv_cache_tokens <= 32 * 4096
    assert plan.prefill_workers == 1
    held = plan.part_bytes()
    sets = [name for name in held if name.startswith("decode weights") and not name.endswith("while auto measures")]
    assert len(sets) == (2 if plan.second_set else 1)
    # auto's first start measures every quantized kind beside the float set: planned too, where both sets are
    assert any(name.endswith("while auto measures") for name in held) == plan.second_set
    assert held[f"decode KV pool, {plan.kv_cache_tokens} tokens"] == plan.kv_cache_tokens * models[model].pool_kv_bytes(
        "bfloat16")


@pytest.mark.parametrize("budget", [8, 9, 10, 12, 16, 24])
def test_the_pool_takes_what_is_left_up_to_every_sequence_at_its_longest(models, budget: int) -> None:
    """The extras come first (a second weight set at 9 GiB leaves the pool less than one set does at 8): the pool is
    what is left, whole tokens, unless every sequence at its longest fits."""
    plan, per_token = _plan(models["1b"], budget), models["1b"].pool_kv_bytes("bfloat16")
    if plan.kv_cache_tokens < 32 * 4096:
        assert 0 <= budget * GIB - plan.used("host") < per_token
        assert plan.reasons["kv_cache_tokens"] == f"{plan.kv_cache_tokens}: what is left"
    else:
        assert plan.used("host") < budget * GIB and "every sequence at its longest" in plan.reasons["kv_cache_tokens"]


def test_a_refusal_names_every_part_and_the_budget(models) -> None:
    with pytest.raises(MemoryRefused) as refused:
        _plan(models["8b"], 8)
    message = str(refused.value)
    for part in ("decode weights, the GGUF's own blocks, mapped 0 MiB", "engine runtime", "swap space",
                 "answers' KV going back (at most) 64 MiB", "gateway runtime",
                 "prefill weights, the given GGUF", "prefill workers x1", "decode KV pool, 16384 tokens"):
        assert part in message
    assert "ladder-8b-q4_k_m.gguf does not fit" in message and "budget host 8192 MiB" in message
    assert f"prefill weights, the given GGUF {models['8b'].file_bytes / MIB:.0f} MiB (host)" in message


def test_the_answers_kv_going_back_is_planned_on_the_host_and_the_pool_gets_the_rest(models) -> None:
    """kv_return_bytes (decode_gpu/kv/kv_return.py): the engine's copies of finished answers' blocks waiting to go
    back to their worker; host memory on either device, and the pool takes what they leave."""
    sizes, per_token = models["1b"], models["1b"].pool_kv_bytes("bfloat16")
    default, off, large = (_plan(sizes, 8, **config) for config in ({}, {"kv_return_bytes": 0},
                                                                     {"kv_return_bytes": 512 * MIB}))
    assert default.part_bytes()["answers' KV going back (at most)"] == 64 * MIB
    assert off.part_bytes()["answers' KV going back (at most)"] == 0
    assert off.kv_cache_tokens - default.kv_cache_tokens == pytest.approx(64 * MIB / per_token, abs=1)
    assert default.kv_cache_tokens - large.kv_cache_tokens == pytest.approx(448 * MIB / per_token, abs=1)
    cuda = _plan(models["1b"], 4, Machine("cuda", 24 * GIB, 6 * GIB))
    assert next(p for p in cuda.parts if p.name.startswith("answers' KV going back")).where == "host"


def test_workers_that_do_not_fit_are_fewer_with_a_reason(models) -> None:
    plan = _plan(models["1b"], 8, prefill_workers=8)
    assert 1 <= plan.prefill_workers < 8
    assert plan.reasons["prefill_workers"].startswith(f"{plan.prefill_workers} of the 8 configured")
    assert plan.used("host") <= 8 * GIB


def test_each_worker_holds_its_own_repacked_matrices_but_shares_the_mapped_file(models) -> None:
    one, two = (_plan(models["1b"], 24, prefill_workers=n, prefill_weights="given").part_bytes() for n in (1, 2))
    sizes = models["1b"]
    assert one["prefill weights, the given GGUF"] == two["prefill weights, the given GGUF"] == sizes.file_bytes
    assert two["prefill workers x2"] == 2 * one["prefill workers x1"]
    assert one["prefill workers x1"] > sizes.repacked_bytes == 445.5 * MIB  # as llama.cpp reported for this file
    copied = _plan(models["1b"], 24, prefill_workers=1, prefill_weights="f16").part_bytes()
    assert copied["prefill workers x1"] == one["prefill workers x1"] - sizes.repacked_bytes  # f16 is not repacked


def test_an_avx512_cpu_loads_q4_k_without_the_repack_and_the_plan_counts_none(models) -> None:
    """contracts.model_sizes.worker_repacks: llama.cpp's Q4_K repack measured slower and larger on AVX-512 (the
    worker loads without it there); Q4_0's was not measured and is kept; an AVX2-only CPU keeps llama.cpp's default."""
    avx512, avx2 = frozenset({"avx2", "avx512f"}), frozenset({"avx2"})
    assert not worker_repacks(frozenset({"Q4_K", "Q6_K"}), avx512)
    assert worker_repacks(frozenset({"Q4_K", "Q6_K"}), avx2)
    assert worker_repacks(frozenset({"Q4_0", "Q4_K"}), avx512)
    assert worker_repacks(frozenset({"F16"}), avx512)  # nothing to repack: the default, which does nothing
    sizes = models["1b"]
    repacking, mapped = (plan_memory(sizes, Machine("cpu", 24 * GIB, cpu_flags=flags),
                                     PlanConfig(memory_budget=24 * GIB, prefill_weights="given")).part_bytes()
                         for flags in (avx2, avx512))
    assert repacking["prefill workers x1"] - mapped["prefill workers x1"] == sizes.repacked_bytes > 0


def test_an_avx512_cpu_gets_no_copy_of_a_k_quant_mix_and_the_pool_gets_its_room(models) -> None:
    avx512 = frozenset({"avx2", "avx512f"})
    assert not copy_may_pay(frozenset({"Q4_K", "Q6_K"}), avx512)
    assert copy_may_pay(frozenset({"Q4_K", "Q6_K"}), frozenset({"avx2"}))
    assert copy_may_pay(frozenset({"Q4_1"}), avx512)  # the embedded model: its f16 copy measured 1.85x
    for size, budget in (("1b", 8), ("8b", 24)):
        sizes = models[size]
        plain, k_quants = (plan_memory(sizes, Machine("cpu", 24 * GIB, cpu_flags=flags),
                                       PlanConfig(memory_budget=budget * GIB)) for flags in (frozenset(), avx512))
        assert plain.prefill_copy is not None and k_quants.prefill_copy is None
        assert k_quants.prefill_copy_kinds == () and "AVX-512" in k_quants.reasons["prefill_copy"]
        assert k_quants.kv_cache_tokens > plain.kv_cache_tokens


def test_settings_asked_for_by_name_are_required(models) -> None:
    fixed = _plan(models["1b"], 24, kv_cache_tokens=20000)
    assert fixed.kv_cache_tokens == 20000 and fixed.reasons["kv_cache_tokens"].startswith("20000: kv_cache_tokens")
    with pytest.raises(MemoryRefused, match="KV pool of 700000 tokens"):
        _plan(models["1b"], 24, kv_cache_tokens=700_000)  # 21.4 GiB of pool
    int4 = _plan(models["1b"], 8, weight_dtype="int4")
    assert (int4.weight_dtype, int4.second_set, int4.float_set) == ("int4", False, False)
    assert int4.part_bytes()["decode weights, int4"] == models["1b"].decode_weight_bytes("int4")
    given = _plan(models["1b"], 24, prefill_weights="given")
    assert given.prefill_copy is None and "prefill weights, the given GGUF" in given.part_bytes()
    with pytest.raises(MemoryRefused, match="prefill weights, f16 copy"):
        _plan(models["3b"], 10, prefill_weights="f16")
    unconverted = dataclasses.replace(models["1b"], file_type=1)  # an f16 GGUF: no copy prefills faster
    assert _plan(unconverted, 24).prefill_copy is None and _plan(unconverted, 24).prefill_copy_kinds == ()
    assert _plan(models["1b"], 24).prefill_copy_kinds == ("f16", "q8_0")
    assert _plan(models["8b"], 24).prefill_copy_kinds == ("q8_0",)


def test_auto_keeps_the_smaller_quantized_kind_before_refusing(models) -> None:
    # between the room for int8 and for q8_0 (its 34-byte blocks): int8 alone, told as such
    # a GGUF of a type the engine does not multiply in place (GGUF_IN_PLACE): auto's own quantized kinds
    sizes = dataclasses.replace(models["8b"], layer_types=frozenset({"Q4_K", "IQ2_S"}))
    roomy = _plan(sizes, 24)
    needed = roomy.used("host") - roomy.part_bytes()[f"decode KV pool, {roomy.kv_cache_tokens} tokens"]
    q8_0, int8 = sizes.decode_weight_bytes("q8_0"), sizes.decode_weight_bytes("int8")
    budget = (needed - roomy.part_bytes()["prefill weights, q8_0 copy"] + sizes.file_bytes + sizes.repacked_bytes
              + 16384 * sizes.pool_kv_bytes("bfloat16") - (q8_0 - int8) // 2)
    plan = plan_memory(sizes, CPU_BOX, PlanConfig(memory_budget=budget))
    assert (plan.weight_dtype, plan.float_set, plan.prefill_copy) == ("int8", False, None)
    assert plan.part_bytes()["decode weights, int8"] == int8


def test_on_cuda_the_weights_and_pool_are_on_the_device_and_the_rest_on_the_host(models) -> None:
    box = Machine("cuda", host_bytes=32 * GIB, device_bytes=24 * GIB)
    plan = plan_memory(models["8b"], box, PlanConfig())
    assert plan.budgets == {"device": int(0.9 * 24 * GIB), "host": int(0.85 * 32 * GIB)}
    where = {part.name: part.where for part in plan.parts}
    assert where["decode weights, int4"] == where[f"decode KV pool, {plan.kv_cache_tokens} tokens"] == "device"
    assert where["engine runtime"] == where["prefill workers x1"] == "host"
    assert plan.weight_dtype == "auto" and not plan.second_set  # the GGUF's own quantization: int4, one set
    assert plan.used("device") <= plan.budgets["device"] and plan.used("host") <= plan.budgets["host"]
    with pytest.raises(MemoryRefused, match="device"):
        plan_memory(models["8b"], Machine("cuda", 32 * GIB, 6 * GIB), PlanConfig())


def test_describe_lists_every_part_the_totals_and_the_reasons(models) -> None:
    plan = _plan(models["1b"], 8, prefill_workers=2)
    table = plan.describe()
    for part in plan.parts:
        assert part.name in table and f"{part.bytes / MIB:.1f}" in table
    assert f"of the {8 * 1024:.1f} MiB budget" in table
    for decision, why in plan.reasons.items():
        assert f"{decision}: {why}" in table


def test_the_ggufs_own_blocks_count_once_beside_the_workers_mapping_and_in_full_beside_a_copy(models) -> None:
    """weight_dtype gguf (or auto's one set): the engine maps the given file; with the workers on that file too its
    pages are counted once (under the prefill weights), beside a copy they are the engine's own."""
    sizes, name = models["1b"], "decode weights, the GGUF's own blocks, mapped"
    shared = _plan(sizes, 24, weight_dtype="gguf", prefill_weights="given")
    assert (shared.weight_dtype, shared.second_set, shared.float_set) == ("gguf", False, False)
    assert shared.part_bytes()[name] == 0
    assert shared.part_bytes()["prefill weights, the given GGUF"] == sizes.file_bytes
    beside = _plan(sizes, 24, weight_dtype="gguf", prefill_weights="f16")
    assert beside.part_bytes()[name] == sizes.file_bytes
    # the one set auto falls to where both do not fit is the same, and needs no float set
    tight = _plan(sizes, 4)
    assert tight.part_bytes()[name] == 0 and "no second copy" in tight.reasons["weights"]


def test_on_an_avx2_cpu_the_engine_repacks_the_mapped_blocks_where_the_copy_fits(models) -> None:
    """weight_repack: llama.cpp's repacked layout of the Q4_K matrices (the Q6_K ones have none on x86) in the
    engine's own memory, planned where it fits beside everything else; else the mapped blocks alone."""
    from contracts.model_sizes import engine_repacks
    avx2 = Machine("cpu", 24 * GIB, cpu_flags=frozenset({"avx2", "avx512f"}))
    sizes = models["8b"]
    assert engine_repacks(avx2.cpu_flags) and not engine_repacks(CPU_BOX.cpu_flags)
    assert 3.0 * GIB < sizes.engine_repacked_bytes < sizes.file_bytes  # its Q6_K matrices and head stay mapped
    no_avx2 = Machine("cpu", 24 * GIB, cpu_flags=frozenset({"avx512f"}))  # the same rules for the workers
    roomy, tight, plain = _plan(sizes, 20, avx2), _plan(sizes, 12, avx2), _plan(sizes, 20, no_avx2)
    assert (roomy.weight_dtype, roomy.repack, roomy.second_set) == ("auto", True, False)
    held = roomy.part_bytes()
    assert held["decode weights, the GGUF's own blocks, mapped, repacked"] == sizes.engine_repacked_bytes
    assert held["decode weights, the GGUF's own blocks, mapped"] == 0  # the workers' pages, counted once
    per_token = sizes.pool_kv_bytes("bfloat16")  # the copy's room comes from the pool
    assert (plain.kv_cache_tokens - roomy.kv_cache_tokens) * per_token == \
        pytest.approx(sizes.engine_repacked_bytes, abs=per_token)
    assert not tight.repack and not plain.repack  # no room beside the floor, or no AVX2: the mapped blocks only
    assert not _plan(sizes, 20, avx2, weight_dtype="int4").repack  # the engine's own quantization: nothing mapped
    assert _plan(sizes, 20, avx2, weight_dtype="gguf").repack


def test_the_workers_prompt_cache_is_planned_as_the_worker_sizes_it_and_shrinks_before_a_refusal(models) -> None:
    """prefix_cache_tokens (8192 by default) within the worker's RAM share (contracts.prompt_cache); where one worker
    does not fit with it, the earlier default's 2048 tokens; the workers are told the planned size."""
    from contracts.prompt_cache import FLOOR_TOKENS, prompt_cache_tokens
    sizes = models["1b"]
    roomy, tight = _plan(sizes, 16), _plan(sizes, 4)
    assert roomy.prefix_cache_tokens == prompt_cache_tokens(8192, CPU_BOX.host_bytes, sizes.handoff_kv_bytes("f16"))
    assert tight.prefix_cache_tokens == FLOOR_TOKENS and "would not fit" in tight.reasons["prefix_cache_tokens"]
    assert _plan(sizes, 16, prefix_cache_tokens=0).prefix_cache_tokens == 0
    with pytest.raises(MemoryRefused):
        _plan(sizes, 1)
