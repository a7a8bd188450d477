"""Whether a GGUF may be handed to llama.cpp and transformers at all: the check `edge serve` and `edge check-model`
run before anything else reads the file (docs/security.md, "Model files").

contracts.gguf_header has already held the file's structure to bounds (counts, lengths, types, dimensions, the
tensors' places in the file). Here the model's own numbers: its layer count, heads, embedding length, context length
and vocabulary against bounds far above any real model's, and against the tensors actually present. A header that
claims 100,000 layers would otherwise have transformers build 100,000 layers (minutes, gigabytes) and llama.cpp abort
on the first missing one. Pure Python, the header only: milliseconds and memory in proportion to the tensor count.
"""

from __future__ import annotations

import os
import re

from contracts.gguf_header import MAX_ARRAY_ITEMS, GGUFError, GGUFHeader, read_header

# {arch}.<key> -> (least, most). The largest real models: 126 layers, 128 heads, 16384 wide, 10M-token contexts,
# 262k-token vocabularies. A 0 in a per-layer array is a layer without that part (no attention, no MLP).
HPARAM_BOUNDS = {
    "block_count": (1, 1024),
    "context_length": (1, 1 << 24),
    "embedding_length": (1, 1 << 16),
    "feed_forward_length": (1, 1 << 20),
    "attention.head_count": (1, 1024),
    "attention.head_count_kv": (1, 1024),
    "attention.key_length": (1, 1 << 12),
    "attention.value_length": (1, 1 << 12),
    "rope.dimension_count": (1, 1 << 12),
    "vocab_size": (1, MAX_ARRAY_ITEMS),
}
PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")  # a value, or one a layer
_LAYER = re.compile(r"(?:^|\.)blk\.(\d+)\.")  # blk.N.* (an encoder's enc.blk.N.* too)


def check_gguf(path: str) -> GGUFHeader:
    """The file's header, if it is a GGUF whose structure and numbers are within bounds and agree with its tensors;
    else GGUFError naming the field, its value and the bound (FileNotFoundError when there is no file)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        header = read_header(path)
    except OSError as err:  # unreadable: permissions, an I/O error
        raise GGUFError(path, f"cannot be read ({err.strerror or err})") from None
    arch = header.fields["general.architecture"].value if "general.architecture" in header.fields else None
    if arch is None:
        return header  # contracts.identity names the missing key; nothing below can be checked without it
    if not isinstance(arch, str):
        raise GGUFError(path, f"general.architecture is {arch!r}, not a string")
    n_layer = _hparams(header, arch)
    if n_layer is not None:
        _check_layers(header, arch, n_layer)
    _check_vocabulary(header, arch)
    return header


def _hparams(header: GGUFHeader, arch: str) -> int | None:
    """Every bounded number the file states, checked; its layer count (None when it states none)."""
    n_layer = _number(header, f"{arch}.block_count", *HPARAM_BOUNDS["block_count"])
    for key, (least, most) in HPARAM_BOUNDS.items():
        name = f"{arch}.{key}"
        field = header.get_field(name)
        if field is None or key == "block_count":
            continue
        if key in PER_LAYER and field.num_items is not None:
            _per_layer(header, name, field.contents(), n_layer, most)
        else:
            _number(header, name, least, most)
    return n_layer


def _number(header: GGUFHeader, name: str, least: int, most: int) -> int | None:
    field = header.get_field(name)
    if field is None:
        return None
    value = field.contents()
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(header.path, f"{name} is {_shown(value)}, not an integer")
    if value > most:
        raise GGUFError(header.path, f"{name} is {value}, above the bound {most}")
    if value < least:
        raise GGUFError(header.path, f"{name} is {value}, below the least {least}")
    return value


def _per_layer(header: GGUFHeader, name: str, values: list, n_layer: int | None, most: int) -> None:
    if n_layer is None or len(values) != n_layer:
        raise GGUFError(header.path, f"{name} has {len(values)} values, one a layer, but block_count is {n_layer}")
    for layer, value in enumerate(values):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
            raise GGUFError(header.path, f"{name}[{layer}] is {_shown(value)}, outside 0 to {most}")


def _check_layers(header: GGUFHeader, arch: str, n_layer: int) -> None:
    """block_count against the blk.N tensors: every layer it claims has tensors, and no tensor is of a layer
    beyond it."""
    layers = {int(match[1]) for t in header.tensors if (match := _LAYER.search(t.name))}
    if layers == set(range(n_layer)):
        return
    found = f"for layers {min(layers)} to {max(layers)} ({len(layers)} layers)" if layers else "for no layer"
    raise GGUFError(header.path, f"{arch}.block_count is {n_layer}, but the file's layer tensors (blk.N.*) are "
                                 f"{found}")


def _check_vocabulary(header: GGUFHeader, arch: str) -> None:
    """The token embedding's shape ([embedding length, vocabulary] in ggml's order) against the embedding length
    and the token list: llama.cpp refuses a mismatch only after it has allocated the model."""
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        return
    n_embd = header.get_field(f"{arch}.embedding_length")
    if n_embd is not None and embedding.shape[0] != n_embd.value:
        raise GGUFError(header.path, f"{arch}.embedding_length is {n_embd.value}, but token_embd.weight is "
                                     f"{embedding.shape[0]} wide")
    tokens = header.get_field("tokenizer.ggml.tokens")
    n_tokens = tokens.num_items if tokens is not None else None
    if n_tokens is not None and (len(embedding.shape) < 2 or embedding.shape[1] != n_tokens):
        rows = embedding.shape[1] if len(embedding.shape) > 1 else 1
        raise GGUFError(header.path, f"tokenizer.ggml.tokens has {n_tokens} tokens, but token_embd.weight has "
                                     f"{rows} rows")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
