"""The GGUF's tokenizer and chat template in the gateway: the tokens a prefill worker would prefill, from the same
PromptRenderer over the GGUF's tokenizer alone (llama.cpp loads it without the weights), called in a thread off the
event loop."""

from __future__ import annotations

import threading
import types

from edge.api.fields import ApiError


class Tokenizer:
    """The GGUF's tokenizer and chat template, loaded on first use; one caller at a time (llama.cpp's vocab)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._lock = threading.Lock()
        self._llm = None
        self._renderer = None

    def _load(self) -> None:
        if self._llm is None:
            import llama_cpp

            from prefill_cpu.prompt_renderer import PromptRenderer
            self._llm = llama_cpp.Llama(self.model_path, vocab_only=True, verbose=False)
            self._renderer = PromptRenderer(types.SimpleNamespace(llm=self._llm))

    def completion(self, prompt: str, add_special: bool) -> list[int]:
        with self._lock:
            self._load()
            if add_special:  # as a worker tokenizes a completion prompt
                return self._renderer.completion_tokens(prompt)
            return self._llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)

    def chat(self, messages: list[dict], tools: str = "") -> list[int]:
        """messages as a worker gets them (edge.api.messages.worker_messages); tools: JSON text."""
        with self._lock:
            self._load()
            return self._renderer.chat_tokens(messages, tools)

    def detokenize(self, tokens: list[int]) -> str:
        with self._lock:
            self._load()
            n_vocab = self._llm.n_vocab()
            if (bad := next((i for i, t in enumerate(tokens) if not 0 <= t < n_vocab), None)) is not None:
                raise ApiError(400, f"tokens[{bad}] is {tokens[bad]}, not a token id (0 to {n_vocab - 1})",
                               f"tokens[{bad}]", "invalid_value")
            return self._llm.detokenize(tokens, special=True).decode("utf-8", errors="replace")


class Tokenizers:
    """The gateway's one Tokenizer per GGUF, held under edge.state.TOKENIZERS: /tokenize, /detokenize and Anthropic's
    count_tokens load a vocabulary once between them."""

    def __init__(self) -> None:
        self.loaded: dict[str, Tokenizer] = {}

    def get(self, model_path: str | None, what: str = "tokenize") -> Tokenizer:
        """The Tokenizer of this GGUF (its vocabulary loads on first use). what: the work that needs it, for the 503
        when the gateway does not know the model's file."""
        if model_path is None:
            raise ApiError(503, f"the model's file is not known to the gateway, so it cannot {what}",
                           error_type="server_error", code="unavailable")
        tokenizer = self.loaded.get(model_path)
        if tokenizer is None:
            tokenizer = self.loaded[model_path] = Tokenizer(model_path)
        return tokenizer
