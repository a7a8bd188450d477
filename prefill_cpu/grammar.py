"""The first output token's grammar matcher in the prefill worker, over llama.cpp's own vocabulary (its bitmask is
applied by the shared sampler, sampling.token_mask), and that vocabulary for the gateway's check (GGUFVocabulary:
the tokenizer alone, no weights).

The decode engine masks every later token with the same constraint (decode_gpu.sample.structured); both build
llguidance's view of the vocabulary from the same GGUF (here through llama.cpp, there through the converted
transformers tokenizer) and agree token for token (tests/prefill_cpu/test_first_token_grammar.py).
Compiles run in a small bounded pool under a time limit (contracts.grammar_compile), the grammar made in a compile
process that is killed at the limit: a constraint too slow to compile fails its request (GrammarTooComplexError)
instead of holding the prefill thread or a core. `prepare` lets the
worker start a request's compile when the job arrives, before the prompt waits for the llama.cpp context.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings

from contracts.compile_processes import CompileProcesses
from contracts.grammar import Matcher
from contracts.grammar_compile import CompiledGrammars, CompilePool, downstream_timeout_s

log = logging.getLogger(__name__)
COMPILED_GRAMMARS = 64  # compiled grammars kept per worker context (by cache salt and constraint), least recently
# used dropped


def vocabulary_tokenizer(vocab, stop_token_ids: tuple[int, ...]):
    """llguidance's LLTokenizer of a llama.cpp vocabulary (under a second for 49k tokens): each token's bytes as
    llama.cpp renders them; control tokens are special, never inside a grammar's text; the stop tokens end a
    complete grammar. It keeps a pointer to the vocabulary: the llama.cpp model must outlive it."""
    from llguidance.llamacpp import lltokenizer_from_vocab
    started = time.perf_counter()
    with warnings.catch_warnings():  # it asks llama_token_get_attr, deprecated, once per token
        warnings.simplefilter("ignore", DeprecationWarning)
        tokenizer = lltokenizer_from_vocab(vocab, eos_token=[int(t) for t in stop_token_ids])
    log.info("structured outputs: llguidance tokenizer for %d tokens in %.3f s", tokenizer.vocab_size,
             time.perf_counter() - started)
    return tokenizer


class GGUFVocabulary:
    """A GGUF's vocabulary without its weights (llama.cpp loads the tokenizer only, in well under a second), for a
    process with no model loaded: the gateway compiles constraints against what its workers will use."""

    def __init__(self, path: str) -> None:
        import llama_cpp
        self._llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)  # kept: the tokenizer points into it
        vocab = self._llm._model.vocab
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.stop_token_ids = tuple(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
        self.tokenizer = vocabulary_tokenizer(vocab, self.stop_token_ids)


class FirstTokenGrammars:
    """One per llama.cpp context. vocab: the llama_vocab pointer; stop_token_ids: the end-of-generation tokens.
    timeout_s: the compile limit, by default the gateway's with the downstream margin (the gateway checked the
    constraint over this vocabulary already)."""

    def __init__(self, vocab, stop_token_ids: tuple[int, ...], timeout_s: float | None = None,
                 pool: CompilePool | None = None) -> None:
        self._vocab = vocab
        self._stops = tuple(int(t) for t in stop_token_ids)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.compiled = CompiledGrammars(self.tokenizer, self._stops, timeout_s or downstream_timeout_s(),
                                         pool or CompilePool(workers=1, capacity=4, name="prefill-grammar"),
                                         COMPILED_GRAMMARS, CompileProcesses(workers=1))

    def tokenizer(self):
        """Built once, by the first compile: workers that never see a structured request do not pay for it."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = vocabulary_tokenizer(self._vocab, self._stops)
            return self._tokenizer

    def prepare(self, structured: tuple[str, str] | None, cache_salt: str = "") -> None:
        """Start compiling a request's constraint (any thread, no waiting); a failure shows in matcher().
        cache_salt: the request's (PrefillJob.cache_salt): only its salt's compiles are reused."""
        if structured is not None:
            try:
                self.compiled.prepare(*structured, cache_salt)
            except Exception:  # busy: matcher() will say so
                pass

    def matcher(self, structured: tuple[str, str] | None, cache_salt: str = "") -> Matcher | None:
        """A fresh matcher of a request's constraint (None without one), from a compile of its cache salt only;
        GrammarError when it does not compile, GrammarTooComplexError past the time limit."""
        return None if structured is None else self.compiled.matcher(*structured, cache_salt)
