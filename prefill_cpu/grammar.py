"""The first output token's grammar mask in the prefill worker, over llama.cpp's own vocabulary.

The decode engine masks every later token with the same constraint (decode_gpu.sample.structured); both build
llguidance's view of the vocabulary from the same GGUF (here through llama.cpp, there through the converted
transformers tokenizer) and agree token for token (tests/prefill_cpu/test_first_token_grammar.py).
Compiles run in a small bounded pool under the compile time limit: a constraint too slow to compile fails its
request (GrammarTooComplexError) instead of holding the prefill thread.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import OrderedDict

import numpy as np

from contracts.grammar import DEFAULT_COMPILE_TIMEOUT_S, Matcher, compile_matcher
from contracts.grammar_compile import CompilePool

log = logging.getLogger(__name__)
COMPILED_GRAMMARS = 64  # compiled grammars kept per worker context, least recently used dropped


class FirstTokenGrammars:
    """One per llama.cpp context. vocab: the llama_vocab pointer; stop_token_ids: the end-of-generation tokens,
    which end a complete grammar."""

    def __init__(self, vocab, stop_token_ids: tuple[int, ...], timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 pool: CompilePool | None = None) -> None:
        self._vocab = vocab
        self._stops = tuple(int(t) for t in stop_token_ids)
        self.timeout_s = timeout_s
        self._pool = pool or CompilePool(workers=1, capacity=2, name="prefill-grammar")
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Matcher] = OrderedDict()

    def tokenizer(self):
        """llguidance's LLTokenizer of this GGUF, built once, when first asked for (under a second for 49k tokens):
        workers that never see a structured request do not pay for it. Each token's bytes as llama.cpp renders
        them; control tokens are special, never inside a grammar's text."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab
                started = time.perf_counter()
                with warnings.catch_warnings():  # it asks llama_token_get_attr, deprecated, once per token
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=list(self._stops))
                log.info("structured outputs: llguidance tokenizer for %d tokens in %.3f s",
                         self._tokenizer.vocab_size, time.perf_counter() - started)
            return self._tokenizer

    def matcher(self, structured: tuple[str, str] | None) -> Matcher | None:
        """A fresh matcher of a request's constraint (None without one); GrammarError when it does not compile,
        GrammarTooComplexError past the time limit. Clients repeat their constraints: the compiled ones stay."""
        if structured is None:
            return None
        compiled = self._compiled.get(structured)
        if compiled is None:
            compiled = self._pool.run(self.timeout_s, self._compile, structured)
            self._compiled[structured] = compiled
            if len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(structured)
        return compiled.copy()

    def _compile(self, structured: tuple[str, str]) -> Matcher:
        return compile_matcher(self.tokenizer(), *structured, self._stops)


def apply_first_mask(logits: np.ndarray, matcher: Matcher) -> None:
    """-inf on every token the grammar does not allow first, in place. # logits: [vocab] float32
    GrammarError if the matcher errs (the request fails rather than go on unconstrained)."""
    n_vocab = logits.shape[0]
    mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # [words]: bit j of word w allows token 32w + j
    matcher.fill_bitmask(mask.ctypes.data, mask.nbytes)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)  # [vocab]
    logits[~allowed] = -np.inf
