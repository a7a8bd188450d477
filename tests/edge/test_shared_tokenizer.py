"""The gateway loads a GGUF's vocabulary once: /tokenize, /detokenize and Anthropic's count_tokens share one
Tokenizer per model file, built on first use."""

import asyncio
import types

from edge.api.messages import prompt_tokens
from edge.http import tokenize as tokenize_api


class CountingTokenizer:
    made: list[str] = []

    def __init__(self, model_path: str) -> None:
        self.made.append(model_path)
        self.calls: list = []

    def chat(self, messages, tools=""):
        self.calls.append((messages, tools))
        return [1] * (10 * len(messages))


def test_count_tokens_and_tokenize_share_one_tokenizer(monkeypatch):
    monkeypatch.setattr(tokenize_api, "Tokenizer", CountingTokenizer)
    monkeypatch.setattr(tokenize_api, "_TOKENIZERS", {})
    CountingTokenizer.made = []
    gateway = types.SimpleNamespace(model_name="m")
    body = {"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hi"}]}
    _, counted = asyncio.run(prompt_tokens(gateway, body, "/models/a.gguf"))
    shared = tokenize_api.shared_tokenizer("/models/a.gguf")
    assert CountingTokenizer.made == ["/models/a.gguf"]  # built lazily, once
    assert counted == 20 and len(shared.calls) == 1  # the count came from the shared one: system + user
    assert tokenize_api.shared_tokenizer("/models/b.gguf") is not shared  # one per model file
