"""Random-weight models of published shapes and synthetic KV handoffs, for the GPU check (no GGUF, no llama.cpp).

The GPU machines have no network and no llama.cpp, so the decode engine is fed the way a prefill worker
would feed it, with bytes of the right size: f16 K/V rows of random values, one handoff per sequence. The
shapes are the published Hugging Face configs of Llama-3.2-1B and Llama-3.1-8B; the values are noise,
so only timings mean anything.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from contracts.handoff import KVHandoff, KVLayout, SamplingParams
from contracts.identity import GGUFIdentity


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_factor: float  # llama3 RoPE scaling factor (0: plain RoPE)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES = {
    # huggingface.co/meta-llama/Llama-3.2-1B/config.json
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, True, 32.0),
    # huggingface.co/meta-llama/Llama-3.1-8B/config.json
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256, False, 8.0),
    # the CPU smoke test's: head size 32 keeps int8 groups possible; seconds to build and step
    "tiny": ModelShape("tiny", 128, 256, 2, 4, 2, 512, False, 0.0),
}


def llama_config(shape: ModelShape) -> LlamaConfig:
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if shape.rope_factor:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": shape.rope_factor, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       head_dim=shape.head_dim, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       tie_word_embeddings=shape.tie_word_embeddings, rope_parameters=rope,
                       bos_token_id=min(128000, shape.vocab_size - 2), eos_token_id=min(128001, shape.vocab_size - 1),
                       pad_token_id=None)


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> tuple[LlamaForCausalLM, float]:
    """The model made directly on the device (8B in bfloat16 is 16 GB: never through host memory), with
    transformers' own random init, which on a GPU takes well under a second per GB. Returns (model, seconds)."""
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(llama_config(shape), dtype=dtype)
    model.eval().requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, time.perf_counter() - started


def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once, except an untied input embedding, of which
    a step reads only its batch's rows (a tied one is read whole as the output projection)."""
    unique = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in unique.values())
    embed = model.get_input_embeddings().weight
    if embed.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def identity_for(shape: ModelShape) -> GGUFIdentity:
    """The identity a GGUF of this shape would have; the fingerprint says it is synthetic."""
    return GGUFIdentity(path=f"synthetic:{shape.name}", fingerprint=f"sha256:synthetic-{shape.name}", arch="llama",
                        n_layer=shape.num_layers, n_head=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                        head_dim_k=shape.head_dim, head_dim_v=shape.head_dim, rope_layout="interleaved")


def synthetic_handoffs(identity: GGUFIdentity, n_tokens: int, count: int, max_tokens: int,
                       vocab_size: int) -> list[KVHandoff]:
    """`count` f16 handoffs of `n_tokens` each, as a llama.cpp worker with an f16 cache sends them. The K/V
    bytes are one random row block shared by every layer and sequence (a 4k-token 8B handoff is 512 MiB:
    distinct bytes would cost tens of GB of host memory); the import path still copies and converts each
    layer of each sequence, so the engine does all of its import work."""
    gen = torch.Generator().manual_seed(n_tokens)
    rows = torch.randn(n_tokens, identity.n_embd_k, generator=gen).to(torch.float16)  # [n_tokens, n_embd_k]
    payload = rows.numpy().tobytes()
    layout = KVLayout(n_layer=identity.n_layer, num_kv_heads=identity.num_kv_heads, head_dim_k=identity.head_dim_k,
                      head_dim_v=identity.head_dim_v, k_dtype="f16", v_dtype="f16", v_transposed=False,
                      k_rotation=0, v_rotation=0, rope_layout=identity.rope_layout)
    prompt = tuple(torch.randint(3, vocab_size, (n_tokens,), generator=gen).tolist())
    base = KVHandoff(request_id="", model_fingerprint=identity.fingerprint, layout=layout,
                     positions=tuple(range(n_tokens)), prompt_tokens=prompt, first_token=prompt[-1],
                     k_layers=(payload,) * identity.n_layer, v_layers=(payload,) * identity.n_layer,
                     sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [dataclasses.replace(base, request_id=f"s{i}") for i in range(count)]


def random_prompts(count: int, n_tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts, so that no baseline shares prefix blocks between requests."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, n_tokens), generator=gen).tolist()


# ---- step timers: our engine and the two transformers baselines, on the same model object ----

@dataclass(frozen=True)
class StepTiming:
    ms: float  # median wall time of one decode step, host sync included
    kv_tokens: int  # KV tokens the step attends to, summed over the batch (the middle timed step's)


def time_ours(model, shape: ModelShape, device: torch.device, context: int, batches: list[int], warmup: int,
              steps: int, time_left) -> tuple[float, dict[int, StepTiming | str]]:
    """Our engine on `max(batches)` synthetic handoffs of `context` tokens, then each smaller batch by aborting
    the extra sequences. Returns (seconds for the import and first step, {batch: timing or why skipped})."""
    from decode_gpu.core.scheduler import SchedulerConfig
    from decode_gpu.engine import DecodeEngine, EngineConfig
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    identity, top, warmup = identity_for(shape), max(batches), max(1, warmup)
    max_tokens = len(batches) * (warmup + steps) + 8  # no sequence ends before the last timed step
    handoffs = synthetic_handoffs(identity, context, top, max_tokens, shape.vocab_size)
    config = RunnerConfig(kv_cache_tokens=top * (context + max_tokens + 16), max_num_seqs=top,
                          max_model_len=context + max_tokens + 1)
    runner = ModelRunner(model, identity, config, device)
    engine = DecodeEngine(runner, EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=top, max_import_tokens=top * context),
        max_model_len=context + max_tokens + 1, max_backlog_bytes=sum(h.payload_bytes for h in handoffs) + 1))
    try:
        started = time.perf_counter()
        for handoff in handoffs:
            engine.add(handoff)
        _engine_step(engine, device)  # imports every handoff, then the first decode step
        first_s, results, step_s = time.perf_counter() - started, {}, 0.0
        for batch in sorted(batches, reverse=True):  # a step is no slower than the last, larger batch's
            for request_id in list(engine.requests)[batch:]:
                engine.abort(request_id)
            if time_left() < warmup * step_s * 1.5 + 2:
                results[batch] = "skipped: time budget"
                continue
            step_s = min(_engine_step(engine, device) for _ in range(warmup))  # a new batch size may compile kernels
            if time_left() < steps * step_s * 1.5 + 1:
                results[batch] = "skipped: time budget"
                continue
            times = [_engine_step(engine, device) for _ in range(steps)]
            step_s = max(times)
            kv_tokens = sum(len(seq.tokens) for seq in engine.sequences) - batch * (steps // 2)
            results[batch] = StepTiming(1e3 * sorted(times)[len(times) // 2], kv_tokens)
        return first_s, results
    finally:
        del engine, runner
        _free(device)


def _engine_step(engine, device: torch.device) -> float:
    started = time.perf_counter()
    events = engine.step()
    _sync(device)
    errors = [e.error for e in events if e.error]
    if errors or not engine.has_work:
        raise RuntimeError(f"a sequence failed or ended early: {errors[:1] or 'all finished'}")
    return time.perf_counter() - started


def time_generate(model, shape: ModelShape, device: torch.device, context: int, batch: int, steps: int) -> float:
    """transformers `generate` (static batch, greedy) continuing from a dense DynamicCache of random K/V: after
    a warm-up call, the median gap between new tokens as a streamer receives them (each hand-off is a host
    copy, so the gaps are device time). Returns ms per step."""
    model.set_attn_implementation("sdpa")
    prompts = random_prompts(batch, context + 1, shape.vocab_size, seed=batch)
    ids = torch.tensor(prompts, device=device)  # [batch, context + 1]
    _timed_generate(model, shape, ids, 2)
    stamps = _timed_generate(model, shape, ids, 1 + steps)[1:]  # the first put is the prompt
    _free(device)
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return 1e3 * gaps[len(gaps) // 2]


class _Stamps:
    """A generate streamer that notes when each batch of tokens arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, tokens) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _timed_generate(model, shape: ModelShape, ids: torch.Tensor, n_new: int) -> list[float]:
    from transformers import DynamicCache
    batch, context = ids.shape[0], ids.shape[1] - 1
    cache = DynamicCache(config=model.config)
    for layer in range(shape.num_layers):
        kv = torch.randn(2, batch, shape.num_kv_heads, context, shape.head_dim, device=ids.device, dtype=model.dtype)
        cache.update(kv[0], kv[1], layer)  # [batch, num_kv_heads, context, head_dim] each
    stamps = _Stamps()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{_cache_kwarg(): cache}, streamer=stamps,
                       do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0)
    if cache.get_seq_length() != context + n_new:  # the prompt was not run again over the cache
        raise RuntimeError(f"generate left {cache.get_seq_length()} cached tokens, expected {context + n_new}")
    return stamps.times


def _cache_kwarg() -> str:
    """transformers 5.24 names generate's cache `cache` (`past_key_values` still works, with a warning);
    the GPU image's older transformers may know only `past_key_values`."""
    from transformers.generation import utils
    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def time_generate_batch(model, shape: ModelShape, device: torch.device, context: int, batch: int, steps: int,
                        timeout_s: float) -> tuple[float, float, str]:
    """transformers `generate_batch` (paged continuous batching, its default settings) on distinct random prompts.
    Its prefill of batch x context tokens runs in chunks of 8192 with decodes mixed in, so each request asks for
    enough tokens to still be decoding after the last prefill; ms/step is the median gap between a request's
    tokens once every request has its first one. Returns (ms/step, wall seconds of the call, note)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    # on the CPU (the smoke test) a small cache: its default sizing there takes 20 s and gigabytes
    cb_config = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256) if device.type == "cpu" else None
    new_tokens = steps + 4 + -(-batch * context // (256 if cb_config else 8192))
    prompts = random_prompts(batch, context, shape.vocab_size, seed=batch)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0)
    started = time.perf_counter()
    outputs = _with_timeout(lambda: model.generate_batch(inputs=prompts, generation_config=config,
                                                         continuous_batching_config=cb_config,
                                                         record_timestamps=True), timeout_s)
    wall = time.perf_counter() - started
    _free(device)
    errors = [o.error for o in outputs.values() if o.error]
    if len(outputs) < batch or errors:
        raise RuntimeError(f"{len(outputs)} of {batch} requests came back; errors: {errors[:1]}")
    stamps = [o.timestamps for o in outputs.values()]
    if any(not s for s in stamps):
        return 1e3 * wall / new_tokens, wall, "no timestamps: wall / tokens, prefill included"
    all_started = max(s[0] for s in stamps)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if a >= all_started]  # seconds
    if len(gaps) < batch:
        raise RuntimeError(f"only {len(gaps)} token gaps after every request started")
    return 1e3 * sorted(gaps)[len(gaps) // 2], wall, ""


def _with_timeout(fn, timeout_s: float):
    """fn() in a daemon thread; a call that outlives timeout_s raises TimeoutError (and keeps running)."""
    import threading
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=_capture(fn)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:.0f} s")
    value, err = box["value"]
    if err is not None:
        raise err
    return value


def _capture(fn):
    try:
        return fn(), None
    except Exception as err:  # handed to the caller's thread
        return None, err


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
