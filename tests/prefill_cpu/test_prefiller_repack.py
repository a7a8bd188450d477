"""prefill_cpu/prefiller.py's repack choice: llama.cpp's use_extra_bufts set for the worker's load only, as
contracts.model_sizes.worker_repacks decides."""

from __future__ import annotations

import llama_cpp
import pytest

from contracts.model_sizes import cpu_flags, model_sizes, worker_repacks
from prefill_cpu.prefiller import PrefillConfig, Prefiller, _model_params


def test_the_load_reads_the_field_and_the_defaults_come_back() -> None:
    assert llama_cpp.llama_model_default_params().use_extra_bufts
    with _model_params(use_extra_bufts=False):
        assert not llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts


@pytest.mark.slow  # writes and quantizes a tiny ladder rung (about 20 s on a busy box)
def test_a_q4_k_model_is_loaded_as_the_rule_says_on_this_cpu(tmp_path) -> None:
    from bench.gguf_ladder import build
    path = str(build(tmp_path, "tiny", ("q4_k_m",), check=False)["q4_k_m"]["path"])
    prefiller = Prefiller(PrefillConfig(model_path=path, n_ctx=256, n_batch=64, n_threads=1))
    try:
        assert prefiller.repacked == worker_repacks(model_sizes(path).layer_types, cpu_flags())
        assert prefiller.repacked == ("avx512f" not in cpu_flags())
    finally:
        prefiller.close()
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts
