"""The prompt cache's disk tier on its own (no llama.cpp): entries written off the caller's thread, found by the
longest shared prefix of their salt, checked before they are restored, under a byte limit, rebuilt at start."""

import os
import stat
import threading
from dataclasses import replace

import numpy as np
import pytest

from prefill_cpu import kv_disk_tier
from prefill_cpu.kv_disk_entry import EntryFacts, entry_name
from prefill_cpu.kv_disk_tier import BLOCK_TOKENS, KVDiskTier

FACTS = EntryFacts("sha256:" + "ab" * 32, "given", "0.3.36", "q8_0", 64, 64, True, 3, 128, 128, 320)
DOC = np.arange(3, 83, dtype=np.int32)  # 80 tokens: five blocks
STATE = bytes(range(256)) * 64  # stands in for llama.cpp's state bytes
LOGITS = np.linspace(-3, 3, FACTS.n_vocab, dtype=np.float32)


def tier(folder, **kw) -> KVDiskTier:
    return KVDiskTier(folder, kw.pop("max_bytes", 1 << 20), kw.pop("facts", FACTS), **kw)


def stored(t: KVDiskTier, tokens=DOC, salt="a", state=STATE, logits=LOGITS) -> None:
    assert t.offer(tokens, salt, state, logits)
    t.flush()


def test_an_entry_comes_back_for_a_prompt_it_starts_and_after_a_restart(tmp_path):
    first = tier(tmp_path)
    stored(first)
    prompt = np.concatenate([DOC, [7, 8, 9]])
    found = first.find(prompt, "a")
    assert (found.shared, found.n_tokens) == (len(DOC), len(DOC))
    first.close()
    again = tier(tmp_path)  # a new worker over the same folder: the index comes from the files
    found = again.find(prompt, "a")
    entry = again.load(found, prompt, "a")
    assert bytes(entry.state) == STATE and np.array_equal(entry.last_logits, LOGITS)
    assert np.array_equal(entry.tokens, DOC)
    s = again.stats()
    assert (s.entries, s.hits, s.hit_tokens, s.rejected) == (1, 1, len(DOC), 0)
    # a prompt sharing only part of the entry: the shared part, to the token
    other = np.concatenate([DOC[:37], [1, 2, 3] * 10])
    assert again.find(other, "a").shared == 37
    assert again.find(DOC[:BLOCK_TOKENS - 1], "a") is None  # less than a block is never looked up
    again.close()


def test_files_are_private_to_the_worker(tmp_path):
    t = tier(tmp_path / "kv")
    stored(t)
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    (path,) = (tmp_path / "kv").iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    t.close()


def test_a_flipped_byte_is_a_miss_and_the_file_goes(tmp_path):
    t = tier(tmp_path)
    stored(t)
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the KV payload: the header still reads
    path.write_bytes(bytes(data))
    found = t.find(DOC, "a")
    assert found is not None and t.load(found, DOC, "a") is None
    assert t.stats().rejected == 1 and t.stats().misses == 1 and not path.exists() and t.find(DOC, "a") is None
    t.close()


def test_a_truncated_file_is_a_miss_found_at_start_or_at_load(tmp_path):
    t = tier(tmp_path)
    stored(t)
    stored(t, DOC + 1000)
    paths = sorted(tmp_path.iterdir())
    for path in paths:
        os.truncate(path, path.stat().st_size - 100)
    assert t.load(t.find(DOC, "a"), DOC, "a") is None  # truncated under a running tier
    t.close()
    again = tier(tmp_path)  # the other one, at start
    assert again.find(DOC + 1000, "a") is None and again.stats().rejected == 1
    assert list(tmp_path.iterdir()) == []
    again.close()


@pytest.mark.parametrize("change", [{"model_fingerprint": "sha256:" + "cd" * 32}, {"kv_type": "f16"},
                                    {"weights": "prefill-f16.gguf"}, {"llama_cpp_version": "0.3.37"},
                                    {"v_rotation": 0}])
def test_an_entry_of_another_model_weights_kv_type_or_llama_cpp_is_rejected(tmp_path, change):
    t = tier(tmp_path)
    stored(t)
    t.close()
    other = tier(tmp_path, facts=replace(FACTS, **change))
    assert other.find(DOC, "a") is None and other.stats().rejected == 1 and other.stats().entries == 0
    other.close()


def test_another_tenants_entry_is_never_found_nor_restored(tmp_path):
    t = tier(tmp_path)
    stored(t, salt="a")
    assert t.find(DOC, "b") is None and t.find(DOC, "") is None
    stored(t, salt="b", state=STATE[::-1])
    found = t.find(DOC, "b")
    # tenant a's file put where tenant b's was, after the index was built: its header's salt refuses it
    (tmp_path / entry_name("b", DOC)).write_bytes((tmp_path / entry_name("a", DOC)).read_bytes())
    assert t.load(found, DOC, "b") is None and t.stats().rejected == 1
    assert bytes(t.load(t.find(DOC, "a"), DOC, "a").state) == STATE
    t.close()


def test_the_tier_never_exceeds_its_byte_limit(tmp_path):
    probe = tier(tmp_path / "probe")
    stored(probe)
    size = probe.stats().bytes
    probe.close()
    limit = int(size * 2.5)
    t = tier(tmp_path / "t", max_bytes=limit)
    for i in range(6):
        stored(t, DOC + 100 * (i + 1))
        on_disk = sum(p.stat().st_size for p in (tmp_path / "t").iterdir())
        assert on_disk <= limit and t.stats().bytes == on_disk
    s = t.stats()
    assert (s.entries, s.written, s.evictions) == (2, 6, 4)
    assert t.find(DOC + 600, "a") is not None and t.find(DOC + 100, "a") is None  # the least recently used went
    assert not t.offer(np.arange(3, 3000, dtype=np.int32), "a", STATE * 10, None)  # larger than the whole tier
    assert t.stats().dropped_writes == 1
    t.close()
    smaller = tier(tmp_path / "t", max_bytes=size + 10)  # restarted with a lower limit: the oldest file goes
    assert smaller.stats().entries == 1 and smaller.find(DOC + 600, "a") is not None
    smaller.close()


def test_a_slow_disk_drops_writes_and_counts_them_never_blocks(tmp_path, monkeypatch):
    writing, release = threading.Event(), threading.Event()
    real_write = kv_disk_tier.write_entry

    def slow_write(*args):
        writing.set()
        release.wait(30)
        return real_write(*args)

    monkeypatch.setattr(kv_disk_tier, "write_entry", slow_write)
    t = tier(tmp_path, max_queue_bytes=len(STATE) * 3 // 2)
    assert t.offer(DOC, "a", STATE, LOGITS)
    assert writing.wait(30)  # the writer holds the first offer
    assert not t.offer(DOC + 1000, "a", STATE, LOGITS)  # no room in the queue: dropped at once
    release.set()
    t.flush()
    s = t.stats()
    assert (s.written, s.dropped_writes, s.entries) == (1, 1, 1)
    t.close()


def test_a_full_disk_drops_the_write_and_the_writer_goes_on(tmp_path, monkeypatch):
    real_write = kv_disk_tier.write_entry
    monkeypatch.setattr(kv_disk_tier, "write_entry", lambda *a: (_ for _ in ()).throw(OSError(28, "No space")))
    t = tier(tmp_path)
    t.offer(DOC, "a", STATE, LOGITS)
    t.flush()
    assert t.stats().dropped_writes == 1 and t.stats().entries == 0
    monkeypatch.setattr(kv_disk_tier, "write_entry", real_write)
    stored(t, DOC + 1000)
    assert t.stats().entries == 1
    t.close()


def test_an_extending_prompt_replaces_its_prefix_and_a_salt_can_be_deleted(tmp_path):
    t = tier(tmp_path)
    stored(t, DOC[:40])
    stored(t, DOC)  # the same conversation, one turn on: the shorter entry is replaced
    stored(t, DOC[:40], salt="b")
    assert t.stats().entries == 2 and t.find(DOC[:40], "a").n_tokens == len(DOC)
    assert t.offer(DOC + 1000, "a", STATE, LOGITS)  # queued, not yet written, when the salt is deleted
    assert t.delete_salt("a") >= 1
    t.flush()
    assert t.find(DOC, "a") is None and t.find(DOC + 1000, "a") is None
    assert [p.name for p in tmp_path.iterdir()] == [entry_name("b", DOC[:40])]
    t.close()


def test_an_answers_entry_carries_the_logits_of_the_prompt_it_extends_across_a_restart(tmp_path):
    t = tier(tmp_path)
    stored(t, DOC[:40])  # a prompt, with its last logits
    stored(t, DOC, logits=None)  # its answer's KV the engine returned: no logits of its own
    t.close()
    again = tier(tmp_path)  # after a restart: one entry, the longer, with the prompt's logits and where they follow
    assert again.stats().entries == 1
    found = again.find(DOC[:40], "a")
    entry = again.load(found, DOC[:40], "a")
    assert (found.n_tokens, entry.header.logits_follow) == (len(DOC), 40)
    assert np.array_equal(entry.last_logits, LOGITS)
    stored(again, DOC + 1000, logits=None)  # nothing to carry: another conversation
    entry = again.load(again.find(DOC + 1000, "a"), DOC + 1000, "a")
    assert entry.last_logits is None and entry.header.logits_follow == 0
    again.close()


def test_the_knobs_reach_each_workers_config():
    from contracts.process_config import WorkerProcessConfig, decode_config, encode_config
    from edge.config import ServeConfig
    from edge.launch.launcher import worker_config

    worker = worker_config(ServeConfig(kv_disk_bytes=1 << 30, kv_disk_dir="/srv/kv"), "m.gguf", "prefill-1",
                           "unix:/w.sock", "", "f16", 2)
    assert (worker.kv_disk_bytes, worker.kv_disk_dir) == (1 << 30, "/srv/kv")
    assert decode_config(WorkerProcessConfig, encode_config(worker)) == worker
    assert WorkerProcessConfig(model="m.gguf", listen="unix:/w.sock").kv_disk_bytes == 0  # off by default


def test_a_folder_that_cannot_be_made_leaves_the_worker_without_the_tier(tmp_path, caplog):
    from types import SimpleNamespace

    from prefill_cpu.disk_prefix import open_disk_tier

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    ident = SimpleNamespace(fingerprint=FACTS.model_fingerprint, swa_layers=(), path="m.gguf", n_layer=3,
                            n_embd_k=128, n_embd_v=128)
    config = SimpleNamespace(kv_disk_bytes=1 << 20, kv_disk_dir=str(blocked), kv_type="q8_0", worker_name="w")
    prefiller = SimpleNamespace(config=config, identity=ident, weights_path="m.gguf", k_rotation=64, v_rotation=64,
                                vocab_size=320)
    assert open_disk_tier(prefiller, True) is None and "KV disk tier off" in caplog.text
    config.kv_disk_dir = str(tmp_path / "kv")
    tier = open_disk_tier(prefiller, True)
    assert tier.facts == FACTS and tier.folder == tmp_path / "kv" / (FACTS.model_fingerprint[7:39] + "-q8_0") / "w"
    tier.close()


def test_an_offer_adding_fewer_than_32_tokens_over_a_stored_entry_is_not_written(tmp_path):
    """A RAG set's warm request (its document stored, another question) and a short answer after its prompt are not
    written again: the stored entry is marked as used, and a restore takes it and computes the rest."""
    t = tier(tmp_path, max_bytes=8 << 20)
    question = np.array([9, 9, 9, 9, 9], dtype=np.int32)
    first = np.concatenate([DOC, question])
    stored(t, first)  # the document and its first question
    t.find(first, "a")  # (the entry's last use is now; the skipped offer below makes it later still)
    before = t._entries[entry_name("a", first)].last_used
    second = np.concatenate([DOC, question + 1])  # the same document, another question: 5 new tokens
    assert t.offer(second, "a", STATE, LOGITS)
    gain = kv_disk_tier.MIN_WRITE_GAIN_TOKENS
    assert t.offer(np.concatenate([first, np.full(gain - 1, 7, np.int32)]), "a", STATE, None)  # a short answer
    t.flush()
    s = t.stats()
    assert (s.entries, s.written, s.skipped_writes) == (1, 1, 2)
    assert t._entries[entry_name("a", first)].last_used >= before
    assert t.find(second, "a").shared == len(DOC)  # a restore of the second question takes the document
    # the same prompt again is neither written nor counted as skipped (it is the stored entry)
    assert t.offer(first, "a", STATE, LOGITS)
    t.flush()
    assert (t.stats().written, t.stats().skipped_writes) == (1, 2)
    # 32 tokens more is written (and replaces the entry it extends); another tenant's entry never counts
    longer = np.concatenate([first, np.full(gain, 7, np.int32)])
    stored(t, longer, logits=None)
    stored(t, second, salt="b")
    s = t.stats()
    assert (s.entries, s.written, s.skipped_writes) == (2, 3, 2)
    assert t.find(first, "a").n_tokens == len(longer)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([entry_name("a", longer), entry_name("b", second)])
    t.close()
