"""Turn a completion prompt or chat messages into tokens, with the chat template from the GGUF's metadata."""

from __future__ import annotations

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from prefill_cpu.prefiller import Prefiller


class BadPromptError(ValueError):
    """Messages the chat template cannot render."""


class PromptRenderer:
    def __init__(self, prefiller: Prefiller) -> None:
        self.prefiller = prefiller
        llm = prefiller.llm
        template = llm.metadata.get("tokenizer.chat_template")
        self.formatter = None
        if template:
            eos = llm.detokenize([llm.token_eos()], special=True).decode("utf-8", errors="replace")
            bos = llm.detokenize([llm.token_bos()], special=True).decode("utf-8", errors="replace")
            self.formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        self.add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") != "false"

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        if self.formatter is None:
            raise BadPromptError("this model's GGUF has no chat template; use /v1/completions")
        try:
            prompt = self.formatter(messages=messages).prompt
        except Exception as err:  # jinja2 errors are the template's way of refusing the messages
            raise BadPromptError(f"the chat template could not render these messages: {err}") from None
        # the template writes the special tokens (BOS included) itself
        return self.prefiller.llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)

    def completion_tokens(self, prompt: str) -> list[int]:
        return self.prefiller.llm.tokenize(prompt.encode("utf-8"), add_bos=self.add_bos, special=False)
