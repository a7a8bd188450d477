"""What Ollama's /api/tags, /api/ps and /api/show say of a served model, read from its GGUF's header
(contracts.gguf_header: milliseconds, cached per file): its details (family, parameter size, quantization), its
metadata (model_info), its chat template, size, modification time and digest."""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime

from gguf.constants import LlamaFileType

from contracts.gguf_header import read_header

MAX_LISTED_ITEMS = 5  # a longer array (the vocabulary, merges) is shown empty unless `verbose`, as Ollama shows it
HIDDEN_KEYS = ("general.name", "tokenizer.chat_template")  # left out of model_info, as Ollama leaves them out


def display_name(name: str) -> str:
    """A served name as Ollama lists it: with its tag (':latest' when it has none)."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def details(path: str | None) -> dict:
    """Ollama's `details` of the GGUF at path (None: a server that does not know its model file)."""
    if path is None:
        return {"parent_model": "", "format": "gguf", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    header = read_header(path)
    family = _value(header, "general.architecture", "")
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family] if family else None,
            "parameter_size": human_count(sum(t.n_elements for t in header.tensors)),
            "quantization_level": quantization(_value(header, "general.file_type", None))}


def listed(name: str, path: str | None) -> dict:
    """One /api/tags entry."""
    stat = os.stat(path) if path else None
    return {"name": display_name(name), "model": display_name(name),
            "modified_at": rfc3339(stat.st_mtime) if stat else rfc3339(0), "size": stat.st_size if stat else 0,
            "digest": digest(path), "details": details(path)}


def digest(path: str | None) -> str:
    """A SHA-256 of the file's path, size and modification time: it changes when the file does, the same whether the
    model is loaded or not, and costs nothing (hashing a GGUF of gigabytes here would take seconds)."""
    if not path:
        return ""
    stat = os.stat(path)
    return hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()


def show(path: str | None, verbose: bool, capabilities: list[str]) -> dict:
    """/api/show's body (run in a thread: a verbose read decodes the vocabulary's arrays)."""
    if path is None:
        return {"modelfile": "", "parameters": "", "template": "", "details": details(None), "model_info": {},
                "capabilities": capabilities}
    header = read_header(path)
    info = {}
    for key, field in header.fields.items():
        if key in HIDDEN_KEYS:
            continue
        too_long = field.num_items is not None and field.num_items > MAX_LISTED_ITEMS and not verbose
        info[key] = [] if too_long else field.contents()
    name = _value(header, "general.name", os.path.basename(path))
    return {"modelfile": f"# Served by edge serve from its config; models cannot be created here.\nFROM {name}\n",
            "parameters": "", "template": _value(header, "tokenizer.chat_template", ""),
            "license": _text(_value(header, "general.license", "")), "details": details(path), "model_info": info,
            "capabilities": capabilities, "modified_at": rfc3339(os.stat(path).st_mtime)}


def quantization(file_type: int | None) -> str:
    """general.file_type as Ollama names it: Q4_1, Q4_K_M, F16, F32."""
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return "" if file_type is None else str(file_type)


def human_count(count: int) -> str:
    """A parameter count as Ollama writes it: 8.0B, 134.52M."""
    for scale, unit, digits in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 2)):
        if count >= scale:
            return f"{count / scale:.{digits}f}{unit}"
    return str(count)


def rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _value(header, key: str, default):
    field = header.get_field(key)
    return default if field is None else field.contents()


def _text(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)
