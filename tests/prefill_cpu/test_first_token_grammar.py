"""Structured outputs on the first token, which the prefill worker samples (prefill_cpu.first_token).

The constraint must hold from the first token on: a first token outside the grammar would be a reply the decode
engine can no longer complete. The embedded SmolLM2 is used because a random tiny GGUF's vocabulary means nothing
to a grammar; the prompts make the model's unconstrained favourite a token the grammar forbids.
"""

import json

import llama_cpp
import numpy as np
import pytest

from contracts.grammar import GrammarError
from contracts.handoff import SamplingParams
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
from sampling.token_mask import matcher_bitmask

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
CHOICES = ["Paris", "London"]
SEEDS = range(6)
SMOLLM2_VOCAB = 49152  # the rows of its lm_head, control tokens included


@pytest.fixture(scope="module")
def prefiller(embedded_model_path):
    prefiller = Prefiller(PrefillConfig(embedded_model_path, n_ctx=512, n_batch=128, n_threads=2, kv_type="f16"))
    yield prefiller
    prefiller.close()


def first(prefiller: Prefiller, text: str, **sampling):
    tokens = tuple(prefiller.tokenize(text))
    return prefiller.prefill(PrefillRequest("r", tokens, SamplingParams(**sampling))).handoff


def text_of(prefiller: Prefiller, token: int) -> str:
    return prefiller.llm.detokenize([token]).decode("utf-8", errors="replace")


def greedy_and_sampled(prefiller: Prefiller, text: str, structured: tuple[str, str]) -> list[str]:
    """The first token's text, greedy and at temperature 1 with several seeds."""
    runs = [dict(temperature=0.0)] + [dict(temperature=1.0, seed=s) for s in SEEDS]
    return [text_of(prefiller, first(prefiller, text, structured=structured, **run).first_token) for run in runs]


def allowed_texts(prefiller: Prefiller, structured: tuple[str, str]) -> list[str]:
    """Every token the grammar admits first: the bitmask the worker's sampler masks the first token with."""
    mask = matcher_bitmask(prefiller.grammars.matcher(structured), prefiller.vocab_size)[0].numpy()  # [words] int32
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:prefiller.vocab_size]  # [vocab]
    return [text_of(prefiller, int(t)) for t in np.flatnonzero(allowed)]


def test_unconstrained_favourite_is_forbidden(prefiller):
    """The premise of the tests below: without a constraint the model starts its answer with a space."""
    assert text_of(prefiller, first(prefiller, PROMPT, temperature=0.0).first_token) == " Paris"


def test_choice(prefiller):
    structured = ("choice", json.dumps(CHOICES))
    for text in greedy_and_sampled(prefiller, PROMPT, structured):
        assert text and any(c.startswith(text) for c in CHOICES), text
    assert all(any(c.startswith(t) for c in CHOICES) for t in allowed_texts(prefiller, structured))


def test_regex_digits(prefiller):
    for text in greedy_and_sampled(prefiller, PROMPT, ("regex", "[0-9]+")):
        assert text.isdigit() and text.isascii(), text


def test_json_object_starts_with_a_brace(prefiller):
    prompt = 'Answer with JSON: {"city": "Paris"}. The capital of Italy as JSON:'
    for text in greedy_and_sampled(prefiller, prompt, ("json_object", "")):
        assert text.lstrip(" \n\r\t").startswith("{"), text


def test_json_object_admits_no_array(prefiller):
    assert all(t.lstrip(" \n\r\t").startswith("{") for t in allowed_texts(prefiller, ("json_object", "")))


def test_json_schema_array(prefiller):
    schema = json.dumps({"type": "array", "items": {"type": "integer"}})
    for text in greedy_and_sampled(prefiller, PROMPT, ("json_schema", schema)):
        assert text.startswith("["), text


def test_grammar_masks_after_logit_bias(prefiller):
    """A bias cannot bring back a token the grammar forbids: the mask comes last."""
    paris = first(prefiller, PROMPT, temperature=0.0).first_token
    handoff = first(prefiller, PROMPT, temperature=0.0, logit_bias=((paris, 100.0),), structured=("regex", "[0-9]+"))
    assert text_of(prefiller, handoff.first_token).isdigit()


def test_logprobs_stay_raw(prefiller):
    """The reported logprobs are of the model's own distribution, not of the masked and renormalized one."""
    unconstrained = first(prefiller, PROMPT, temperature=0.0)
    # greedy reads llama.cpp's logits without changing them: after a run without controls they are the raw ones
    raw = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(prefiller.ctx, -1), shape=(prefiller.vocab_size,))
    raw = raw.astype(np.float64)  # [vocab]
    raw_logprobs = raw - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))  # [vocab]
    constrained = first(prefiller, PROMPT, temperature=0.0, logprobs=2, structured=("regex", "[0-9]+"))
    token = constrained.first_token
    assert token != unconstrained.first_token and text_of(prefiller, token).isdigit()
    assert constrained.first_logprob == pytest.approx(raw_logprobs[token], abs=1e-4)
    # a digit is far from the model's choice: renormalized over the digits it would be near 0
    assert constrained.first_logprob < -3
    top = [t for t, _ in constrained.first_top_logprobs]
    assert top == [int(t) for t in np.argsort(-raw_logprobs)[:2]]
    assert unconstrained.first_token == top[0]
    for t, lp in constrained.first_top_logprobs:
        assert lp == pytest.approx(raw_logprobs[t], abs=1e-4)


def test_grammar_vocabulary_is_llama_cpps(prefiller):
    """The grammar sees each token as the text llama.cpp gives the client; control tokens are never text, and the
    end-of-generation tokens end a complete grammar."""
    tokenizer = prefiller.grammars.tokenizer()
    assert tokenizer.vocab_size == prefiller.vocab_size == SMOLLM2_VOCAB
    assert tokenizer is prefiller.grammars.tokenizer()  # built once
    vocab = prefiller.llm._model.vocab
    control = [t for t in range(SMOLLM2_VOCAB) if llama_cpp.llama_vocab_is_control(vocab, t)]
    assert control and all(tokenizer.is_special_token(t) for t in control)
    assert sorted(tokenizer.eos_tokens) == [t for t in range(SMOLLM2_VOCAB) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    for t in (17, 1000, 20000, SMOLLM2_VOCAB - 1):
        assert tokenizer.decode_bytes([t]) == prefiller.llm.detokenize([t])


def test_the_engine_sees_the_same_vocabulary(prefiller, embedded_model_path):
    """The decode engine builds its grammar vocabulary from the converted transformers tokenizer: every token's
    bytes and special-ness agree, so the engine's matcher takes the first token the worker's mask allowed."""
    from contracts.identity import read_gguf_identity
    from decode_gpu.model.loader import load_tokenizer
    from decode_gpu.sample.structured import llg_tokenizer
    ours = prefiller.grammars.tokenizer()
    tokenizer = load_tokenizer(read_gguf_identity(embedded_model_path))
    engine = llg_tokenizer(tokenizer, SMOLLM2_VOCAB, tuple(ours.eos_tokens))
    differ = [t for t in range(SMOLLM2_VOCAB) if ours.decode_bytes([t]) != engine.decode_bytes([t])
              or ours.is_special_token(t) != engine.is_special_token(t)]
    assert differ == []


def test_compiled_grammars_are_reused(prefiller):
    structured = ("regex", "[a-z]+")
    first(prefiller, PROMPT, temperature=0.0, structured=structured)
    compiled = prefiller.grammars.compiled.prepare(*structured)
    first(prefiller, PROMPT, temperature=0.0, structured=structured)
    assert prefiller.grammars.compiled.prepare(*structured) is compiled and compiled.done()
    assert prefiller.grammars.matcher(structured) is not prefiller.grammars.matcher(structured)  # a copy each


def test_a_grammar_is_reused_by_requests_of_its_own_cache_salt_only(prefiller, monkeypatch):
    """A constraint one tenant's request compiled (PrefillRequest.cache_salt, the job's) is compiled again for
    another tenant's: a grammar it found compiled would tell it someone sent that constraint."""
    compiled, compiles = prefiller.grammars.compiled, []
    compile_once = compiled._compile

    def counted(kind: str, source: str):
        compiles.append(source)
        return compile_once(kind, source)
    monkeypatch.setattr(compiled, "_compile", counted)
    structured = ("regex", "[a-z]+ per tenant")
    tokens = tuple(prefiller.tokenize(PROMPT))
    for salt in ("tenant-a", "tenant-b", "tenant-a", "tenant-b"):
        prefiller.prefill(PrefillRequest("r", tokens, SamplingParams(temperature=0.0, structured=structured),
                                         cache_salt=salt))
    assert compiles == [structured[1]] * 2


def test_an_unsupported_schema_keyword_raises_grammar_error_naming_it(prefiller):
    schema = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with pytest.raises(GrammarError, match="uniqueItems"):
        first(prefiller, PROMPT, temperature=0.0, structured=("json_schema", schema))


def test_a_bad_constraint_raises_grammar_error(prefiller):
    with pytest.raises(GrammarError):
        first(prefiller, PROMPT, temperature=0.0, structured=("regex", "[0-9"))
    # the worker is fine afterwards
    assert text_of(prefiller, first(prefiller, PROMPT, temperature=0.0, structured=("regex", "[0-9]+")).first_token)
