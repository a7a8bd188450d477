"""One file of the prompt cache's disk tier: a prompt's KV as llama.cpp exported it, and what it takes to trust it.

Layout (little-endian):
    8 bytes MAGIC, u32 FORMAT_VERSION, u32 header length, header (JSON: EntryFacts, salt, counts),
    n_tokens x i32 token ids, [n_vocab x f32 last logits], payload (llama_state_seq_get_data's bytes, the handoff's
    own encoding: prefill_cpu.kv_state), 32-byte blake2b of everything before it.
An entry is restored only into a context whose EntryFacts are equal (the same GGUF by fingerprint, the same weights
file, the same llama-cpp-python whose state format it is, the same KV type, rotation and V layout), for a request of
the same salt, after its checksum holds and its tokens equal the prompt's prefix. Anything else is EntryRejected:
a miss, never wrong KV. Nothing here depends on n_ctx: llama.cpp restores a sequence into any context with room.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MAGIC = b"EDGEKV\r\n"
FORMAT_VERSION = 1
DIGEST_BYTES = 32
_PREAMBLE = struct.Struct("<8sII")  # magic, format version, header length
MAX_HEADER_BYTES = 1 << 16  # the header holds no token ids: a longer one is not ours
SUFFIX = ".kv"


class EntryRejected(ValueError):
    """The file is not an entry this context may restore (corrupt, truncated, foreign, or another tenant's)."""


@dataclass(frozen=True)
class EntryFacts:
    """What must be equal between the context that wrote an entry and the one that restores it."""
    model_fingerprint: str  # contracts.identity: sha256 of the GGUF
    weights: str  # what llama.cpp loaded: "given" or the converted copy's file name (prefill_cpu.prefill_weights)
    llama_cpp_version: str  # the state format is llama.cpp's, tied to the pinned version
    kv_type: str
    k_rotation: int
    v_rotation: int
    flash_attn: bool  # V is stored transposed without it
    n_layer: int
    n_embd_k: int
    n_embd_v: int
    n_vocab: int


@dataclass(frozen=True)
class EntryHeader:
    facts: EntryFacts
    salt: str
    n_tokens: int
    has_logits: bool
    payload_bytes: int
    # how many of the tokens the last logits follow (0: all): an answer's entry carries its prompt's logits, so the
    # same prompt again is still a whole repeat (absent in files written before it: all)
    logits_len: int = 0

    @property
    def logits_follow(self) -> int:
        """The tokens the stored last logits are those of (0: no logits)."""
        return (self.logits_len or self.n_tokens) if self.has_logits else 0

    def file_bytes(self, header_bytes: int | None = None) -> int:
        """The file's size; header_bytes: the length of its header as read (default: as this one encodes)."""
        header_bytes = len(self.encode()) if header_bytes is None else header_bytes
        logits = 4 * self.facts.n_vocab if self.has_logits else 0
        return _PREAMBLE.size + header_bytes + 4 * self.n_tokens + logits + self.payload_bytes + DIGEST_BYTES

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class KVEntry:
    header: EntryHeader
    tokens: np.ndarray  # [n_tokens] int32
    last_logits: np.ndarray | None  # [n_vocab] float32: the last token's, as the cache kept them
    state: memoryview  # llama_state_seq_get_data's bytes (writable: ctypes reads them in place)


def entry_name(salt: str, tokens: np.ndarray) -> str:
    """The file name of a salt's prompt: the same prompt of the same salt is one file; the name tells nothing of
    either."""
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass") + b"\0", digest_size=16)
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return digest.hexdigest() + SUFFIX


def write_entry(path: Path, header: EntryHeader, tokens: np.ndarray, last_logits: np.ndarray | None,
                state: bytes) -> int:
    """Write the entry whole to a partial file (mode 0600), then move it to path; returns its bytes."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in _chunks(header, tokens, last_logits, state):
                digest.update(chunk)
                out.write(chunk)
            out.write(digest.digest())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return header.file_bytes()


def _chunks(header: EntryHeader, tokens: np.ndarray, last_logits: np.ndarray | None,
            state: bytes) -> Iterator[bytes | memoryview]:
    encoded = header.encode()
    yield _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(encoded)) + encoded
    yield np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    if header.has_logits:
        yield np.ascontiguousarray(last_logits, dtype="<f4").tobytes()
    yield memoryview(state)


def read_header(path: Path) -> tuple[EntryHeader, np.ndarray]:
    """The header and token ids, not the KV: what the index needs at start. The file's size is checked against
    the header (a truncated file is rejected here), its checksum only when it is restored."""
    with open(path, "rb") as src:
        header, length = _parse_header(src.read(_PREAMBLE.size), src)
        tokens = np.frombuffer(src.read(4 * header.n_tokens), dtype="<i4")
        size = os.fstat(src.fileno()).st_size
    if len(tokens) != header.n_tokens or size != header.file_bytes(length):
        raise EntryRejected(f"{size} bytes, its header says {header.file_bytes(length)}: truncated or overwritten")
    return header, tokens


def read_entry(path: Path, facts: EntryFacts, salt: str, prefix: np.ndarray) -> KVEntry:
    """The whole entry, once its checksum holds, its facts are this context's, its salt the request's and its first
    len(prefix) token ids the prompt's, byte for byte; else EntryRejected."""
    with open(path, "rb") as src:
        data = bytearray(os.fstat(src.fileno()).st_size)  # read into, not copied: the KV is most of it
        if src.readinto(data) != len(data) or len(data) < _PREAMBLE.size + DIGEST_BYTES:
            raise EntryRejected("shorter than its own size: truncated while read")
    view = memoryview(data)
    if hashlib.blake2b(view[:-DIGEST_BYTES], digest_size=DIGEST_BYTES).digest() != view[-DIGEST_BYTES:]:
        raise EntryRejected("checksum mismatch: the file is corrupt or truncated")
    header, length = _parse_header(bytes(view[:_PREAMBLE.size]), _BytesAt(view, _PREAMBLE.size))
    check_header(header, facts, salt)
    if len(data) != header.file_bytes(length):
        raise EntryRejected(f"{len(data)} bytes, its header says {header.file_bytes(length)}")
    at = _PREAMBLE.size + length
    tokens = np.frombuffer(data, dtype="<i4", count=header.n_tokens, offset=at)
    at += 4 * header.n_tokens
    if len(prefix) > len(tokens) or not np.array_equal(tokens[:len(prefix)], prefix):
        raise EntryRejected("its token ids are not the prompt's prefix")
    logits = None
    if header.has_logits:
        logits = np.frombuffer(data, dtype="<f4", count=facts.n_vocab, offset=at).astype(np.float32)
        at += 4 * facts.n_vocab
    return KVEntry(header, tokens.astype(np.int32), logits, view[at:-DIGEST_BYTES])


def check_header(header: EntryHeader, facts: EntryFacts, salt: str | None = None) -> None:
    """EntryRejected unless the entry was written by a context like this one (and, given a salt, for that salt)."""
    if header.facts != facts:
        theirs, ours = asdict(header.facts), asdict(facts)
        differ = ", ".join(f"{k} {theirs[k]!r} (here {ours[k]!r})" for k in ours if theirs[k] != ours[k])
        raise EntryRejected(f"written by another context: {differ}")
    if salt is not None and header.salt != salt:
        raise EntryRejected("another cache salt's (tenant's) entry")


def _parse_header(preamble: bytes, src) -> tuple[EntryHeader, int]:
    """The header and its length in bytes."""
    if len(preamble) != _PREAMBLE.size:
        raise EntryRejected("shorter than an entry's preamble")
    magic, version, length = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise EntryRejected("not a KV entry (bad magic)")
    if version != FORMAT_VERSION:
        raise EntryRejected(f"format version {version}, this worker reads {FORMAT_VERSION}")
    if length > MAX_HEADER_BYTES:
        raise EntryRejected(f"implausible header of {length} bytes")
    try:
        raw = json.loads(src.read(length))
        header = EntryHeader(**{**raw, "facts": EntryFacts(**raw["facts"])})
    except (ValueError, TypeError, KeyError) as err:
        raise EntryRejected(f"unreadable header: {err}") from None
    if not (isinstance(header.n_tokens, int) and header.n_tokens > 0 and isinstance(header.payload_bytes, int)
            and header.payload_bytes > 0 and isinstance(header.salt, str) and isinstance(header.logits_len, int)
            and 0 <= header.logits_len <= header.n_tokens):
        raise EntryRejected("implausible header counts")
    return header, length


class _BytesAt:
    """A file-like read() over bytes already in memory."""

    def __init__(self, data: bytes | memoryview, at: int) -> None:
        self.data, self.at = data, at

    def read(self, n: int) -> bytes:
        out = bytes(self.data[self.at:self.at + n])
        self.at += n
        return out
