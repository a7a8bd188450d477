"""The prompt cache's disk tier: prompts' KV kept in files, so they outlive the RAM cache's evictions and restarts.

After a prefill the worker offers the prompt's exported KV (prefill_cpu.prefiller); unless it adds fewer than
MIN_WRITE_GAIN_TOKENS over an entry already stored, a background thread writes it as one file
(prefill_cpu.kv_disk_entry) and keeps the folder under its byte limit, least recently used file first, room made
before a file is written. Offers are queued, bounded in bytes: a full queue (a slow or full disk) drops the write
and counts it; the prefill never waits for the disk. An entry that a newer prompt of the same salt extends is
replaced by it, as in the RAM cache.

On a RAM-cache miss the worker asks `find` for the entry of the prompt's salt sharing the longest prefix with it: an
index in memory of each entry's token ids and chained hashes of their 16-token blocks (per salt: the chain starts from
the salt), rebuilt from the files' headers at start. `load` then reads the file and restores nothing unless its
checksum, facts, salt and token ids hold (kv_disk_entry.read_entry); a rejected file is deleted and counted.

Files are 0600 in a 0700 folder, one folder per model, KV type and worker (kv_disk_folder). Thread-safe: the prefill
thread finds and loads, the writer thread writes and evicts, any thread may delete a salt's entries or read stats.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from prefill_cpu.kv_disk_entry import (
    SUFFIX,
    EntryFacts,
    EntryHeader,
    EntryRejected,
    KVEntry,
    check_header,
    entry_name,
    read_entry,
    read_header,
    write_entry,
)

log = logging.getLogger(__name__)
BLOCK_TOKENS = 16  # the index's granularity: a stored prefix shorter than one block is never looked up
# an offer is written only when it holds at least this many tokens more than the stored entry of its salt sharing the
# longest prefix with it: a lookup takes a disk entry only when it beats the RAM cache by as many
# (disk_prefix.MIN_GAIN_TOKENS), and each warm request of a RAG set wrote its prompt and its answer, 34 MiB each at f16
MIN_WRITE_GAIN_TOKENS = 32
MAX_QUEUE_BYTES = 256 << 20  # offers waiting for the disk, at most (one larger offer may wait alone)


@dataclass(frozen=True)
class KVTierStats:
    """Counts since start; entries and bytes are what the folder holds now."""
    entries: int
    bytes: int
    max_bytes: int
    hits: int  # prompts that restored a stored prefix
    hit_tokens: int  # prompt tokens those restores covered (not computed)
    misses: int  # lookups that found nothing to restore (a rejected entry included)
    written: int
    evictions: int  # files deleted for room, or replaced by a prompt extending them
    rejected: int  # files that failed a check: corrupt, truncated, foreign model or KV type, another tenant's
    dropped_writes: int  # offers not written: the queue full, larger than the tier, or the disk failing
    skipped_writes: int = 0  # offers not written: fewer than MIN_WRITE_GAIN_TOKENS over a stored entry


@dataclass(frozen=True)
class Candidate:
    name: str
    shared: int  # prompt tokens the entry's token ids share with the prompt
    n_tokens: int  # the entry's


@dataclass
class _Indexed:
    salt: str
    tokens: np.ndarray  # [n] int32
    hashes: tuple[bytes, ...]  # chained hashes of its full blocks
    bytes: int
    last_used: float
    logits_follow: int = 0  # the tokens its stored last logits are those of (0: none)


@dataclass
class _Offer:
    name: str
    header: EntryHeader
    tokens: np.ndarray
    last_logits: np.ndarray | None
    state: bytes
    epoch: int  # the salt's deletion count when offered: a deleted salt's waiting offers are not written
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = self.header.file_bytes()


def kv_disk_folder(root: Path, fingerprint: str, kv_type: str, worker: str) -> Path:
    """One folder per model (by fingerprint), KV type and worker: each worker keeps its own byte limit and index."""
    return root / f"{fingerprint.split(':')[-1][:32]}-{kv_type}" / worker


class KVDiskTier:
    def __init__(self, folder: Path, max_bytes: int, facts: EntryFacts, max_queue_bytes: int = MAX_QUEUE_BYTES):
        self.folder, self.max_bytes, self.facts = Path(folder), max_bytes, facts
        self.max_queue_bytes = max_queue_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, _Indexed] = {}
        self._by_hash: dict[bytes, set[str]] = {}
        self._epochs: dict[str, int] = {}
        self._counts = dict.fromkeys(("hits", "hit_tokens", "misses", "written", "evictions", "rejected",
                                      "dropped_writes", "skipped_writes"), 0)
        self._queue: queue.Queue[_Offer | None] = queue.Queue()
        self._queued_bytes = 0
        self._closed = False
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.folder, 0o700)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # --- the prefill thread's side -------------------------------------------------------------------------------
    def find(self, tokens: list[int] | np.ndarray, salt: str) -> Candidate | None:
        """The entry of this salt sharing the longest prefix (at least one block) with tokens, from the index."""
        prompt = np.asarray(tokens, dtype=np.int32)
        with self._lock:
            return self._find(prompt, salt)

    def _find(self, prompt: np.ndarray, salt: str) -> Candidate | None:
        """find, under the lock."""
        names: set[str] = set()
        for digest in _block_hashes(salt, prompt):
            found = self._by_hash.get(digest)
            if not found:
                break
            names = found
        best = None
        for name in names:
            entry = self._entries[name]
            shared = _common_prefix(entry.tokens, prompt)
            if best is None or (shared, entry.last_used) > (best.shared, self._entries[best.name].last_used):
                best = Candidate(name, shared, len(entry.tokens))
        return best

    def load(self, candidate: Candidate, tokens: list[int] | np.ndarray, salt: str) -> KVEntry | None:
        """The candidate's entry read and checked against this context, salt and prompt; None (a miss) if it fails a
        check (the file is deleted) or is gone."""
        prompt = np.asarray(tokens, dtype=np.int32)[:candidate.shared]
        path = self.folder / candidate.name
        try:
            entry = read_entry(path, self.facts, salt, prompt)
        except EntryRejected as err:
            log.warning("KV disk tier: rejected %s: %s", candidate.name, err)
            self._forget(candidate.name, "rejected")
            self.count_miss()
            return None
        except OSError as err:  # evicted meanwhile, or the disk failing
            log.info("KV disk tier: could not read %s: %s", candidate.name, err)
            self.count_miss()
            return None
        now = time.time()
        with self._lock:
            if candidate.name in self._entries:
                self._entries[candidate.name].last_used = now
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += candidate.shared
        _touch(path, now)
        return entry

    def count_miss(self) -> None:
        with self._lock:
            self._counts["misses"] += 1

    def offer(self, tokens: list[int] | np.ndarray, salt: str, state: bytes, last_logits: np.ndarray | None) -> bool:
        """Queue a prompt's KV to be written; False if it was dropped (queue full, or larger than the tier). A prompt
        that adds fewer than MIN_WRITE_GAIN_TOKENS to what a stored entry of its salt holds (a RAG question after its
        document, a short answer after its prompt, the same prompt again) is not written: that entry is marked as
        used, and a restore of this prompt would take it and compute the rest."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) < BLOCK_TOKENS:  # the index would never find it
            return False
        name = entry_name(salt, tokens)
        with self._lock:
            if self._closed:
                self._counts["dropped_writes"] += 1
                return False
            stored = self._find(tokens, salt)
            if stored is not None and len(tokens) - stored.shared < MIN_WRITE_GAIN_TOKENS:
                entry = self._entries[stored.name]
                entry.last_used = time.time()
                _touch(self.folder / stored.name, entry.last_used)  # its place in the order of eviction after a restart
                self._counts["skipped_writes"] += stored.name != name
                return True
            header = EntryHeader(self.facts, salt, len(tokens), last_logits is not None, len(state))
            offer = _Offer(name, header, tokens, last_logits, state, self._epochs.get(salt, 0))
            full = self._queued_bytes and self._queued_bytes + offer.size > self.max_queue_bytes
            if full or offer.size > self.max_bytes:
                self._counts["dropped_writes"] += 1
                return False
            self._queued_bytes += offer.size
        self._queue.put(offer)
        return True

    # --- any thread ----------------------------------------------------------------------------------------------
    def delete_salt(self, salt: str) -> int:
        """Delete every entry of this salt (an operator forgetting a tenant), those still queued included; returns
        how many files were deleted."""
        with self._lock:
            self._epochs[salt] = self._epochs.get(salt, 0) + 1
            names = [name for name, entry in self._entries.items() if entry.salt == salt]
        for name in names:
            self._forget(name)
        log.info("KV disk tier: deleted %d entries of a salt", len(names))
        return len(names)

    def stats(self) -> KVTierStats:
        with self._lock:
            return KVTierStats(entries=len(self._entries), bytes=self._bytes(), max_bytes=self.max_bytes,
                               **self._counts)

    def flush(self) -> None:
        """Wait until every offer so far is written or dropped."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (once; later offers are dropped)."""
        with self._lock:
            closed, self._closed = self._closed, True
        if not closed:
            self._queue.put(None)
        self._writer.join()

    # --- the writer thread ---------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        _lower_priority()
        while (offer := self._queue.get()) is not None:
            try:
                self._write(offer)
            except Exception:  # a bad disk must not end the writer
                log.exception("KV disk tier: writing %s failed", offer.name)
                with self._lock:
                    self._counts["dropped_writes"] += 1
            finally:
                with self._lock:
                    self._queued_bytes -= offer.size
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, offer: _Offer) -> None:
        salt = offer.header.salt
        with self._lock:
            if self._epochs.get(salt, 0) != offer.epoch or offer.name in self._entries:
                return
        header, logits = self._carried_logits(offer)
        with self._lock:
            room = self._evict_for(header.file_bytes())
        for name in room:
            _unlink(self.folder / name)
        size = write_entry(self.folder / offer.name, header, offer.tokens, logits, offer.state)
        self._add(offer.name, salt, offer.tokens, size, time.time(), header.logits_follow)
        with self._lock:
            self._counts["written"] += 1
            deleted_meanwhile = self._epochs.get(salt, 0) != offer.epoch
            # the entries this prompt extends (same salt, their tokens its prefix) are replaced by it
            extended = [name for name, e in self._entries.items()
                        if e.salt == salt and len(e.tokens) < len(offer.tokens) and _is_prefix(e.tokens, offer.tokens)]
        for name in [offer.name] if deleted_meanwhile else extended:
            self._forget(name, "evictions" if not deleted_meanwhile else None)

    def _carried_logits(self, offer: _Offer) -> tuple[EntryHeader, np.ndarray | None]:
        """The offer's header and last logits; an entry without logits (an answer's KV the engine returned) takes
        those of the longest stored prompt it extends, read from its file, as the RAM cache carries them: the same
        prompt again, after a restart, is still a whole repeat that computes nothing."""
        if offer.last_logits is not None:
            return offer.header, offer.last_logits
        with self._lock:
            carriers = [(e.logits_follow, name) for name, e in self._entries.items()
                        if e.salt == offer.header.salt and e.logits_follow and len(e.tokens) <= len(offer.tokens)
                        and _is_prefix(e.tokens, offer.tokens)]
        if not carriers:
            return offer.header, None
        follow, name = max(carriers)
        try:
            entry = read_entry(self.folder / name, self.facts, offer.header.salt, offer.tokens[:follow])
        except (EntryRejected, OSError) as err:
            log.info("KV disk tier: the logits of %s not carried over: %s", name, err)
            return offer.header, None
        return replace(offer.header, has_logits=True, logits_len=follow), entry.last_logits

    def _evict_for(self, size: int) -> list[str]:
        """Under the lock: drop least recently used entries from the index until size more bytes fit; their names."""
        evicted = []
        total = self._bytes()
        while self._entries and total + size > self.max_bytes:
            name = min(self._entries, key=lambda n: self._entries[n].last_used)
            total -= self._drop(name)
            evicted.append(name)
        self._counts["evictions"] += len(evicted)
        return evicted

    # --- the index -----------------------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the index from the folder's headers (not their KV: start-up reads a few KiB a file)."""
        started, rejected = time.perf_counter(), 0
        for path in self.folder.iterdir():
            if path.name.startswith(".") and ".partial-" in path.name:
                _unlink(path)  # a write cut short by a crash
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                header, tokens = read_header(path)
                check_header(header, self.facts)
                if entry_name(header.salt, tokens) != path.name:
                    raise EntryRejected("its name is not its salt's and tokens'")
            except (EntryRejected, OSError) as err:
                log.warning("KV disk tier: rejected %s at start: %s", path.name, err)
                _unlink(path)
                rejected += 1
                continue
            self._add(path.name, header.salt, tokens, path.stat().st_size, path.stat().st_mtime, header.logits_follow)
        self._counts["rejected"] += rejected
        with self._lock:
            over = self._evict_for(0)  # a lower limit than the last run's
        for name in over:
            _unlink(self.folder / name)
        log.info("KV disk tier %s: %d entries (%.1f MiB of %.1f) found in %.2f s, %d rejected", self.folder,
                 len(self._entries), self._bytes() / 2**20, self.max_bytes / 2**20, time.perf_counter() - started,
                 rejected)

    def _add(self, name: str, salt: str, tokens: np.ndarray, size: int, last_used: float,
             logits_follow: int = 0) -> None:
        hashes = tuple(_block_hashes(salt, tokens))
        with self._lock:
            self._entries[name] = _Indexed(salt, np.asarray(tokens, dtype=np.int32), hashes, size, last_used,
                                           logits_follow)
            for digest in hashes:
                self._by_hash.setdefault(digest, set()).add(name)

    def _forget(self, name: str, counter: str | None = None) -> None:
        with self._lock:
            if name in self._entries:
                self._drop(name)
            if counter:
                self._counts[counter] += 1
        _unlink(self.folder / name)

    def _drop(self, name: str) -> int:
        """Under the lock: the entry out of the index; its bytes."""
        entry = self._entries.pop(name)
        for digest in entry.hashes:
            names = self._by_hash[digest]
            names.discard(name)
            if not names:
                del self._by_hash[digest]
        return entry.bytes

    def _bytes(self) -> int:
        return sum(e.bytes for e in self._entries.values())


def _block_hashes(salt: str, tokens: np.ndarray):
    """Chained hashes of tokens' full blocks, the chain keyed by the salt: equal hashes, equal salt and prefix."""
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    step = 4 * BLOCK_TOKENS
    for begin in range(0, len(data) - step + 1, step):
        digest = hashlib.blake2b(digest + data[begin:begin + step], digest_size=16).digest()
        yield digest


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _is_prefix(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) <= len(b) and bool(np.array_equal(a, b[:len(a)]))


def _touch(path: Path, when: float) -> None:
    """The file's mtime is its last use: the order of eviction after a restart."""
    try:
        os.utime(path, (when, when))
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        log.warning("KV disk tier: could not delete %s: %s", path, err)


def _lower_priority() -> None:
    """The writer hashes and writes while the next prompt prefills: it yields the cores to it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass
