"""Prompts for teacher-forced fidelity checks on the embedded model, each followed by the tokens the float32 model
decodes greedily after it (tests/decode_gpu/test_weight_quant.py, tests/decode_gpu/test_kv_pool_int4.py)."""

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of motion are", "To make a cup of tea, first", "Photosynthesis converts",
           "SELECT name FROM users WHERE", "The best way to learn a language is"]
POSITIONS = 32


def greedy_continuations(model, tokenizer) -> list[torch.Tensor]:
    """Each prompt's ids followed by POSITIONS greedy tokens of `model`. # each [1, prompt + POSITIONS]"""
    runs = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = torch.tensor([tokenizer(text).input_ids])
            runs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=POSITIONS,
                                       min_new_tokens=POSITIONS, do_sample=False, pad_token_id=0))
    return runs
