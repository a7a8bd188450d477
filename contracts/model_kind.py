"""Whether a GGUF is a generator or an embedding model, from its metadata alone (contracts.gguf_header; no llama.cpp).

An embedding model (a BERT-family encoder, or any GGUF that declares non-causal attention or a pooling type, as
llama.cpp's converter writes for sentence-embedding and reranker models) is served on its own: the prefill workers
compute its embeddings (or a reranker's scores) and no decode engine is started; its generation routes answer 400.
The gateway, `edge serve`'s checks and the prefill worker all decide by this one function.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from contracts.gguf_header import GGUFHeader, read_header

# llama.cpp's encoder-only architectures (no causal generation): an embedding model whatever else the file says
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert",
                           "neo-bert", "eurobert", "t5encoder", "gemma-embedding"})
# llama.cpp's pooling types (enum llama_pooling_type); none (0) and unspecified (-1) leave a generator a generator
POOLING_NAMES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


@dataclass(frozen=True)
class ModelKind:
    arch: str
    embedding: bool  # served embeddings-only
    pooling: str  # "mean", "cls", "last", "rank" (a reranker), or "" when the GGUF declares none
    reason: str  # why it is an embedding model (for the log and /health), "" for a generator


def model_kind(path: str) -> ModelKind:
    stat = os.stat(path)
    return _model_kind(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _model_kind(path: str, size: int, mtime_ns: int) -> ModelKind:
    reader = read_header(path)
    arch = str(_value(reader, "general.architecture", ""))
    pooling = POOLING_NAMES.get(_int(_value(reader, f"{arch}.pooling_type", 0)), "")
    causal = _value(reader, f"{arch}.attention.causal", True)
    if arch in ENCODER_ARCHS:
        reason = f"architecture {arch} is an encoder"
    elif causal is False:
        reason = f"{arch}.attention.causal is false"
    elif pooling:
        reason = f"{arch}.pooling_type is {pooling}"
    else:
        reason = ""
    return ModelKind(arch, bool(reason), pooling or ("mean" if reason else ""), reason)


def _value(reader: GGUFHeader, key: str, default):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
