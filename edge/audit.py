"""The audit log: one JSON line per request, accepted or refused, appended to a file rotated by size
(docs/audit.md).

It is a gateway observer, so it runs on the event loop. Each line is a plain buffered write flushed at
once: a line is a few hundred bytes (a few MiB at most when the policy keeps prompt text), and a write to
the page cache takes microseconds, so a writer thread and its queue would cost more than they save and
could lose lines queued at a crash. No fsync per line: a power loss may cost the last lines."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime

from edge.request_record import RequestRecord
from policies.enforcer import PolicyEnforcer

MAX_FIELD_CHARS = 256  # of a client-chosen string in an entry


class RotatingFile:
    """Appends lines to path. Before a line would take the file past max_bytes, path becomes path.1 (path.1
    becomes path.2, and so on; the oldest beyond `backups` is dropped) and a new file starts. A line is never
    split, so a single line longer than max_bytes makes a file of its own."""

    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._open()

    def _open(self) -> None:
        # 0600: the lines name clients and may hold their prompts
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
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
            if not self.backups:
                os.remove(self.path)  # no old file kept: start over
            for i in range(self.backups - 1, 0, -1):
                if os.path.exists(f"{self.path}.{i}"):
                    os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            if self.backups:
                os.replace(self.path, f"{self.path}.1")
        finally:  # a failed rename (permissions changed under us) must not leave the log closed for good
            self._open()

    def close(self) -> None:
        self.file.close()


class AuditLog:
    """The observer: appends each RequestRecord as one line. The policy in force says whether the prompt
    text is kept and what each key is called (its rule's id, else the key's hash)."""

    def __init__(self, path: str, max_bytes: int, backups: int, enforcer: PolicyEnforcer) -> None:
        try:
            self.file = RotatingFile(path, max_bytes, backups)
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
        entry["prompt_text"] = text
    return entry


def audit_line(entry: dict) -> bytes:
    """One line whatever the strings hold: ensure_ascii escapes newlines, NULs, U+2028 and lone surrogates,
    so the line is plain ASCII with a single newline, at its end."""
    return (json.dumps(entry, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


def _capped(value: str | None) -> str | None:
    """A client-chosen string (model, tenant header) cut to MAX_FIELD_CHARS: refused requests with megabyte
    model names must not rotate the log's earlier lines (a wrong-key attempt among them) out of reach."""
    if value is None or len(value) <= MAX_FIELD_CHARS:
        return value
    return f"{value[:MAX_FIELD_CHARS]}...({len(value)} chars)"


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def quota_state_path(audit_log: str) -> str:
    """Token quota counts are kept next to the audit log, the one place the operator named for the service's
    records; without an audit log they live in memory only (a restart starts them at zero)."""
    return audit_log + ".quotas.json" if audit_log else ""
