"""Fidelity of the handoff on the embedded SmolLM2-135M (Q4_1 weights).

llama.cpp's quantized-weight arithmetic differs slightly from torch's dequantized floats, so the test is
statistical: teacher-forced over 32 continuation positions, decoding from the imported KV must agree
with decoding from torch's own prompt KV on the next token (top-1) and in distribution (KL).
"""

import pytest
import torch

from contracts.handoff import SamplingParams
from decode_gpu.kv.importer import import_handoff
from decode_gpu.model.loader import load_decode_model
from decode_gpu.reference.dense_cache import DenseKVCache
from decode_gpu.reference.dense_decoder import decode, prompt_cache, teacher_forced_logits
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
    "Photosynthesis is the process by which green plants",
    "<|im_start|>user\nGive me three tips for staying focused while studying.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13, 21,",
    "The quick brown fox jumps over the lazy dog. " * 12 + "Meanwhile, the",
    "Translate to French: 'Where is the train station?'\nFrench:",
    "In 1969, Neil Armstrong became the first person to",
]


@pytest.fixture(scope="module")
def decode_model(embedded_model_path):
    from contracts.identity import read_gguf_identity
    identity = read_gguf_identity(embedded_model_path)
    return identity, load_decode_model(identity, CPU, torch.float32)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_imported_kv_agrees_with_torch_kv(embedded_model_path, decode_model, kv_type):
    identity, model = decode_model
    prefiller = Prefiller(PrefillConfig(embedded_model_path, n_ctx=1024, n_threads=2, kv_type=kv_type))
    agree, kls = [], []
    try:
        for i, text in enumerate(PROMPTS):
            tokens = prefiller.tokenize(text)
            handoff = prefiller.prefill(PrefillRequest(f"p{i}", tuple(tokens), SamplingParams(temperature=0))).handoff
            reference, _ = prompt_cache(model, tokens)
            continuation = decode(model, reference, handoff.first_token, 32)
            reference, _ = prompt_cache(model, tokens)
            imported = DenseKVCache(model.config, torch.float32)
            import_handoff(handoff, identity, imported, CPU)
            want = teacher_forced_logits(model, reference, continuation)  # [32, vocab]
            got = teacher_forced_logits(model, imported.cache, continuation)
            agree.append((want.argmax(-1) == got.argmax(-1)).float())
            kls.append(torch.sum(want.softmax(-1) * (want.log_softmax(-1) - got.log_softmax(-1)), dim=-1))
    finally:
        prefiller.close()
    agreement, mean_kl = float(torch.cat(agree).mean()), float(torch.cat(kls).mean())
    print(f"{kv_type}: top-1 agreement {agreement:.4f}, mean KL {mean_kl:.5f} nats over {len(PROMPTS) * 32} positions")
    assert agreement >= 0.95
    assert mean_kl <= 0.01
