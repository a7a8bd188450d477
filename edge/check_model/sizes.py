"""What a GGUF takes on the decode device, by weight_dtype and KV storage: the numbers `edge check-model` reports.

The engine's own code sizes them (its quantizer on the meta device, its pool's bytes per token, its KV budget), so
they are what the engine holds, without loading or converting a weight.
"""

from __future__ import annotations

import copy
import logging

from contracts.identity import GGUFIdentity
from contracts.kv_dtypes import KV_DTYPES
from contracts.options import AUTO, KNOBS

log = logging.getLogger("edge.check_model.command")
# every one the engine takes and holds a copy in, sized (gguf holds none: the file's mapped pages, its file size)
WEIGHT_DTYPES = KNOBS["weight_dtype"].allowed(exclude=(AUTO, "gguf"))
QUANTIZED_ACTIVATIONS = "bfloat16"  # int8/int4 layers' scales and activations: the engine's dtype on CUDA


def decode_weight_bytes(skeleton, head_int8: bool) -> dict[str, int | None]:
    """Bytes the decode model holds for each weight_dtype (None: this model cannot be held so), from `skeleton`, the
    float32 model on the meta device (no memory, no conversion). head_int8: int4's lm_head follows the GGUF's."""
    held: dict[str, int | None] = {}
    for weight_dtype in WEIGHT_DTYPES:
        try:
            held[weight_dtype] = _held_bytes(skeleton, weight_dtype, head_int8)
        except ValueError as err:  # int4 and q8_0 need layer inputs divisible by their block
            log.warning("%s weights: %s", weight_dtype, err)
            held[weight_dtype] = None
    return held


def _held_bytes(skeleton, weight_dtype: str, head_int8: bool) -> int:
    from decode_gpu.model.weight_quant import weight_bytes
    if weight_dtype == "q8_0":  # ggml's quantizer needs real weights, which the meta model has not
        return _q8_0_bytes(_held_model(skeleton, "int8", head_int8))
    return sum(weight_bytes(_held_model(skeleton, weight_dtype, head_int8)).values())


def _held_model(skeleton, weight_dtype: str, head_int8: bool):
    """The decode model on the meta device as the engine holds it with `weight_dtype` (its quantize_model)."""
    import torch

    from decode_gpu.model.weight_quant import FLOAT_WEIGHTS, quantize_model
    dtype = FLOAT_WEIGHTS.get(weight_dtype, FLOAT_WEIGHTS[QUANTIZED_ACTIVATIONS])
    model = copy.deepcopy(skeleton).to(dtype)
    if weight_dtype in ("int8", "int4"):
        quantize_model(model, weight_dtype, torch.device("meta"), dtype, head_int8=head_int8)
    return model


def _q8_0_bytes(int8_model) -> int:
    """q8_0 holds every linear layer in ggml's Q8_0 blocks (34 bytes a 32 weights: the KV's q8_0 block) and the input
    embedding int8, the rest as int8 does: the int8 model's bytes with its layers' rows swapped for blocks. A tied
    head's int8 rows stay, as the embedding's own."""
    from decode_gpu.model.weight_quant import weight_bytes
    total = sum(weight_bytes(int8_model).values())
    embedding_rows = int8_model.get_input_embeddings().qweight
    for layer in int8_model.modules():
        if getattr(layer, "held_as", None) == "int8":
            total += layer.out_features * KV_DTYPES["q8_0"].row_bytes(layer.in_features)  # ValueError: partial block
            if layer.qweight is not embedding_rows:
                total -= layer.qweight.numel() + layer.scales.numel() * layer.scales.element_size()
    return total


def handoff_kv_bytes(identity: GGUFIdentity) -> dict[str, int | None]:
    """Per token on the wire: a K row of n_embd_k and a V row of n_embd_v elements per layer, in ggml blocks."""
    sizes: dict[str, int | None] = {}
    for name, kv in KV_DTYPES.items():
        try:
            sizes[name] = identity.n_layer * (kv.row_bytes(identity.n_embd_k) + kv.row_bytes(identity.n_embd_v))
        except ValueError:
            sizes[name] = None
    return sizes


def pool_kv_bytes(identity: GGUFIdentity) -> dict[str, int]:
    from decode_gpu.kv.pool import STORAGE_DTYPES, bytes_per_token, storage_fits
    return {storage: bytes_per_token(identity.n_layer, identity.num_kv_heads, identity.head_dim_k, storage)
            for storage in STORAGE_DTYPES if storage_fits(storage, identity.head_dim_k)}


def pool_tokens(memory: int, utilization: float, weights: int, per_token: int) -> int:
    """The engine's own sizing (kv_sizing.kv_budget_bytes) with nothing but the weights measured: activations and
    the CUDA context come off at start, so this is an upper bound."""
    from decode_gpu.runner.kv_sizing import MemoryProfile, kv_budget_bytes
    profile = MemoryProfile(total=memory, free=memory - weights, torch_allocated=weights, torch_reserved=weights,
                            peak_activation=0)
    try:
        return kv_budget_bytes(profile, utilization, per_token) // per_token
    except ValueError:  # no room left for even one token
        return 0
