"""Every prompt token's logprob (given the tokens before it) and its top alternatives, from llama.cpp's logits.

Only for the requests that ask (a completion's `echo` with `logprobs`, or `prompt_logprobs`): the prefiller then
asks llama.cpp for the logits of every prompt position, chunk by chunk, and each chunk's rows are reduced here
before the next chunk overwrites them. The values are those of the model's raw distribution (no temperature,
penalties or bias), as the first and every later token's logprobs are.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from contracts.events import Logprob, TopLogprob
from contracts.messages import PromptLogprobs

LOGITS_CHUNK = 128  # prompt tokens per llama_decode while every position's logits are kept (128 x vocab floats)


class PromptLogprobCollector:
    def __init__(self, tokens: list[int], top_k: int) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [n]
        self.top_k = top_k
        n = max(0, len(tokens) - 1)  # position i's logits score token i + 1; the last position scores nothing
        self.logprobs = np.zeros(n, dtype=np.float32)  # [n - 1]
        self.ranks = np.zeros(n, dtype=np.int64)  # [n - 1]: 1 + how many tokens were likelier than the prompt's
        self.top_ids = np.zeros((n, top_k), dtype=np.int64)  # [n - 1, k], best first
        self.top_logprobs = np.zeros((n, top_k), dtype=np.float32)  # [n - 1, k]

    def add(self, begin: int, logits: np.ndarray) -> None:
        """logits: [rows, vocab] float32, the logits of positions begin .. begin + rows - 1."""
        rows = logits[:max(0, min(len(logits), len(self.logprobs) - begin))]  # [r, vocab]
        if not len(rows):
            return
        peak = rows.max(axis=1, keepdims=True)  # [r, 1]
        log_norm = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))  # [r] logsumexp
        end = begin + len(rows)
        targets = self.tokens[begin + 1:end + 1]  # [r]
        chosen = rows[np.arange(len(rows)), targets]  # [r]
        self.logprobs[begin:end] = chosen - log_norm
        self.ranks[begin:end] = (rows > chosen[:, None]).sum(axis=1) + 1
        if self.top_k:
            k = self.top_k
            ids = np.argpartition(-rows, k - 1, axis=1)[:, :k]  # [r, k], unordered
            values = np.take_along_axis(rows, ids, axis=1)  # [r, k]
            order = np.argsort(-values, axis=1, kind="stable")
            self.top_ids[begin:end] = np.take_along_axis(ids, order, axis=1)
            self.top_logprobs[begin:end] = np.take_along_axis(values, order, axis=1) - log_norm[:, None]

    def entries(self, piece: Callable[[int], str]) -> tuple[Logprob, ...]:
        """One Logprob per prompt token after the first (which has no context to be scored in)."""
        return tuple(
            Logprob(int(self.tokens[i + 1]), float(self.logprobs[i]), piece(int(self.tokens[i + 1])),
                    tuple(TopLogprob(int(t), float(lp), piece(int(t)))
                          for t, lp in zip(self.top_ids[i], self.top_logprobs[i])))
            for i in range(len(self.logprobs)))

    def frame(self, request_id: str, detokenize: Callable[[list[int]], str]) -> PromptLogprobs:
        """The worker's report to the gateway; each distinct token detokenized once."""
        pieces: dict[int, str] = {}

        def piece(token: int) -> str:
            if token not in pieces:
                pieces[token] = detokenize([token])
            return pieces[token]
        return PromptLogprobs(request_id, tuple(int(t) for t in self.tokens),
                              tuple(piece(int(t)) for t in self.tokens), self.entries(piece),
                              tuple(int(r) for r in self.ranks))
