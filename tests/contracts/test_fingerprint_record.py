"""contracts/identity.py file_fingerprint: the whole file's sha256, kept on disk by path, size, mtime, inode and
device, so a later process does not read a multi-GB GGUF again; a changed file is read again."""

from __future__ import annotations

import hashlib
import os

from contracts import identity


def test_a_second_process_reads_the_record_and_a_changed_file_is_hashed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 1000)
    expected = "sha256:" + hashlib.sha256(b"a" * 1000).hexdigest()
    assert identity.file_fingerprint(str(path)) == expected
    assert len(list((tmp_path / "cache" / "fingerprints").glob("*.json"))) == 1
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: (reads.append(a[0]), real_open(*a, **k))[1])
    assert identity.file_fingerprint(str(path)) == expected and str(path) not in reads  # from the record
    monkeypatch.undo()
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path / "cache"))
    path.write_bytes(b"b" * 1000)  # same size, a new mtime
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert identity.file_fingerprint(str(path)) == "sha256:" + hashlib.sha256(b"b" * 1000).hexdigest()


def test_a_broken_or_foreign_record_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x" * 10)
    record = identity._fingerprint_record(os.path.realpath(path))
    record.parent.mkdir(parents=True)
    for text in ("not json", '{"key": [], "fingerprint": "sha256:00"}', "[1, 2]"):
        record.write_text(text)
        assert identity.file_fingerprint(str(path)) == "sha256:" + hashlib.sha256(b"x" * 10).hexdigest()
