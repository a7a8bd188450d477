"""The serving model over the GGUF's own blocks (weight_dtype = "gguf"): no conversion, no quantization, no copy of a
matrix (gguf_layers.py says why).

What the native forward needs besides the matrices is small: the family's config, the norms (and Qwen2's biases),
and for each matrix its name in the model and the order of its output rows. These come from transformers' GGUF
loader (the converter's config, name map and tensor processors, gguf_convert.py), once per file: they are written
to a layout folder beside the converted weights (config.json, small.safetensors, layout.json: kilobytes to a few
megabytes), so a later start reads that and maps the file (seconds at any model size, no transformers modeling code
in the engine process). A first start reads the GGUF's metadata and tensors' headers, dequantizes only the 1-D
tensors, and runs each matrix's processor on a probe of its row indices to learn the row order (a LLaMA q/k's
un-permutation) without dequantizing the matrix itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from contracts.cache import converted_dir
from contracts.identity import GGUFIdentity
from decode_gpu.model.family_config import apply_rope_freqs
from decode_gpu.model.gguf_layers import GGUFEmbedding, GGUFLinear, MappedGGUF, check_type

log = logging.getLogger(__name__)
LAYOUT_VERSION = 1
LAYOUT_NAME = "gguf-layout"


def layout_dir(identity: GGUFIdentity, cache_dir: Path | None = None) -> Path:
    return converted_dir(identity, cache_dir) / f"{LAYOUT_NAME}-v{LAYOUT_VERSION}"


def load_gguf_model(identity: GGUFIdentity, dtype: torch.dtype, cache_dir: Path | None = None,
                    repack: bool = False) -> nn.Module:
    """The serving model whose linear layers and embedding are the GGUF's mapped blocks (on the CPU). repack: each
    matrix llama.cpp has a repacked layout for is repacked into memory of the engine's own (ggml_linear.repack)."""
    from transformers import AutoConfig, GenerationConfig

    from decode_gpu.model.serving_model import serving_model_skeleton
    folder = layout_dir(identity, cache_dir)
    if not (folder / "layout.json").exists():
        _write_layout(identity, folder)
    started = time.perf_counter()
    config = AutoConfig.from_pretrained(folder)
    config.dtype = dtype
    layout = json.loads((folder / "layout.json").read_text())
    small = _small_tensors(folder, dtype)
    matrices = {name: torch.empty(entry["shape"], dtype=dtype, device="meta")
                for name, entry in layout["matrices"].items()}
    model = serving_model_skeleton(config, GenerationConfig.from_model_config(config), {**small, **matrices})
    mapped = MappedGGUF(identity.path)
    orders = [torch.tensor(order, dtype=torch.long) for order in layout["orders"]]
    # ggml logs a line per repacked matrix through llama-cpp-python's logger, which prints all it gets until a
    # Llama is built quiet (none is in the engine): kept to warnings while the matrices are placed
    quiet = logging.getLogger("llama-cpp-python")
    level = quiet.level
    quiet.setLevel(max(level, logging.WARNING))
    try:
        _place_matrices(model, mapped, layout["matrices"], orders, dtype, repack)
    finally:
        quiet.setLevel(level)
    model.to("cpu")  # the rotary's buffers; the mapped blocks are on the CPU already
    apply_rope_freqs(model)
    log.info("decode model %s: the GGUF's own blocks, mapped (%.2f GiB of the file, shared with the workers' "
             "mapping), norms %.1f MiB, in %.1f s", os.path.basename(identity.path),
             sum(mapped.tensors[e["gguf"]].n_bytes for e in layout["matrices"].values()) / 2**30,
             sum(t.numel() * t.element_size() for t in small.values()) / 2**20, time.perf_counter() - started)
    if repack:
        layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        log.info("decode model %s: %d of its %d matrices repacked by llama.cpp's CPU repack into %.2f GiB of the "
                 "engine's own (the others multiplied as mapped)", os.path.basename(identity.path),
                 sum(m.repacked is not None for m in layers), len(layers), repacked_bytes(model) / 2**30)
    return model


def repacked_bytes(model: nn.Module) -> int:
    """The bytes of the model's repacked matrices: memory of the engine's own, beside the mapped file's pages."""
    return sum(m.repacked.nbytes for m in model.modules() if isinstance(m, GGUFLinear) and m.repacked is not None)


def _small_tensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    path = folder / "small.safetensors"
    return {name: t.to(dtype) for name, t in load_file(path).items()} if path.exists() else {}


def _place_matrices(model: nn.Module, mapped: MappedGGUF, matrices: dict[str, dict], orders: list[torch.Tensor],
                    dtype: torch.dtype, repack: bool = False) -> None:
    """Every meta matrix of the skeleton replaced by its GGUF layer (the tied head too: the embedding's blocks)."""
    embedding_entry = matrices.get("model.embed_tokens.weight")
    for module_name, module in list(model.named_modules()):
        if isinstance(module, nn.Embedding):
            entry = matrices[f"{module_name}.weight"]
            dim, vocab = mapped.shape(entry["gguf"])
            table = GGUFEmbedding(mapped.blocks(entry["gguf"]), check_type(mapped, entry["gguf"]), dim, vocab, dtype)
            _replace(model, module_name, table)
        elif isinstance(module, nn.Linear):
            entry = matrices.get(f"{module_name}.weight") or (embedding_entry if module_name == "lm_head" else None)
            if entry is None:
                raise ValueError(f"{mapped.path}: no GGUF tensor for {module_name}")
            in_features, out_features = mapped.shape(entry["gguf"])
            order = None if entry["order"] is None else orders[entry["order"]]
            layer = GGUFLinear(mapped.blocks(entry["gguf"]), check_type(mapped, entry["gguf"]), in_features,
                               out_features, module.bias, dtype, order, repack)
            _replace(model, module_name, layer)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def _write_layout(identity: GGUFIdentity, target: Path) -> None:
    """The layout folder (module docstring), written whole to a partial folder and renamed into place."""
    from decode_gpu.model.gguf_convert import layout_of
    started = time.perf_counter()
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        config, small, matrices = layout_of(identity.path)
        config.save_pretrained(partial)
        orders: list[list[int]] = []
        entries = {}
        for name, (gguf_name, shape, order) in matrices.items():
            index = None
            if order is not None:
                if order not in orders:
                    orders.append(order)
                index = orders.index(order)
            entries[name] = {"gguf": gguf_name, "shape": list(shape), "order": index}
        if small:
            from safetensors.torch import save_file
            save_file({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in small.items()},
                      partial / "small.safetensors")
        (partial / "layout.json").write_text(json.dumps({"version": LAYOUT_VERSION, "matrices": entries,
                                                         "orders": orders}))
        try:
            os.replace(partial, target)
        except OSError:
            if not (target / "layout.json").exists():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another process wrote it first
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("the GGUF's layout for its own blocks written once in %.1f s (%s)", time.perf_counter() - started,
             target)
