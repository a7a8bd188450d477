"""prefill_cpu/prefill_weights.py under the memory plan (contracts/memory_plan.py): auto measures only the copies the
plan leaves room for, and prefills from the given file when none fits, a recorded choice of a copy included."""

from __future__ import annotations

import json

import llama_cpp
import pytest

from contracts.cache import converted_dir
from contracts.identity import read_gguf_identity
from prefill_cpu import prefill_weights


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    return tmp_path


def test_the_plans_copies_replace_the_quarter_of_the_memory_rule(embedded_model_path, tmp_path, monkeypatch):
    assert prefill_weights.candidate(embedded_model_path, tmp_path) == "f16"  # 0.27 GB: within a quarter
    assert prefill_weights.candidate(embedded_model_path, tmp_path, ()) is None
    assert prefill_weights.candidate(embedded_model_path, tmp_path, ("q8_0",)) == "q8_0"
    # a box of 512 MB: a quarter holds neither copy, but the plan, which counted everything else, says q8_0 fits
    monkeypatch.setattr(prefill_weights.psutil, "virtual_memory", lambda: type("M", (), {"total": 512 * 10**6}))
    assert prefill_weights.candidate(embedded_model_path, tmp_path) is None
    assert prefill_weights.candidate(embedded_model_path, tmp_path, ("f16", "q8_0")) == "f16"


def test_no_room_for_a_copy_prefills_from_the_given_file_without_converting(embedded_model_path, cache, monkeypatch):
    monkeypatch.setattr(prefill_weights, "measure_prefill", lambda *args, **kwargs: pytest.fail("measured"))
    monkeypatch.setattr(prefill_weights, "quantize_gguf", lambda *args: pytest.fail("converted"))
    identity = read_gguf_identity(embedded_model_path)
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128, copy_kinds=()) == identity.path
    # nothing recorded: a later start with room for a copy measures it
    assert not (converted_dir(identity) / prefill_weights.DECISION_FILE).exists()
    assert prefill_weights.auto_outlook(identity, ()) == "the given file: a converted copy would not fit (memory or disk)"
    assert prefill_weights.auto_outlook(identity).startswith("not measured yet: the first start converts it to f16")


def test_a_recorded_copy_the_plan_has_no_room_for_is_not_used(embedded_model_path, cache, monkeypatch):
    monkeypatch.setattr(prefill_weights, "measure_prefill", lambda *args, **kwargs: pytest.fail("measured"))
    identity = read_gguf_identity(embedded_model_path)
    folder = converted_dir(identity)
    folder.mkdir(parents=True)
    key = {"cpu": llama_cpp.llama_print_system_info().decode(errors="replace").strip(), "threads": 2, "n_batch": 128}
    record = {"key": key, "choice": "f16", "candidate": "f16", "given_tok_s": 178.0, "converted_tok_s": 330.0}
    (folder / prefill_weights.DECISION_FILE).write_text(json.dumps(record))
    (folder / "prefill-f16.gguf").write_bytes(b"")  # the recorded copy, there already: no conversion needed
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128).endswith("prefill-f16.gguf")
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128, copy_kinds=("f16",)).endswith(".gguf")
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128, copy_kinds=("q8_0",)) == identity.path
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128, copy_kinds=()) == identity.path
    assert json.loads((folder / prefill_weights.DECISION_FILE).read_text()) == record  # the measurement is kept
    assert "does not fit the memory plan" in prefill_weights.auto_outlook(identity, ())
    assert prefill_weights.auto_outlook(identity).startswith("its f16 copy")


def test_the_worker_passes_the_plans_copies_to_its_prefiller(embedded_model_path, monkeypatch):
    """The plan's copy kinds travel edge serve -> WorkerProcessConfig -> PrefillConfig -> prefill_weights_path."""
    from prefill_cpu import prefiller

    seen = {}

    class Stop(Exception):
        pass

    def recorded(identity, choice, threads, n_batch, copy_kinds=None):
        seen.update(choice=choice, copy_kinds=copy_kinds)
        raise Stop

    monkeypatch.setattr(prefiller, "prefill_weights_path", recorded)
    with pytest.raises(Stop):
        prefiller.Prefiller(prefiller.PrefillConfig(str(embedded_model_path), n_ctx=256, weights="auto",
                                                    prefill_copy_kinds=("q8_0",)))
    assert seen == {"choice": "auto", "copy_kinds": ("q8_0",)}
