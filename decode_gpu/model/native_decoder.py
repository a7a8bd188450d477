"""Our own decoder forward for the paged engine: one layer implementation for every family we serve, its family
differences read as data from the loaded transformers model (its config and which modules each layer has).

A decode step through transformers' decoder layers pays, per layer, for keyword plumbing, a rotary embedding
recomputed from the positions, separate q/k/v and gate/up views, norms in five small ops each and the attention
interface's reshapes; over 30 layers on 2 CPU cores that was about 20 ms of every step. Here a step is:

- the embedding (Gemma's scale applied by the family setting, so an int8 table keeps it);
- per layer: RMSNorm fused with the residual add, one packed q/k/v matmul (the stacked layer of
  fused_projections.py, in whatever precision the weight plan made it: int4, int8, q8_0, prepacked bfloat16 or
  plain), the q/k norms of Qwen3/Gemma 3 on q and k together, rotary for q and k together from a cos/sin table
  built once at start-up and indexed by position, paged attention straight on the pool (no transposes), the output
  projection, and the MLP as one packed gate/up matmul, the activation and the down projection;
- the final norm, the lm_head and Gemma 2's final soft-capping.

The weights stay the model's own modules (no copy). The engine serves it on the serving model
(model/serving_model.py: the same module names, built without transformers' modeling code); transformers stays
for the tokenizer, the config, the transformers forward and as the oracle in tests
(tests/decode_gpu/test_native_forward.py: greedy tokens identical to transformers in float32 over 64 tokens for
every family fixture). Nothing in a step reads back to the host, so a CUDA graph captures the whole step.

What is data here, per family: the norm's form (Llama: the weight times the normalized input cast back; Gemma:
1 + weight, applied in float32), norms after attention and the MLP (Gemma 2/3), q/k norms (Qwen3, Gemma 3), the
activation, the attention scale, each layer's sliding window and rotary table (Gemma 3: local and global bases),
partial rotary (Phi-3), soft-capping of scores and logits (Gemma 2), the embedding scale (Gemma).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from decode_gpu.attention.paged_attention import attend_paged
from decode_gpu.attention.paged_batch import Extras, PagedBatch

log = logging.getLogger(__name__)
FORWARDS = ("native", "transformers")
# model types whose embedding rows are scaled by sqrt(hidden size) (transformers does it in its embedding module,
# which an int8 table replaces)
SCALED_EMBEDDINGS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})
SILU_MODULES = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' modules that only call F.silu
ROTARY_CHUNK = 4096  # positions per call when building the table (bounds the transient memory)
# deterministic: every matmul runs on row blocks of exactly this many rows (the last padded), so that a row's product
# comes from the same kernel, shape and reduction order whatever the batch (BLAS picks kernels by row count)
DETERMINISTIC_ROWS = 8


@dataclass(frozen=True)
class Norm:
    """One RMSNorm: `weight` multiplies the normalized input cast back to the activations' dtype (Llama), or, with
    `in_float`, multiplies it in float32 before the cast (Gemma's 1 + weight)."""
    weight: torch.Tensor  # [dim] (or [heads, dim] for q and k together)
    eps: float
    in_float: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dim() == 1 and self.weight.dtype == torch.float32:
            # one call instead of four: in float32 both forms are the normalized input times the weight, and the
            # fused kernel multiplies the same two numbers (bit for bit the same result)
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        h = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        if self.in_float:
            return (h * self.weight).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Projection:
    """Sibling projections of one input as one product: the stacked layer when the model has one (one packed matmul
    in the weight precision in use), else the layers in turn, concatenated. With `rows` (deterministic), on row blocks
    of exactly that many rows."""

    def __init__(self, layers: list[nn.Module], rows: int | None = None) -> None:
        self.layers = layers
        self.single = layers[0] if len(layers) == 1 else None
        self.rows = rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return fixed_rows(self._product, x, self.rows)
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.single is not None:
            return self.single(x)
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


def fixed_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """product(x) computed on blocks of exactly `rows` rows, the last padded with zeros: a row's result does not
    depend on how many rows share the call. # x: [n, in] -> [n, out]"""
    n = x.shape[0]
    if n == rows:
        return product(x)
    padded = x.new_zeros(-(-n // rows) * rows, x.shape[1])
    padded[:n] = x
    return torch.cat([product(block) for block in padded.split(rows)])[:n]


@dataclass(frozen=True)
class Layer:
    """One decoder layer as data: its weights (the model's modules) and its family settings."""
    index: int
    attn_norm: Norm
    qkv: Projection
    qk_norm: Norm | None  # over q's and k's heads together ([n_heads + kv_heads, head_dim] weight)
    o_proj: Projection
    attn_out_norm: Norm | None  # Gemma: a norm of the attention's output before the residual add
    mlp_norm: Norm
    gate_up: Projection
    act: Callable[[torch.Tensor], torch.Tensor]
    down: Projection
    mlp_out_norm: Norm | None  # Gemma: a norm of the MLP's output before the residual add
    rotary: int  # index of the rotary table this layer reads
    scale: float
    extras: Extras  # sliding window, soft-capping


class NativeDecoder:
    """The paged decode forward over a loaded causal LM, transformers' or the serving model (model/serving_model.py),
    after fuse_projections and the weight plan.
    forward(ids [n], positions [n], paged) -> logits [n, vocab] float32. `between_layers`, when set, is called before
    each layer (the priority gate's wait; eager steps only)."""

    def __init__(self, model: nn.Module, max_positions: int, deterministic: bool = False) -> None:
        """deterministic: matmuls on fixed row blocks (DETERMINISTIC_ROWS), so a row's logits do not depend on the
        batch it shares."""
        config = model.config
        self.rows = DETERMINISTIC_ROWS if deterministic else None
        self.config = config
        core = model.model
        self.embedding = model.get_input_embeddings()
        dtype = _dtype(model)
        self.dtype = dtype
        self.embed_scale = None
        if config.model_type in SCALED_EMBEDDINGS and not hasattr(self.embedding, "embed_scale"):
            self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=self.embedding_device)
        self.n_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        gemma_norms = _gemma_norm(core.norm)
        tables: dict[str, int] = {}
        cos, sin = [], []
        self.layers: list[Layer] = []
        for index, layer in enumerate(core.layers):
            key = _rotary_key(config, index)
            if key not in tables:
                tables[key] = len(cos)
                c, s = _rotary_table(core.rotary_emb, key, max_positions, dtype, self.embedding_device)
                cos.append(c)
                sin.append(s)
            self.layers.append(self._layer(layer, index, tables[key], config))
        self.cos, self.sin = cos, sin  # per table: [max_positions, rotary_dim] in the activations' dtype
        self.rotary_dim = cos[0].shape[-1]
        self.norm = self._norm(core.norm)
        self.head = Projection([model.get_output_embeddings()], self.rows)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.between_layers: Callable[[], None] | None = None
        log.info("native decode forward: %d layers, %d rotary table(s) of %d positions, %s norms%s", len(self.layers),
                 len(cos), max_positions, "Gemma" if gemma_norms else "Llama",
                 ", fused projections" if all(la.qkv.single is not None for la in self.layers) else "")

    @property
    def embedding_device(self) -> torch.device:
        return next(iter([*self.embedding.parameters(), *self.embedding.buffers()])).device

    def _norm(self, module: nn.Module) -> Norm:
        eps = getattr(module, "variance_epsilon", None) or module.eps
        if _gemma_norm(module):
            weight = 1.0 + module.weight.detach().float()
            in_float = True
        else:
            weight = module.weight.detach()
            in_float = False
        return Norm(weight, eps, in_float)

    def _layer(self, layer: nn.Module, index: int, rotary: int, config) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _projection(attn, ("qkv_fused",), ("qkv_proj",), ("q_proj", "k_proj", "v_proj"), self.rows)
        gate_up = _projection(mlp, ("gate_up_fused",), ("gate_up_proj",), ("gate_proj", "up_proj"), self.rows)
        qk_norm = None
        if getattr(attn, "q_norm", None) is not None:
            q, k = self._norm(attn.q_norm), self._norm(attn.k_norm)
            weight = torch.cat([q.weight.expand(self.n_heads, -1), k.weight.expand(self.kv_heads, -1)])
            qk_norm = Norm(weight, q.eps, q.in_float)  # [n_heads + kv_heads, head_dim]
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        softcap = getattr(attn, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None
        act = getattr(mlp, "act_fn", None) or mlp.activation_fn
        if type(act).__name__ in SILU_MODULES and not getattr(act, "inplace", False):
            act = F.silu  # what the module's forward calls, without a module call a layer
        return Layer(index=index, attn_norm=self._norm(layer.input_layernorm), qkv=qkv, qk_norm=qk_norm,
                     o_proj=Projection([attn.o_proj], self.rows),
                     attn_out_norm=self._norm(layer.post_attention_layernorm) if gemma else None,
                     mlp_norm=self._norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
                     gate_up=gate_up, act=act, down=Projection([mlp.down_proj], self.rows),
                     mlp_out_norm=self._norm(layer.post_feedforward_layernorm) if gemma else None,
                     rotary=rotary, scale=float(attn.scaling), extras=Extras(window or None, softcap or None))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, paged: PagedBatch) -> torch.Tensor:
        """ids, positions: [n] (any integer dtype); paged: the batch's attention metadata. # [n, vocab] float32"""
        h = self.embedding(ids)  # [n, hidden]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        positions = positions.long()
        rotary = [(cos.index_select(0, positions)[:, None], self._signed(sin.index_select(0, positions))[:, None])
                  for cos, sin in zip(self.cos, self.sin)]  # each [n, 1, rotary_dim]
        residual = None
        for layer in self.layers:
            if self.between_layers is not None:
                self.between_layers()
            h, residual = self._layer_forward(layer, h, residual, rotary[layer.rotary], paged)
        h = self.norm(h + residual)
        logits = self.head(h)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    __call__ = forward

    def _layer_forward(self, layer: Layer, h: torch.Tensor, residual: torch.Tensor | None,
                       rotary: tuple[torch.Tensor, torch.Tensor],
                       paged: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream arrives as (h, residual), their sum the layer's input. # both [n, hidden]"""
        n = h.shape[0]
        heads, kv_heads, d = self.n_heads, self.kv_heads, self.head_dim
        residual = h if residual is None else h + residual
        qkv = layer.qkv(layer.attn_norm(residual))  # [n, (heads + 2 kv_heads) * d]
        qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
        if layer.qk_norm is not None:
            qk = layer.qk_norm(qk)
        qk = self._rotate(qk, *rotary)
        out = attend_paged(paged, layer.index, qk[:, :heads], qk[:, heads:], v, layer.scale, layer.extras)
        h = layer.o_proj(out.reshape(n, heads * d))
        if layer.attn_out_norm is not None:
            h = layer.attn_out_norm(h)
        residual = h + residual
        gate, up = layer.gate_up(layer.mlp_norm(residual)).chunk(2, dim=-1)
        h = layer.down(layer.act(gate) * up)
        if layer.mlp_out_norm is not None:
            h = layer.mlp_out_norm(h)
        return h, residual

    def _signed(self, sin: torch.Tensor) -> torch.Tensor:
        """A forward's sin rows with their first half negated, once a forward rather than once a layer: rotate_half's
        negation folded in (negating is exact: the products are transformers' bit for bit). # [n, rotary_dim]"""
        half = self.rotary_dim // 2
        return torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """RoPE in transformers' half-split layout over the first rotary_dim of each head (all of it but for
        Phi-3's partial rotary): x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], as [x2, x1] times the
        sin table with its first half negated. x: [n, heads, d]; cos, signed_sin: [n, 1, rotary_dim]."""
        r = self.rotary_dim
        part = x if r == x.shape[-1] else x[..., :r]
        half = r // 2
        rotated = part * cos + torch.cat([part[..., half:], part[..., :half]], dim=-1) * signed_sin
        return rotated if r == x.shape[-1] else torch.cat([rotated, x[..., r:]], dim=-1)


def _dtype(model: nn.Module) -> torch.dtype:
    """The activations' dtype: the model's float dtype (quantized layers compute in it too)."""
    return model.config.dtype if isinstance(getattr(model.config, "dtype", None), torch.dtype) else model.dtype


def _gemma_norm(module: nn.Module) -> bool:
    """Gemma's RMSNorm scales by 1 + weight, in float32 (transformers' class is named for the family: Gemma2RMSNorm...;
    the serving model's says so, serving_model.RMSNorm)."""
    return getattr(module, "one_plus_weight", None) or type(module).__name__.startswith("Gemma")


def _projection(module: nn.Module, stacked: tuple[str], native: tuple[str], parts: tuple[str, ...],
                rows: int | None) -> Projection:
    for names in (stacked, native):
        layer = getattr(module, names[0], None)
        if layer is not None:
            return Projection([layer], rows)
    return Projection([getattr(module, name) for name in parts], rows)


def _rotary_key(config, index: int) -> str:
    """Which rotary table a layer reads: Gemma 3's by layer type (local and global bases), else the one."""
    rope = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types and all(isinstance(v, dict) for v in rope.values()) and layer_types[index] in rope:
        return layer_types[index]
    return ""


@torch.inference_mode()
def _rotary_table(rotary: nn.Module, key: str, max_positions: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions 0..max_positions-1 as the model's own rotary module computes them (its inverse
    frequencies, with any scaling and the GGUF's frequency divisors already applied), in the activations' dtype.
    # each [max_positions, rotary_dim]"""
    probe = torch.zeros(1, dtype=dtype, device=device)
    cos, sin = [], []
    for start in range(0, max_positions, ROTARY_CHUNK):
        positions = torch.arange(start, min(max_positions, start + ROTARY_CHUNK), device=device)[None]
        c, s = rotary(probe, positions, key) if key else rotary(probe, positions)
        cos.append(c[0])
        sin.append(s[0])
    return torch.cat(cos).contiguous(), torch.cat(sin).contiguous()


def resolve_forward(name: str | None = None) -> str:
    """The decode forward: `name` if given, else EDGE_DECODE_FORWARD, else native."""
    name = (name or os.environ.get("EDGE_DECODE_FORWARD", "") or "native").strip().lower()
    if name not in FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, not {name!r}")
    return name
