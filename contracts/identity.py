"""What both sides must agree on about a GGUF: its fingerprint and its attention shape.

Read from GGUF metadata with contracts.gguf_header (no llama.cpp, no torch), so the prefill worker and
the decode engine compute the same identity for the same file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass

import gguf

from contracts.gguf_check import check_gguf
from contracts.gguf_header import GGUFHeader, read_header

# How llama.cpp stores K heads relative to the Hugging Face layout, per architecture.
# LLaMA GGUFs have q/k rows permuted by the converter (interleaved RoPE); NEOX families are not.
ROPE_LAYOUTS = {"llama": "interleaved", "qwen2": "neox", "qwen3": "neox", "phi3": "neox", "gemma2": "neox",
                "gemma3": "neox"}
# Families with sliding-window layers: llama.cpp's default window and layer pattern when the GGUF states none
# (src/models/gemma2.cpp, gemma3.cpp). Gemma 3 without a window key has no sliding layers at all.
DEFAULT_WINDOWS = {"gemma2": 4096}
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6}


class UnsupportedModelError(ValueError):
    """The GGUF is of a family whose KV layout the handoff does not know."""


@dataclass(frozen=True)
class GGUFIdentity:
    path: str
    fingerprint: str  # "sha256:<hex>" of the whole file
    arch: str  # general.architecture
    n_layer: int
    n_head: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    rope_layout: str  # "interleaved" or "neox"
    sliding_window: int = 0  # keys a sliding-window layer attends to, the query's own included; 0: no such layer
    swa_layers: tuple[int, ...] = ()  # the sliding-window layers (Gemma 2/3); every other layer is global

    @property
    def n_embd_k(self) -> int:
        return self.num_kv_heads * self.head_dim_k

    @property
    def n_embd_v(self) -> int:
        return self.num_kv_heads * self.head_dim_v


def read_gguf_identity(path: str) -> GGUFIdentity:
    stat = os.stat(path)
    return _read_identity(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def check_supported(path: str) -> None:
    """Raise UnsupportedModelError (or FileNotFoundError) if the handoff cannot carry this GGUF's KV, GGUFError if
    the file is corrupt or hostile (contracts.gguf_check): what `edge serve` refuses at start and `edge check-model`
    reports. Reads metadata only; no fingerprint of the file."""
    _read_shape(check_gguf(path), path)


@functools.lru_cache(maxsize=16)
def _read_identity(path: str, size: int, mtime_ns: int) -> GGUFIdentity:
    shape = _read_shape(read_header(path), path)
    return GGUFIdentity(path=path, fingerprint=file_fingerprint(path), **shape)


def _read_shape(reader: GGUFHeader, path: str) -> dict:
    arch = _field(reader, "general.architecture", path)
    if arch not in ROPE_LAYOUTS:
        raise UnsupportedModelError(f"{path}: architecture {arch!r} is not supported; "
                                    f"supported: {sorted(ROPE_LAYOUTS)}")
    n_layer = _count(reader, f"{arch}.block_count", path)
    n_head = _count(reader, f"{arch}.attention.head_count", path)
    n_embd = _count(reader, f"{arch}.embedding_length", path)
    head_dim_k = _count(reader, f"{arch}.attention.key_length", path, default=n_embd // n_head)
    _check_features(reader, path, arch)
    num_kv_heads = _count(reader, f"{arch}.attention.head_count_kv", path, default=n_head)
    if n_head % num_kv_heads:
        raise UnsupportedModelError(f"{path}: {n_head} attention heads cannot share {num_kv_heads} KV heads evenly; "
                                    "the GGUF's metadata is wrong")
    head_dim_v = _count(reader, f"{arch}.attention.value_length", path, default=head_dim_k)
    _check_attention_shapes(reader, path, n_layer, {"attn_q": ("heads", n_head, head_dim_k),
                                                    "attn_k": ("KV heads", num_kv_heads, head_dim_k),
                                                    "attn_v": ("KV heads", num_kv_heads, head_dim_v)})
    return dict(
        arch=arch,
        n_layer=n_layer,
        n_head=n_head,
        num_kv_heads=num_kv_heads,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        rope_layout=ROPE_LAYOUTS[arch],
        sliding_window=_count(reader, f"{arch}.attention.sliding_window", path, DEFAULT_WINDOWS.get(arch, 0), 0),
        swa_layers=tuple(il for il, swa in enumerate(sliding_layers(reader, arch, n_layer)) if swa),
    )


def sliding_layers(reader: GGUFHeader | gguf.GGUFReader, arch: str, n_layer: int) -> list[bool]:
    """Which layers attend through a sliding window, as llama.cpp decides: an explicit per-layer array, or a
    pattern n where every n-th layer is global (Gemma 2: 2, Gemma 3: 6). All False for a family without SWA."""
    default_pattern = SWA_PATTERNS.get(arch)
    if default_pattern is None or metadata(reader, f"{arch}.attention.sliding_window") == 0:
        return [False] * n_layer
    pattern = metadata(reader, f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        return [bool(x) for x in pattern]
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise UnsupportedModelError(f"{arch}.attention.sliding_window_pattern is {pattern!r}, not a layer pattern")
    return [pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer)]


def _check_features(reader: GGUFHeader, path: str, arch: str) -> None:
    """Refuse, by name, what a supported family may use but the handoff or the decode model cannot follow."""
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"{path}: {arch} with RoPE scaling {scaling!r} is not supported "
                                    "(supported: none, linear, and Llama 3's rope_freqs)")
    names = {tensor.name for tensor in reader.tensors}
    if "rope_factors_long.weight" in names:
        raise UnsupportedModelError(f"{path}: {arch} with LongRoPE factors (rope_factors_long/short, the 128k-context "
                                    "variants) is not supported")
    key_length, value_length = (metadata(reader, f"{arch}.attention.{k}_length") for k in ("key", "value"))
    if key_length is not None and value_length is not None and key_length != value_length:
        raise UnsupportedModelError(f"{path}: {arch} with K head size {key_length} and V head size "
                                    f"{value_length} is not supported (the KV pool needs them equal)")


def _check_attention_shapes(reader: GGUFHeader, path: str, n_layer: int, expected: dict) -> None:
    """The metadata's head counts against the attention tensors themselves: a wrong head count would otherwise
    surface as a shape error deep in llama.cpp or torch, or not at all. GGUF shapes are ggml's: [inputs, outputs].
    A fused qkv tensor (Phi-3) has no attn_q and is not checked here."""
    shapes = {tensor.name: [int(n) for n in tensor.shape] for tensor in reader.tensors}
    for layer in range(n_layer):
        for name, (what, count, size) in expected.items():
            shape = shapes.get(f"blk.{layer}.{name}.weight")
            if shape is not None and shape[-1] != count * size:
                raise UnsupportedModelError(
                    f"{path}: blk.{layer}.{name} has {shape[-1]} outputs, but the metadata's {count} {what} of size "
                    f"{size} make {count * size}: the GGUF's head count is wrong")


_MISSING = object()


def metadata(reader: GGUFHeader | gguf.GGUFReader, key: str, default=None):
    """A GGUF metadata value, or `default` when the file has no such key."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _field(reader: GGUFHeader, key: str, path: str, default=_MISSING):
    value = metadata(reader, key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise UnsupportedModelError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    return value


def _count(reader: GGUFHeader, key: str, path: str, default=_MISSING, least: int = 1) -> int:
    """An integer of at least `least` the shape needs; a per-layer array (a head count that differs by layer) is not
    one the handoff's fixed layout can carry."""
    value = _field(reader, key, path, default)
    if isinstance(value, list):
        raise UnsupportedModelError(f"{path}: {key} differs by layer ({len(value)} values); the handoff carries one "
                                    "attention shape for every layer")
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise UnsupportedModelError(f"{path}: {key} is {value!r}, not an integer of at least {least}")
    return value


def file_fingerprint(path: str, chunk_bytes: int = 1 << 22) -> str:
    """sha256 of the whole file, kept on disk by the file's path, size, mtime, inode and device (the in-process
    cache's key, and more) so that each process of each start does not read the file again: the 8B ladder's 4.9 GB
    took about 50 s a process on a loaded 2-core box, in the engine and the worker at once, most of a cached start.
    A file rewritten in place changes its mtime, so its record no longer matches and it is read again."""
    stat = os.stat(path)
    key = [os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev]
    record = _fingerprint_record(key[0])
    try:
        saved = json.loads(record.read_text())
        if saved.get("key") == key and str(saved.get("fingerprint", "")).startswith("sha256:"):
            return saved["fingerprint"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    fingerprint = "sha256:" + digest.hexdigest()
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps({"key": key, "fingerprint": fingerprint}))
        os.replace(partial, record)
    except OSError:
        pass  # a read-only cache: the next process reads the file again
    return fingerprint


def _fingerprint_record(realpath: str):
    from contracts.cache import cache_root  # cache imports this module
    return cache_root() / "fingerprints" / (hashlib.sha256(realpath.encode()).hexdigest()[:32] + ".json")
