"""The audit log: one JSON line per request, accepted or refused, appended to a file rotated by size, its
history kept by count and by age (docs/audit.md).

A line has a bounded size: a client-chosen string is cut at MAX_FIELD_CHARS and a kept prompt at MAX_TEXT_CHARS,
each cut one followed by its length and the sha256 of the whole, so that the record still identifies it. A
rotated file is dropped only when it is both past the count (audit_log_backups) and older than the kept history
(audit_log_keep_days): a burst of junk lines can rotate many files, but cannot push the last days' record out.

It is a gateway observer, so it runs on the event loop. Each line is a plain buffered write flushed at
once: a line is a few hundred bytes (a few MiB at most when the policy keeps prompt text), and a write to
the page cache takes microseconds, so a writer thread and its queue would cost more than they save and
could lose lines queued at a crash. No fsync per line: a power loss may cost the last lines."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from datetime import UTC, datetime

from edge.core.request_record import RequestRecord
from policies.enforcer import PolicyEnforcer

MAX_FIELD_CHARS = 256  # of a client-chosen string in an entry
MAX_TEXT_CHARS = 64 * 1024  # of a prompt's text, when the policy keeps it
MAX_FILES = 10_000  # rotated files kept at most, however young: a bound on the disk a flood can take
log = logging.getLogger("edge.observe.audit")


class RotatingFile:
    """Appends lines to path. Before a line would take the file past max_bytes, path becomes path.1 (path.1
    becomes path.2, and so on) and a new file starts. Rotated files past `backups` are dropped, oldest first,
    unless they were last written less than keep_s ago (then kept, up to MAX_FILES). A line is never split, so a
    single line longer than max_bytes makes a file of its own."""

    def __init__(self, path: str, max_bytes: int, backups: int, keep_s: float = 0.0) -> None:
        self.path, self.max_bytes, self.backups, self.keep_s = path, max_bytes, backups, keep_s
        self._open()

    def _open(self) -> None:
        # 0600: the lines name clients and may hold their prompts; O_CREAT's mode applies only to a new file, so
        # one that was there before (made by hand, or by an older build) is set to it too
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        self.file = os.fdopen(fd, "ab")
        self.size = os.fstat(fd).st_size

    def write(self, line: bytes) -> None:
        if self.size and self.size + len(line) > self.max_bytes:
            self._rotate()
        self.file.write(line)
        self.file.flush()
        self.size += len(line)

    def _rotate(self) -> None:
        self.file.close()
        try:
            kept = self._kept()
            for i in range(kept, 0, -1):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            if kept or self.backups or self._young(self.path):
                os.replace(self.path, f"{self.path}.1")
            else:
                os.remove(self.path)  # no old file kept: start over
        finally:  # a failed rename (permissions changed under us) must not leave the log closed for good
            self._open()

    def _kept(self) -> int:
        """How many rotated files stay before this rotation adds one: the oldest are dropped while the count is
        past `backups` (less one, for the file rotating now) and they are older than keep_s."""
        count = 0
        while os.path.exists(f"{self.path}.{count + 1}"):
            count += 1
        while count and (count >= MAX_FILES or (count >= self.backups and not self._young(f"{self.path}.{count}"))):
            if count >= MAX_FILES:
                log.warning("audit log: %d rotated files; dropping the oldest although younger than %g days",
                            count, self.keep_s / 86400)
            os.remove(f"{self.path}.{count}")
            count -= 1
        return count

    def _young(self, path: str) -> bool:
        return self.keep_s > 0 and time.time() - os.path.getmtime(path) < self.keep_s

    def close(self) -> None:
        self.file.close()


class AuditLog:
    """The observer: appends each RequestRecord as one line. The policy in force says whether the prompt
    text is kept and what each key is called (its rule's id, else the key's hash)."""

    def __init__(self, path: str, max_bytes: int, backups: int, enforcer: PolicyEnforcer,
                 keep_days: float = 0.0) -> None:
        try:
            self.file = RotatingFile(path, max_bytes, backups, keep_days * 86400)
        except OSError as err:  # a missing directory, no permission, a directory at that path
            raise ValueError(f"audit_log {path}: cannot open it for appending: {err.strerror}") from None
        self.enforcer = enforcer

    def __call__(self, record: RequestRecord) -> None:
        policy = self.enforcer.policy
        entry = audit_entry(record, self.enforcer.key_name(record.key_id), policy.audit.log_text)
        self.file.write(audit_line(entry))

    def close(self) -> None:
        self.file.close()


def audit_entry(record: RequestRecord, key_name: str | None, log_text: bool) -> dict:
    text = record.prompt_text
    entry = {
        "time": datetime.fromtimestamp(record.time, UTC).isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "request_id": record.request_id, "key_id": key_name, "class": record.client_class,
        "tenant": _capped(record.tenant), "model": _capped(record.model), "kind": record.kind,
        "route": record.route,
        "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
        "status": record.status, "finish_reason": record.finish_reason, "http_status": record.http_status,
        "degradation": list(record.degradation), "tier": record.tier, "priority": record.priority,
        "client": _capped(record.client), "ttft_s": _seconds(record.ttft_s), "tpot_s": _seconds(record.tpot_s),
        "e2e_s": _seconds(record.e2e_s),
        # surrogatepass: a JSON body may carry a lone surrogate ("\ud800"), which strict UTF-8 cannot encode
        "prompt_sha256": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest() if text else None,
    }
    if log_text:
        entry["prompt_text"] = _capped(text, MAX_TEXT_CHARS)
    return entry


def audit_line(entry: dict) -> bytes:
    """One line whatever the strings hold: ensure_ascii escapes newlines, NULs, U+2028 and lone surrogates,
    so the line is plain ASCII with a single newline, at its end."""
    return (json.dumps(entry, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


def _capped(value: str | None, limit: int = MAX_FIELD_CHARS) -> str | None:
    """A client-chosen string (model, tenant header, kept prompt) cut to `limit` characters, followed by its
    length and the sha256 prefix of the whole: refused requests with megabyte model names must not rotate the
    log's earlier lines (a wrong-key attempt among them) out of reach, and the cut value stays recognizable."""
    if value is None or len(value) <= limit:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{value[:limit]}...({len(value)} chars, sha256:{digest})"


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def quota_state_path(audit_log: str) -> str:
    """Token quota counts are kept next to the audit log, the one place the operator named for the service's
    records; without an audit log they live in memory only (a restart starts them at zero)."""
    return audit_log + ".quotas.json" if audit_log else ""
