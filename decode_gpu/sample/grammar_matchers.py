"""Each constrained choice's grammar matcher and the step's token bitmask, from one set of grammar tables.

The tokenizer's tables take seconds to build: the engine process has them built in a thread of their own as it
starts (`warm`), so that the first structured request does not hold the engine thread (and every stream) while
they are made. An engine made without warm (tests, tools) builds them on its first structured request.
"""

from __future__ import annotations

import threading

import torch

from decode_gpu.core.sequence import Sequence
from decode_gpu.sample.structured import Grammars


class GrammarMatchers:
    def __init__(self, tokenizer, runner, stop_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.runner = runner  # its model's vocabulary sizes the masks (read on first use: test runners have no model)
        self.stop_token_ids = stop_token_ids  # the tokens that complete a grammar
        self._grammars: Grammars | None = None
        self._building: threading.Thread | None = None

    def warm(self) -> None:
        """Build the tables now, in a thread of their own (the engine thread goes on stepping)."""
        if self.tokenizer is not None and self._grammars is None and self._building is None:
            self._building = threading.Thread(target=self._build, name="grammar-tables", daemon=True)
            self._building.start()

    def _build(self) -> None:
        try:
            self._grammars = Grammars(self.tokenizer, self.runner.model.config.vocab_size, self.stop_token_ids)
        except Exception:  # built again, with its error, on the first structured request
            pass

    def matcher(self, seq: Sequence):
        """The sequence's grammar matcher, having taken the first token (which the prefill worker masked), from a
        compile of its cache salt only; a GrammarError or ValueError when the constraint does not compile or the
        first token does not fit."""
        matcher = self._built().matcher(*seq.sampling.structured, seq.cache_salt)
        if not matcher.accept_token(seq.tokens[-1]):
            raise ValueError(f"the first token {seq.tokens[-1]} does not fit the constraint")
        return matcher

    def bitmask(self, matchers: list, device: torch.device) -> tuple[list[int], torch.Tensor]:
        """The rows that have a matcher (None: unconstrained) and the batch's bitmask on the device
        # [len(matchers), ceil(vocab / 32)] int32"""
        return self._built().bitmask(matchers, device)

    def _built(self) -> Grammars:
        if self._building is not None:
            self._building.join()
            self._building = None
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer to build token masks with")
            self._grammars = Grammars(self.tokenizer, self.runner.model.config.vocab_size, self.stop_token_ids)
        return self._grammars
