"""Convert a GGUF into a transformers checkpoint folder one tensor at a time.

transformers' own GGUF loader dequantizes every tensor into memory before it builds the model, so an 8B
model needs more than 32 GB of RAM. This reads the memory-mapped GGUF, dequantizes one tensor, renames
and un-permutes it with transformers' own name map and tensor processors (so the weights are exactly
what its loader would give), and writes safetensors shards of bounded size: peak RAM is about one
tensor plus one shard.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
    read_field,
)

from decode_gpu.model.family_config import complete_config

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 512 * 2**20
PROGRESS_EVERY_S = 2.0
INDEX_NAME = "model.safetensors.index.json"


def convert_gguf(gguf_path: str | Path, target: Path, dtype: torch.dtype,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write `target`: config.json, `dtype` safetensors shards and their index, loadable by from_pretrained."""
    config_dict = load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"]
    skeleton = _skeleton(config_dict, dtype, str(gguf_path))
    target.mkdir(parents=True)
    skeleton.config.save_pretrained(target)
    arch, tensors = _read_tensors(gguf_path)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config_dict)
    names = get_gguf_hf_weights_map(skeleton, processor)  # GGUF tensor name -> parameter name
    written = _write_tensors(tensors, processor, names, _ShardWriter(target, dtype, shard_bytes))
    missing = set(skeleton.state_dict()) - set(skeleton.all_tied_weights_keys) - written
    if missing:  # from_pretrained would fill them with random values and only warn
        raise ValueError(f"{gguf_path}: no tensor for {sorted(missing)[:5]} ({len(missing)} in all)")


def model_skeleton(gguf_path: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """The decode model of a GGUF on the meta device, configured exactly as the converter configures it: no
    memory, no conversion (edge check-model sizes the weights from it)."""
    config_dict = load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"]
    return _skeleton(config_dict, dtype, str(gguf_path))


def layout_of(gguf_path: str | Path) -> tuple[object, dict[str, np.ndarray], dict[str, tuple]]:
    """What the engine needs to serve a GGUF's own blocks (decode_gpu/model/gguf_weights.py), as this converter
    would name and process them: the config; the 1-D tensors (norms, biases) processed, by parameter name; and each
    matrix as parameter name -> (GGUF name, [out, in], row order or None). A matrix is not dequantized: its
    processor runs on a probe of its row indices, which comes back permuted as the matrix would be (a LLaMA q/k);
    ValueError for a processor that changes a matrix's values otherwise."""
    config_dict = load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"]
    skeleton = _skeleton(config_dict, torch.float32, str(gguf_path))
    arch, tensors = _read_tensors(gguf_path)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config_dict)
    names = get_gguf_hf_weights_map(skeleton, processor)
    small, matrices = {}, {}
    for tensor in tensors:
        matrix = len(tensor.shape) == 2
        rows = int(tensor.shape[1]) if matrix else 0
        probe = np.arange(rows, dtype=np.float64)[:, None]  # [out, 1]: row i holds i
        weights = probe if matrix else gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}})
        if result.name not in names:
            continue
        if not matrix:
            small[names[result.name]] = np.array(result.weights, dtype=np.float32)
            continue
        order = np.asarray(result.weights).reshape(-1)
        if order.shape != (rows,) or not np.array_equal(np.sort(order), probe[:, 0]):
            raise ValueError(f"{gguf_path}: the converter changes {tensor.name}'s values, not only its rows' order: "
                             f"its blocks cannot be served as they lie (weight_dtype gguf)")
        in_place = np.array_equal(order, probe[:, 0])
        matrices[names[result.name]] = (tensor.name, (rows, int(tensor.shape[0])),
                                        None if in_place else order.astype(np.int64).tolist())
    missing = set(skeleton.state_dict()) - set(skeleton.all_tied_weights_keys) - set(small) - set(matrices)
    if missing:
        raise ValueError(f"{gguf_path}: no tensor for {sorted(missing)[:5]} ({len(missing)} in all)")
    return skeleton.config, small, matrices


def _skeleton(config_dict: dict, dtype: torch.dtype, gguf_path: str) -> PreTrainedModel:
    """The model on the meta device: it only lends its config and parameter names."""
    config = AutoConfig.for_model(**config_dict)
    complete_config(config, gguf_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.dtype = dtype  # what a dtype="auto" load of the folder resolves to
    return skeleton


def _read_tensors(gguf_path: str | Path) -> tuple[str, list[ReaderTensor]]:
    """The GGUF's architecture and its memory-mapped tensors, without the reader's parsed metadata, which
    holds numpy views for every vocabulary entry: about 90 MB for a 49K vocabulary."""
    reader = gguf.GGUFReader(gguf_path)
    return read_field(reader, "general.architecture")[0], reader.tensors


def _write_tensors(tensors: list[ReaderTensor], processor: TensorProcessor, names: dict[str, str],
                   writer: _ShardWriter) -> set[str]:
    """Dequantize, process and write each tensor in turn; returns the parameter names written."""
    # Processors that assemble one parameter from several GGUF tensors (MoE experts) collect them here.
    assembled: dict = {"tensors": {}}
    progress = _Progress(len(tensors))
    for tensor in tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [*hf shape] float32
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters=assembled)
        if result.name in names:  # others (rope_freqs, ...) transformers drops too
            # F32 tensors come back as read-only views of the mapped file
            array = result.weights if result.weights.flags.writeable else result.weights.copy()
            writer.add(names[result.name], torch.from_numpy(np.ascontiguousarray(array)))
        progress.step(writer.num_bytes)
    for name, value in assembled["tensors"].items():
        writer.add(name, value)
    writer.close()
    progress.done(writer.num_bytes)
    return set(writer.weight_map)


class _ShardWriter:
    """Casts tensors to the storage dtype and writes them as safetensors shards of at most `shard_bytes`."""

    def __init__(self, folder: Path, dtype: torch.dtype, shard_bytes: int):
        self.folder, self.dtype, self.shard_bytes = folder, dtype, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.num_bytes = 0  # cast bytes taken so far, pending ones included
        self.num_shards = 0
        self.weight_map: dict[str, int] = {}  # parameter name -> shard number

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(self.dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.num_bytes += size

    def close(self) -> None:
        """Flush the last shard, give every shard its final `-of-N` name, and write the index."""
        if self.pending:
            self._flush()
        for shard in range(self.num_shards):
            os.replace(self.folder / self._temp_name(shard), self.folder / self._final_name(shard))
        weight_map = {name: self._final_name(shard) for name, shard in self.weight_map.items()}
        index = {"metadata": {"total_size": self.num_bytes}, "weight_map": weight_map}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))

    def _flush(self) -> None:
        save_file(self.pending, self.folder / self._temp_name(self.num_shards), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, self.num_shards))
        self.num_shards += 1
        self.pending, self.pending_bytes = {}, 0

    def _temp_name(self, shard: int) -> str:  # the shard count is only known at the end
        return f"shard-{shard + 1:05d}.safetensors"

    def _final_name(self, shard: int) -> str:
        return f"model-{shard + 1:05d}-of-{self.num_shards:05d}.safetensors"


class _Progress:
    """Logs tensors done and GB written, at most every PROGRESS_EVERY_S: an 8B model takes minutes."""

    def __init__(self, num_tensors: int):
        self.num_tensors, self.num_done = num_tensors, 0
        self.started = self.logged = time.perf_counter()

    def step(self, num_bytes: int) -> None:
        self.num_done += 1
        if time.perf_counter() - self.logged >= PROGRESS_EVERY_S:
            self.logged = time.perf_counter()
            log.info("converted %d/%d tensors, %.2f GB", self.num_done, self.num_tensors, num_bytes / 1e9)

    def done(self, num_bytes: int) -> None:
        log.info("converted %d/%d tensors, %.2f GB, in %.1f s", self.num_done, self.num_tensors, num_bytes / 1e9,
                 time.perf_counter() - self.started)
