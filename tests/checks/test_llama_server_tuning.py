"""checks/llama_server_tuning.py: llama-server's options as argv, the f16 file beside a ladder GGUF, and the greedy
search keeping an option only where it measured better (the probes stood in for: no server starts here)."""

from __future__ import annotations

from dataclasses import replace

from checks import llama_server_tuning
from checks.llama_server_tuning import PeerSetting, choose, f16_beside


def test_every_option_reaches_the_command_line():
    setting = PeerSetting("/m/ladder-1b-q4_k_m.gguf", "given", 1, 16, 4096, repack=False, ubatch=128,
                          cont_batching=False)
    argv = setting.argv(8080)
    for flag, value in (("-t", "1"), ("-tb", "1"), ("-np", "16"), ("-c", "65536"), ("-ub", "128"), ("--port", "8080")):
        assert argv[argv.index(flag) + 1] == value
    assert "--no-repack" in argv and "--no-cont-batching" in argv
    plain = PeerSetting("/m/x.gguf", "given", 2, 4, 1024).argv(1)
    assert "--no-repack" not in plain and "--no-cont-batching" not in plain
    assert setting.label == "given, -t 1, -np 16, -ub 128, --no-repack, -nocb"


def test_the_f16_file_of_the_same_rung_is_found_where_it_lies(tmp_path):
    given = tmp_path / "ladder-1b-q4_k_m.gguf"
    given.write_bytes(b"x")
    assert f16_beside(str(given)) is None
    (tmp_path / "ladder-1b-f16.gguf").write_bytes(b"x" * 1024)
    assert f16_beside(str(given)) == str(tmp_path / "ladder-1b-f16.gguf")
    assert f16_beside(str(tmp_path / "other.gguf")) is None  # not a ladder name: no f16 named after it


def test_the_search_keeps_an_option_only_where_it_measured_better(monkeypatch, tmp_path):
    given = tmp_path / "ladder-1b-q4_k_m.gguf"
    given.write_bytes(b"x")
    (tmp_path / "ladder-1b-f16.gguf").write_bytes(b"x")
    # one stream: one thread beats two (the shared box), the given file beats f16, the repack off is better
    single = {("given", 1, True): 2.0, ("given", 2, True): 0.3, ("f16", 1, True): 1.2, ("f16", 2, True): 0.2,
              ("given", 1, False): 2.1}
    # a burst: four slots lose to sixteen, a smaller ubatch wins
    bursts = {(16, 512): 1.4, (4, 512): 1.1, (16, 128): 1.6}
    measured = []

    def fake_single(setting, model_id, tokens):
        measured.append(("single", setting))
        score = single[(setting.weights, setting.threads, setting.repack)]
        return {"setting": setting, "probe": "single", "score": score, "ready_s": 1.0, "prefill_tok_s": 10.0}

    def fake_burst(setting, model_id, concurrency, tokens):
        measured.append(("burst", setting))
        return {"setting": setting, "probe": "burst", "score": bursts[(setting.slots, setting.ubatch)],
                "wall_s": 1.0, "errors": []}
    monkeypatch.setattr(llama_server_tuning, "single_stream", fake_single)
    monkeypatch.setattr(llama_server_tuning, "burst", fake_burst)
    chosen, probes = choose(str(given), 16, 4096, log=lambda line: None)
    best_single = PeerSetting(str(given), "given", 1, 16, 4096, repack=False)
    assert chosen == replace(best_single, ubatch=128)
    assert len(probes) == len(measured) == 4 + 1 + 3
    assert [p["probe"] for p in probes] == ["single"] * 5 + ["burst"] * 3
    # the slots probe is against the best so far, and lost: the ubatch probe kept 16 slots
    assert probes[6]["setting"].slots == 4 and probes[7]["setting"].slots == 16
    only_threads, probes = choose(str(given), 16, 4096, burst_options=(), log=lambda line: None)
    assert only_threads == best_single and [p["probe"] for p in probes] == ["single"] * 5
