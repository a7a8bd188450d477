"""What transformers' GGUF loader leaves out of a model family's config, read from the GGUF as llama.cpp reads it.

transformers maps only some GGUF keys to its config and falls back to its own defaults for the rest; llama.cpp
computes with the GGUF's values. Where the two differ the decode model would attend differently from the prefill
that made its KV, so every knob llama.cpp reads is set here from the same metadata (llama.cpp's
src/models/<family>.cpp `load_arch_hparams` is the reference for each default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch

if TYPE_CHECKING:  # transformers' modeling code stays out of the engine process (model/serving_model.py)
    from transformers import PretrainedConfig, PreTrainedModel

from contracts.identity import DEFAULT_WINDOWS, metadata, sliding_layers

ROPE_FREQS_KEY = "edge_rope_freqs"  # config.json field: the GGUF's rope_freqs (Llama 3.x), see apply_rope_freqs
_LARGE_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models, whose query scale llama.cpp takes from n_embd


def complete_config(config: PretrainedConfig, gguf_path: str) -> None:
    """Set, in place, every attention and RoPE setting of the family that the GGUF states or llama.cpp assumes."""
    reader = gguf.GGUFReader(gguf_path)
    arch = metadata(reader, "general.architecture")
    meta = _Metadata(reader, arch)
    n_embd, n_head = meta.get("embedding_length"), meta.get("attention.head_count")
    config.head_dim = meta.get("attention.key_length", n_embd // n_head)
    _rope_scaling(config, meta)
    if arch == "phi3":
        config.rope_parameters["partial_rotary_factor"] = meta.get("rope.dimension_count") / config.head_dim
        config.pad_token_id = meta.get_any("tokenizer.ggml.padding_token_id")  # Phi-3's default 32000 may not exist
    if arch in _LARGE_GEMMA_LAYERS:
        _gemma(config, meta, arch, n_embd, n_head)
    freqs = _tensor(reader, "rope_freqs.weight")
    if freqs is not None:
        setattr(config, ROPE_FREQS_KEY, [float(x) for x in freqs])


def apply_rope_freqs(model: PreTrainedModel) -> None:
    """Llama 3.x GGUFs carry their RoPE scaling as a tensor of per-frequency divisors, which llama.cpp applies
    and transformers' loader drops; divide the model's own RoPE frequencies by them (exact for any scaling)."""
    freqs = getattr(model.config, ROPE_FREQS_KEY, None)
    if freqs is None:
        return
    rotary = model.model.rotary_emb
    divisor = torch.tensor(freqs, dtype=rotary.inv_freq.dtype, device=rotary.inv_freq.device)  # [head_dim / 2]
    rotary.inv_freq = rotary.inv_freq / divisor
    rotary.original_inv_freq = rotary.inv_freq


def _rope_scaling(config: PretrainedConfig, meta: _Metadata) -> None:
    """Linear RoPE scaling (`rope.scaling.type = linear`); other types are refused by contracts.identity."""
    if meta.get("rope.scaling.type", "none") != "linear":
        return
    factor = meta.get("rope.scaling.factor")
    if meta.arch == "gemma3":  # llama.cpp scales only the global layers' RoPE, as transformers does
        config.rope_parameters["full_attention"].update(rope_type="linear", factor=factor)
    else:
        config.rope_parameters.update(rope_type="linear", factor=factor)


def _gemma(config: PretrainedConfig, meta: _Metadata, arch: str, n_embd: int, n_head: int) -> None:
    large = meta.get("block_count") == _LARGE_GEMMA_LAYERS[arch]
    config.query_pre_attn_scalar = n_embd // n_head if large else config.head_dim
    config.sliding_window = meta.get("attention.sliding_window", DEFAULT_WINDOWS.get(arch))
    config.final_logit_softcapping = meta.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)
    config.attn_logit_softcapping = meta.get("attn_logit_softcapping", 50.0) if arch == "gemma2" else None
    n_layer = meta.get("block_count")
    config.layer_types = [("sliding_attention" if swa else "full_attention")
                          for swa in sliding_layers(meta.reader, arch, n_layer)]
    if arch == "gemma3":
        local_base = meta.get("rope.freq_base_swa", 10000.0)
        config.rope_parameters["sliding_attention"]["rope_theta"] = local_base
        config.rope_parameters["full_attention"]["rope_theta"] = meta.get("rope.freq_base", 1000000.0)


class _Metadata:
    """`{arch}.`-prefixed GGUF keys with defaults."""

    def __init__(self, reader: gguf.GGUFReader, arch: str):
        self.reader, self.arch = reader, arch

    def get(self, key: str, default=None):
        return metadata(self.reader, f"{self.arch}.{key}", default)

    def get_any(self, key: str, default=None):
        return metadata(self.reader, key, default)


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray | None:
    for tensor in reader.tensors:
        if tensor.name == name:
            return np.asarray(tensor.data, dtype=np.float32)
    return None
