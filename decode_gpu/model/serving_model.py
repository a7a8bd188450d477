"""The decode model as the native forward reads it, built from the converted safetensors without transformers'
modeling code.

The native forward (native_decoder.py) reads only the model's weights, its config and a few settings per layer; it
never calls transformers' modules. Building a transformers model to hold those weights cost the engine process
about 165 MB of resident memory and 1.3-2 s of start-up, none of it weights: `transformers.modeling_utils` imports
`torch._dynamo` and torch's distributed tensor ops (docs/decode.md, "Memory"). This module builds the same tree of
modules, under the same names, from the tensors' names in the safetensors files: `*_proj` and `lm_head` become
nn.Linear (a bias where the file has one), `embed_tokens` nn.Embedding, `*norm` an RMSNorm holding its weight and
eps, and each attention and MLP module carries the settings transformers' would (scaling, sliding window,
soft-capping, activation) as transformers' model code sets them for the family. The rotary module computes the
same cos/sin as transformers' (its inverse frequencies from transformers' RoPE functions, which are plain torch).

transformers stays for the config, the generation config, the tokenizer and the transformers forward (kept behind
`forward = "transformers"`, which loads transformers' own model). tests/decode_gpu/test_serving_model.py holds
every family fixture's native forward on this model to the one on transformers' model, logits bit for bit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

GEMMA_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})  # norms of the form x * (1 + weight)
# families whose attention sets its sliding window per layer type (the others read config.sliding_window whole)
LAYER_TYPED_WINDOWS = frozenset({"qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text"})
QUERY_PRE_ATTN_SCALAR = frozenset({"gemma2", "gemma3", "gemma3_text"})  # scaling from query_pre_attn_scalar
SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", *GEMMA_TYPES})
ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU, "gelu": nn.GELU,
               "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh")}


class RMSNorm(nn.Module):
    """An RMSNorm's weight and eps (the native forward applies it); `one_plus_weight`: Gemma's form."""

    def __init__(self, weight: torch.Tensor, eps: float, one_plus_weight: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps
        self.one_plus_weight = one_plus_weight


class Rotary(nn.Module):
    """cos and sin of positions as transformers' rotary modules compute them: one table, or one per layer type
    (Gemma 3: local and global bases), each with its attention scaling."""

    def __init__(self, config) -> None:
        super().__init__()
        rope = config.rope_parameters
        self.by_type = all(isinstance(v, dict) for v in rope.values()) and bool(getattr(config, "layer_types", None))
        self.scaling: dict[str, float] = {}
        for layer_type in sorted(set(config.layer_types)) if self.by_type else [""]:
            params = rope[layer_type] if layer_type else rope
            if params is None:
                continue
            inv_freq, self.scaling[layer_type] = _inverse_frequencies(config, params, layer_type or None)
            self.register_buffer(f"{layer_type}_inv_freq" if layer_type else "inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        key = layer_type if self.by_type else ""
        inv_freq = getattr(self, f"{key}_inv_freq" if key else "inv_freq")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling[key]).to(x.dtype), (emb.sin() * self.scaling[key]).to(x.dtype)


def _inverse_frequencies(config, params: dict, layer_type: str | None) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # plain torch, no modeling code
    if layer_type is None:
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)


class ServingModel(nn.Module):
    """`model.embed_tokens`, `model.layers[i]` (`self_attn`, `mlp`, their norms), `model.norm`, `model.rotary_emb`,
    `lm_head`, `config` and `generation_config`: what the weight plan, the fused projections and the native forward
    read of a causal LM."""

    def __init__(self, config, generation_config) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = nn.Module()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def load_serving_model(weights: Path, dtype: torch.dtype) -> ServingModel:
    """The converted model in `weights` (config.json and safetensors shards) as a ServingModel on the CPU."""
    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig
    config = AutoConfig.from_pretrained(weights)
    config.dtype = dtype
    generation = (GenerationConfig.from_pretrained(weights) if (weights / "generation_config.json").exists()
                  else GenerationConfig.from_model_config(config))
    index = weights / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(weights / name, framework="pt", device="cpu") as shard:
            for key in shard.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                tensors[key] = shard.get_tensor(key).to(dtype)
    return serving_model_from(config, generation, tensors)


def serving_model_from(config, generation_config, tensors: dict[str, torch.Tensor]) -> ServingModel:
    """A ServingModel holding `tensors` as they are (named as in transformers' state dict; their device and dtype
    kept): the converted files' tensors, or a transformers model's own (the GPU check builds random models with
    transformers, then serves the native forward on this model over the same storage)."""
    device = next(iter(tensors.values())).device
    model = serving_model_skeleton(config, generation_config, tensors)
    return model.to(device).eval()  # the rotary's inverse frequencies, made on the CPU


def serving_model_skeleton(config, generation_config, tensors: dict[str, torch.Tensor]) -> ServingModel:
    """The ServingModel's modules over `tensors` as they are, left where they are (meta tensors stay meta: the GGUF's
    own layers replace them, gguf_weights.py)."""
    if config.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"the native forward does not know model type {config.model_type!r}: set forward = "
                         f"\"transformers\"")
    if getattr(config, "tie_word_embeddings", False):  # one matrix, whether or not the state dict names it twice
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    model = ServingModel(config, generation_config)
    _build(model, config, tensors)
    return model.eval()


def _build(model: ServingModel, config, tensors: dict[str, torch.Tensor]) -> None:
    eps, gemma = config.rms_norm_eps, config.model_type in GEMMA_TYPES
    modules: dict[str, nn.Module] = {"": model, "model": model.model}
    for key in sorted(tensors):
        path, _, kind = key.rpartition(".")
        if kind != "weight":
            continue  # biases are taken with their weights
        *parents, leaf = path.split(".")
        parent = _parent(modules, parents, config)
        weight = tensors[key]
        if leaf == "embed_tokens":
            module = nn.Embedding(*weight.shape, _weight=weight)
            module.weight.requires_grad_(False)
        elif leaf.endswith("_proj") or leaf == "lm_head":
            module = _linear(weight, tensors.get(f"{path}.bias"))
        elif leaf.endswith("norm"):
            module = RMSNorm(weight, eps, gemma)
        else:
            raise ValueError(f"the converted weights hold {key}, which the serving model does not know")
        setattr(parent, leaf, module)
        modules[path] = module
    if "lm_head.weight" not in tensors:  # tied: the head is the embedding's matrix, one Parameter
        model.lm_head = _linear(model.model.embed_tokens.weight, None)
    model.model.rotary_emb = Rotary(config)
    for index, layer in enumerate(model.model.layers):
        _settings(layer, index, config)


def _parent(modules: dict[str, nn.Module], parents: list[str], config) -> nn.Module:
    """The module at `parents` (created on the way: `layers` a ModuleList of num_hidden_layers)."""
    path = ""
    for name in parents:
        child = f"{path}.{name}" if path else name
        if child not in modules:
            if name == "layers":
                modules[child] = nn.ModuleList(nn.Module() for _ in range(config.num_hidden_layers))
                for i, layer in enumerate(modules[child]):
                    modules[f"{child}.{i}"] = layer
            else:
                modules[child] = nn.Module()
            setattr(modules[path], name, modules[child])
        path = child
    return modules[path]


def _linear(weight: torch.Tensor | nn.Parameter, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding `weight` (a Parameter as it is: a tied head shares the embedding's), in and out features
    from its shape (the weight plan sizes its inputs by them)."""
    module = nn.Linear(1, 1, bias=bias is not None, device="meta")
    module.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    module.in_features, module.out_features = weight.shape[1], weight.shape[0]
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)
    return module


def _settings(layer: nn.Module, index: int, config) -> None:
    """What transformers' attention and MLP modules of the family set from the config."""
    kind = config.model_type
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn.scaling = (config.query_pre_attn_scalar if kind in QUERY_PRE_ATTN_SCALAR else head_dim) ** -0.5
    if kind in LAYER_TYPED_WINDOWS:
        layer_types = getattr(config, "layer_types", None)
        sliding = layer_types is not None and layer_types[index] == "sliding_attention"
        attn.sliding_window = config.sliding_window if sliding else None
    if kind in QUERY_PRE_ATTN_SCALAR:
        attn.attn_logit_softcapping = config.attn_logit_softcapping
    name = getattr(config, "hidden_activation", None) if kind in QUERY_PRE_ATTN_SCALAR else None
    name = name or config.hidden_act
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one the serving model knows ({', '.join(ACTIVATIONS)}): set "
                         f"forward = \"transformers\"")
    mlp.act_fn = ACTIVATIONS[name]()

