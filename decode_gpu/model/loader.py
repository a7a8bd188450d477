"""Load a GGUF's weights into a model, converting once and caching the result: transformers' model, or the serving
model the native forward reads (serving_model.py, no transformers modeling code in the engine process).

Dequantizing a GGUF takes tens of seconds to minutes; the converted weights are saved as safetensors
under a cache folder named by the GGUF's fingerprint and the storage dtype, so later starts take seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from contracts.cache import converted_dir
from contracts.identity import GGUFIdentity
from decode_gpu.model.family_config import apply_rope_freqs

log = logging.getLogger(__name__)


def converted_weights_dir(identity: GGUFIdentity, dtype: torch.dtype, cache_dir: Path | None = None) -> Path:
    """A subfolder per storage dtype: a bfloat16 load reads half the bytes a float32 one does."""
    return converted_dir(identity, cache_dir) / str(dtype).removeprefix("torch.")


def load_decode_model(identity: GGUFIdentity, device: torch.device, dtype: torch.dtype,
                      cache_dir: Path | None = None, serving: bool = False) -> nn.Module:
    """transformers' causal LM, or with `serving` the serving model (the native forward's; the same module names,
    built without importing transformers' modeling code, which costs the process about 165 MB and 1.3-2 s)."""
    weights = converted_weights_dir(identity, dtype, cache_dir)
    if not (weights / "config.json").exists():
        _convert(identity, weights, dtype)
    started = time.perf_counter()
    if serving:
        from decode_gpu.model.serving_model import load_serving_model
        model = load_serving_model(weights, dtype).to(device)
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype).to(device).eval()
    apply_rope_freqs(model)
    log.info("decode model %s loaded on %s as %s in %.1f s%s", os.path.basename(identity.path), device,
             dtype, time.perf_counter() - started, " (serving model)" if serving else "")
    return model


@torch.no_grad()
def own_memory(model: nn.Module) -> int:
    """Copy the tensors the model still holds out of the safetensors files transformers mapped them from; the bytes
    copied. A tensor loaded on the CPU is a view of that mapping, and one live view (a norm's weight) keeps the whole
    mapping, and every page of it read while fusing and quantizing, resident: on the embedded model the whole 538 MB
    float32 file, though the engine then holds 171 MB of q8_0 and int8 weights (docs/decode.md, "Memory"). Called
    once the weight plan is made, so only what it kept is copied."""
    mapped = _mapped_ranges(".safetensors")
    copied = 0
    for tensor in [*model.parameters(), *model.buffers()]:  # a tied weight is one Parameter: copied once
        if tensor.device.type == "cpu" and not tensor.is_mkldnn and any(a <= tensor.data_ptr() < b for a, b in mapped):
            tensor.data = tensor.data.clone()
            copied += tensor.numel() * tensor.element_size()
    return copied


def _mapped_ranges(suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files whose name ends with `suffix` (none off Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(suffix):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def load_tokenizer(identity: GGUFIdentity, cache_dir: Path | None = None):
    """The GGUF's tokenizer as a transformers tokenizer (for detokenizing output), converted once and cached."""
    from transformers import AutoTokenizer
    target = converted_dir(identity, cache_dir) / "tokenizer"
    if not (target / "tokenizer_config.json").exists():
        gguf_path = Path(identity.path)
        log.info("converting the tokenizer of %s once", gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        partial = target.with_name(target.name + f".partial-{os.getpid()}")
        tokenizer.save_pretrained(partial)
        _publish(partial, target, "tokenizer_config.json")
    return AutoTokenizer.from_pretrained(target)


def eos_token_ids(tokenizer, model: nn.Module) -> tuple[int, ...]:
    """The tokens that end an answer: the tokenizer's end-of-sequence and the model's generation config's (an
    engine built without them decodes past the end of every answer until max_tokens)."""
    config_ids = getattr(model.generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(config_ids if isinstance(config_ids, list) else [config_ids])}
    return tuple(sorted(t for t in ids if isinstance(t, int)))


def _convert(identity: GGUFIdentity, target: Path, dtype: torch.dtype) -> None:
    from decode_gpu.model.gguf_convert import convert_gguf  # transformers' GGUF loading: only for a conversion
    log.info("converting %s to %s torch weights once (minutes for a large model); cached in %s",
             identity.path, dtype, target)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)  # left by a crashed run whose pid this one reuses
    try:
        convert_gguf(identity.path, partial, dtype)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # a failed conversion's shards can be gigabytes
        raise
    _publish(partial, target, "config.json")
    _drop_old_layout(target.parent)


def _drop_old_layout(folder: Path) -> None:
    """Before 2026-12-01 the float32 weights lay in the fingerprint's folder itself (a whole model's worth of
    float32: 32 GB for an 8B model); nothing reads them now."""
    old = [folder / "config.json", folder / "generation_config.json", *folder.glob("model*.safetensors*")]
    old = [path for path in old if path.is_file()]
    if old:
        log.info("removing the old converted weights in %s (%.0f MB)", folder,
                 sum(path.stat().st_size for path in old) / 1e6)
        for path in old:
            path.unlink(missing_ok=True)


def _publish(partial: Path, target: Path, marker: str) -> None:
    try:
        os.replace(partial, target)  # atomic: a crash mid-save leaves no half-written cache
    except OSError:
        if not (target / marker).exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)  # another process converted it first
