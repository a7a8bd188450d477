"""The gateway loads a GGUF's vocabulary once: /tokenize, /detokenize and Anthropic's count_tokens share one
Tokenizer per model file (edge.http.tokenizers.Tokenizers, held under edge.state.TOKENIZERS), built on first use."""

import asyncio
import types

from edge.api.messages import parse_count
from edge.http import tokenizers as tokenizers_module
from edge.http.count_tokens import prompt_tokens
from edge.http.tokenizers import Tokenizers


class CountingTokenizer:
    made: list[str] = []

    def __init__(self, model_path: str) -> None:
        self.made.append(model_path)
        self.calls: list = []

    def chat(self, messages, tools=""):
        self.calls.append((messages, tools))
        return [1] * (10 * len(messages))


def test_count_tokens_and_tokenize_share_one_tokenizer(monkeypatch):
    monkeypatch.setattr(tokenizers_module, "Tokenizer", CountingTokenizer)
    CountingTokenizer.made = []
    tokenizers = Tokenizers()
    gateway = types.SimpleNamespace(model_name="m", config=types.SimpleNamespace(model="/models/a.gguf"))
    parsed = parse_count({"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hi"}]})
    counted = asyncio.run(prompt_tokens(tokenizers, gateway, parsed))
    shared = tokenizers.get("/models/a.gguf")
    assert CountingTokenizer.made == ["/models/a.gguf"]  # built lazily, once
    assert counted == 20 and len(shared.calls) == 1  # the count came from the shared one: system + user
    assert tokenizers.get("/models/b.gguf") is not shared  # one per model file
    assert Tokenizers().get("/models/a.gguf") is not shared  # one per app: no module-level cache
