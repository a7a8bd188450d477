"""The worker's prefill rate from its real chunks, held against the rate prefill_weights = auto recorded
(prefill_cpu.prefill_rate), and a record found slowed measured again at the next start."""

import json
import logging

import pytest

from contracts.cache import converted_dir
from contracts.identity import read_gguf_identity
from prefill_cpu import prefill_weights
from prefill_cpu.prefill_rate import MIN_CHUNK, MIN_SAMPLES, PrefillRate, Recorded
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest


def _record(tmp_path, given=300.0, converted=560.0):
    record = tmp_path / prefill_weights.DECISION_FILE
    record.write_text(json.dumps({"key": {"threads": 2, "n_batch": 128}, "choice": "f16", "candidate": "f16",
                                  "given_tok_s": given, "converted_tok_s": converted}))
    return record


def _feed(rate: PrefillRate, tok_s: float, chunks: int = 30, threads: int = 2) -> None:
    for _ in range(chunks):
        rate.observe(128, 128 / tok_s, threads)


def test_the_estimate_follows_full_thread_chunks_only():
    rate = PrefillRate(threads=2)
    rate.observe(MIN_CHUNK - 1, 0.001, 2)  # too short to compare with a 256-token measurement
    assert rate.tok_s is None
    _feed(rate, 400.0, chunks=3, threads=1)  # the engine decoding on the same cores
    assert rate.tok_s is None and rate.shared_tok_s == pytest.approx(400.0)
    _feed(rate, 500.0)
    assert rate.tok_s == pytest.approx(500.0) and rate.num_chunks == 30
    rate.observe(128, 128 / 50_000.0, 2)  # one stalled or freak chunk moves it by a bounded step
    assert rate.tok_s < 500.0 * (1 + 3 * 0.2) + 1


def test_a_live_rate_well_above_the_record_marks_it_stale_with_hysteresis(tmp_path, caplog):
    record = _record(tmp_path)
    rate = PrefillRate(2, Recorded(560.0, record))
    _feed(rate, 560.0)
    assert rate.verdict == "as recorded" and "stale" not in json.loads(record.read_text())
    with caplog.at_level(logging.WARNING):
        _feed(rate, 800.0)  # 1.43x: the start-up turn of this file ran slowed
    assert rate.verdict == "faster than recorded"
    assert "the next start measures again" in caplog.text
    stale = json.loads(record.read_text())["stale"]
    assert stale["threads"] == 2 and stale["live_tok_s"] > 1.3 * 560
    _feed(rate, 680.0)  # 1.21x: inside the threshold, not past the band
    assert rate.verdict == "faster than recorded"
    _feed(rate, 600.0)  # 1.07x
    assert rate.verdict == "as recorded"


def test_a_live_rate_well_below_the_record_is_load_not_a_wrong_choice(tmp_path):
    record = _record(tmp_path)
    rate = PrefillRate(2, Recorded(560.0, record))
    _feed(rate, 300.0)  # 0.54x: a busy neighbour
    assert rate.verdict == "slower than recorded"
    assert "stale" not in json.loads(record.read_text())
    _feed(rate, 420.0)  # 0.75x: inside the threshold, not past the band
    assert rate.verdict == "slower than recorded"
    _feed(rate, 520.0)
    assert rate.verdict == "as recorded"


def test_no_verdict_before_enough_chunks(tmp_path):
    rate = PrefillRate(2, Recorded(560.0, _record(tmp_path)))
    _feed(rate, 2000.0, chunks=MIN_SAMPLES - 1)
    assert rate.level is None and rate.verdict == "as recorded"


def test_a_stale_record_is_measured_again_at_the_next_start(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path))
    identity = read_gguf_identity(str(tiny_gguf("llama")))
    copy = tmp_path / "prefill-f16.gguf"
    copy.write_text("")
    calls = []
    monkeypatch.setattr(prefill_weights, "candidate", lambda path, folder, copy_kinds=None: "f16")
    monkeypatch.setattr(prefill_weights, "converted_copy", lambda identity, kind, folder: copy)
    monkeypatch.setattr(prefill_weights, "measure_prefill",
                        lambda paths, threads, n_batch: calls.append(paths) or [300.0, 560.0])
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128) == str(copy)
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128) == str(copy)
    assert len(calls) == 1  # recorded
    recorded = prefill_weights.recorded_rate(identity, str(copy), 2, 128)
    assert recorded.tok_s == 560.0
    assert prefill_weights.recorded_rate(identity, identity.path, 2, 128).tok_s == 300.0
    assert prefill_weights.recorded_rate(identity, str(copy), 1, 128) is None  # measured at another thread count
    rate = PrefillRate(2, recorded)
    _feed(rate, 900.0)
    assert "measured again at the next start" in prefill_weights.auto_outlook(identity)
    assert prefill_weights.prefill_weights_path(identity, "auto", 2, 128) == str(copy)
    assert len(calls) == 2
    decision = json.loads((converted_dir(identity) / prefill_weights.DECISION_FILE).read_text())
    assert "stale" not in decision


def test_a_prefiller_times_its_real_chunks(tiny_gguf):
    prefiller = Prefiller(PrefillConfig(str(tiny_gguf("llama")), n_ctx=512, n_batch=64, n_threads=1, kv_type="f16"))
    try:
        assert prefiller.rate.recorded is None  # given file, nothing recorded
        prefiller.prefill(PrefillRequest("r", tuple(range(1, 2 * MIN_CHUNK + 10))))
        assert prefiller.rate.num_chunks == 2 and prefiller.rate.tok_s > 0  # the short last chunk does not count
    finally:
        prefiller.close()
