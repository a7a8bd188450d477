"""A tiny random-weight Llama and KV handoffs made by transformers itself, for engine tests on any device."""

import torch

TINY_LLAMA = dict(vocab_size=384, hidden_size=384, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)


def tiny_engine_setup(device: str):
    """A random-weight Llama (head size 64, 3 query heads per KV head) and handoffs of torch's own prompt KV."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from contracts.identity import GGUFIdentity
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval().to(device)
    identity = GGUFIdentity(path="tiny-llama", fingerprint="sha256:tiny", arch="llama", n_layer=2, n_head=6,
                            num_kv_heads=2, head_dim_k=64, head_dim_v=64, rope_layout="neox")
    prompts = [list(range(3, 3 + n)) for n in (7, 16, 21)]  # ends before, on and after a block boundary
    return model, identity, [handoff(model, identity, f"r{i}", p) for i, p in enumerate(prompts)]


def handoff(model, identity, request_id: str, prompt: list[int]):
    from contracts.handoff import KVHandoff, KVLayout, SamplingParams
    from decode_gpu.reference.dense_decoder import prompt_cache
    cache, logits = prompt_cache(model, prompt)
    # per layer: K, V [n, num_kv_heads, 64]
    rows = [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]
    layout = KVLayout(n_layer=2, num_kv_heads=2, head_dim_k=64, head_dim_v=64, k_dtype="f16", v_dtype="f16",
                      v_transposed=False, k_rotation=0, v_rotation=0, rope_layout="neox")
    to_bytes = lambda x: x.to("cpu", torch.float16).contiguous().numpy().tobytes()  # noqa: E731
    return KVHandoff(request_id=request_id, model_fingerprint=identity.fingerprint, layout=layout,
                     positions=tuple(range(len(prompt))), prompt_tokens=tuple(prompt),
                     first_token=int(logits.argmax()), k_layers=tuple(to_bytes(k) for k, _ in rows),
                     v_layers=tuple(to_bytes(v) for _, v in rows),
                     sampling=SamplingParams(temperature=0.0, max_tokens=6 + len(prompt) % 3))


def greedy_tokens(model, identity, handoffs, device: str, storage: str, kv_cache_tokens: int = 256,
                  **runner_config) -> dict[str, list[int]]:
    """Every request's tokens, the first (the handoff's) included, from an engine run to the end."""
    from decode_gpu.engine import DecodeEngine
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    config = RunnerConfig(kv_cache_tokens=kv_cache_tokens, kv_storage=storage, **runner_config)
    runner = ModelRunner(model, identity, config, torch.device(device))
    engine = DecodeEngine(runner)
    outputs: dict[str, list[int]] = {}
    for event in [e for h in handoffs for e in engine.add(h)]:
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
    while engine.has_work:
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
    return outputs
