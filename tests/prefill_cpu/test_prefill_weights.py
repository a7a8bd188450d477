"""The prefill worker's weights: the GGUF as given, or a copy converted once for prefill speed
(prefill_cpu.prefill_weights)."""

import json

import numpy as np
import pytest

from contracts.cache import converted_dir
from contracts.identity import read_gguf_identity
from prefill_cpu import prefill_weights
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

PROMPTS = ["The history of the printing press begins in",
           "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    if n < 2:\n        return n\n"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    return tmp_path


def _last_logits(prefiller: Prefiller) -> list[np.ndarray]:
    rows = []
    for i, text in enumerate(PROMPTS):
        prefiller.prefill(PrefillRequest(f"r{i}", tuple(prefiller.tokenize(text))))
        rows.append(prefiller._last_logits().astype(np.float64).copy())
    return rows


def _kl(reference: np.ndarray, other: np.ndarray) -> float:
    p, q = (np.exp(x - x.max()) for x in (reference, other))
    p, q = p / p.sum(), q / q.sum()
    return float((p * (np.log(p + 1e-30) - np.log(q + 1e-30))).sum())


def _prefiller(path: str, weights: str) -> Prefiller:
    return Prefiller(PrefillConfig(path, n_ctx=256, n_batch=128, n_threads=2, kv_type="f16", weights=weights))


@pytest.mark.slow
def test_the_f16_copy_computes_the_model_the_given_file_holds(embedded_model_path, cache, tmp_path):
    """The Q4_1 file's own CPU path rounds activations to 8 bits; its f16 copy computes what float32 weights do, and
    the handoff still names the given file."""
    reference_path = tmp_path / "f32.gguf"
    prefill_weights.quantize_gguf(embedded_model_path, reference_path, "f32")
    logits = {}
    for weights in ("given", "f16"):
        prefiller = _prefiller(embedded_model_path, weights)
        try:
            logits[weights] = _last_logits(prefiller)
            assert prefiller.identity == read_gguf_identity(embedded_model_path)
            assert (weights == "f16") == (prefiller.weights_path != embedded_model_path)
        finally:
            prefiller.close()
    reference = Prefiller(PrefillConfig(str(reference_path), n_ctx=256, n_batch=128, n_threads=2, kv_type="f16"))
    try:
        logits["f32"] = _last_logits(reference)
    finally:
        reference.close()
    for f32, f16, given in zip(logits["f32"], logits["f16"], logits["given"]):
        assert np.argmax(f16) == np.argmax(f32)
        assert _kl(f32, f16) < 2e-4  # measured 0.00000-0.00004
        assert _kl(f32, given) > _kl(f32, f16)  # the given file's path: 0.002-0.0035


@pytest.mark.slow
def test_auto_measures_once_and_keeps_the_faster_file(embedded_model_path, cache, monkeypatch):
    calls = []

    def measured(paths, threads, n_batch, rounds=3):
        calls.append(paths)
        return [300.0, 560.0]

    monkeypatch.setattr(prefill_weights, "measure_prefill", measured)
    identity = read_gguf_identity(embedded_model_path)
    first = prefill_weights.prefill_weights_path(identity, "auto", 2, 128)
    again = prefill_weights.prefill_weights_path(identity, "auto", 2, 128)
    assert first == again and first.endswith("prefill-f16.gguf")
    assert len(calls) == 1  # the decision is recorded: the second start does not measure
    decision = json.loads((converted_dir(identity) / prefill_weights.DECISION_FILE).read_text())
    assert decision["choice"] == "f16" and decision["given_tok_s"] == 300.0
    prefill_weights.prefill_weights_path(identity, "auto", 1, 128)  # another thread count: measured again
    assert len(calls) == 2


@pytest.mark.slow
def test_auto_keeps_the_given_file_when_the_copy_is_not_faster_enough(embedded_model_path, cache, monkeypatch):
    monkeypatch.setattr(prefill_weights, "measure_prefill", lambda paths, threads, n_batch, rounds=3: [300.0, 330.0])
    identity = read_gguf_identity(embedded_model_path)
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128) == identity.path
    assert not (converted_dir(identity) / "prefill-f16.gguf").exists()  # the unused copy is not kept


def test_auto_makes_no_copy_of_a_float_file(tiny_gguf, cache, monkeypatch):
    monkeypatch.setattr(prefill_weights, "measure_prefill", lambda *args, **kwargs: pytest.fail("measured"))
    identity = read_gguf_identity(str(tiny_gguf("llama", "f16")))
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 64) == identity.path


def test_auto_measures_real_prefill(tiny_gguf):
    given, again = prefill_weights.measure_prefill([str(tiny_gguf("llama"))] * 2, threads=1, n_batch=64, rounds=1)
    assert given > 0 and again > 0


def test_a_bad_choice_is_refused(embedded_model_path):
    with pytest.raises(ValueError, match="prefill weights 'q4_0': choose one of auto, given, f16, bf16, q8_0"):
        prefill_weights.prefill_weights_path(read_gguf_identity(embedded_model_path), "q4_0", 2, 128)


def test_auto_falls_back_to_the_given_file_when_the_cache_is_not_writable(embedded_model_path, tmp_path, monkeypatch,
                                                                          caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("EDGE_LLM_CACHE", str(blocker))  # the cache folder cannot be made under a file
    identity = read_gguf_identity(embedded_model_path)
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128) == identity.path
    assert "prefilling from the given file, no converted copy" in caplog.text
    with pytest.raises(RuntimeError, match="prefill weights f16: "):  # named explicitly: a clear failure
        prefill_weights.prefill_weights_path(identity, "f16", 2, 128)
