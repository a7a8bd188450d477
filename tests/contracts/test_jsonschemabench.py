"""The grammar engine against JSONSchemaBench's public schemas (shared/jsonschemabench beside the repository, or
$JSONSCHEMABENCH): through contracts.grammar and the embedded model's vocabulary, every valid instance of a compiled
schema is accepted and every invalid one rejected, each fed as the engine writes JSON (bench/grammar_bench.py:
json.dumps, ", " and ": "), token by token through the mask. Schemas the engine refuses (a keyword it cannot
enforce) are counted, and the count is pinned: an engine that starts refusing more, or passing what it cannot
enforce, fails here."""

import json

import llama_cpp
import numpy as np
import pytest

from contracts.grammar import GrammarError, build_grammar, compile_matcher
from public_schemas import schemas_dir

DATA = schemas_dir()
SAMPLE_EVERY = 10  # the fast test takes every 10th schema by name
# Valid instances the engine cannot write: their keys come in another order than the schema's properties, and the
# grammar writes properties in the schema's order (a stricter output, never an invalid one)
KEY_ORDER = {("Github_medium---o57617", 0), ("Github_medium---o57617", 1), ("Snowplow---sp_163_Normalized", 4)}
REFUSED_ALL = 77  # of 1021: oneOf with overlapping branches, not, dependencies, uniqueItems, unknown formats, ...
REFUSED_SAMPLE = 4  # of the 103 in the sample

pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"JSONSchemaBench is not at {DATA}")


@pytest.fixture(scope="module")
def vocabulary(embedded_model_path):
    """llguidance's view of the embedded GGUF's vocabulary, as the prefill worker builds it (the engine's agrees
    token for token: tests/prefill_cpu/test_first_token_grammar.py)."""
    from prefill_cpu.grammar import FirstTokenGrammars
    llm = llama_cpp.Llama(embedded_model_path, vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    stops = tuple(t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t))
    yield FirstTokenGrammars(vocab, stops).tokenizer(), stops
    llm.close()


def cases(every: int = 1):
    paths = sorted(DATA.glob("*.json"))[::every]
    return [(p.stem, json.loads(p.read_text())) for p in paths]


def accepts(matcher, tokens: list[int], stops: tuple[int, ...], mask: np.ndarray) -> bool:
    """Each token allowed by the mask and taken, then an end token allowed."""
    try:
        for token in tokens:
            matcher.fill_bitmask(mask.ctypes.data, mask.nbytes)
            if not (int(mask[token >> 5]) >> (token & 31)) & 1 or not matcher.accept_token(token):
                return False
        matcher.fill_bitmask(mask.ctypes.data, mask.nbytes)
    except GrammarError:
        return False
    return any((int(mask[t >> 5]) >> (t & 31)) & 1 for t in stops)


def judge(vocabulary, schemas) -> tuple[int, list[tuple[str, int, bool]]]:
    """(schemas refused, [(schema, instance, valid)] judged wrongly)."""
    tokenizer, stops = vocabulary
    mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # [words]
    refused, wrong = 0, []
    for name, case in schemas:
        source = json.dumps(case["schema"])
        try:
            build_grammar("json_schema", source)  # the gateway's check
            compiled = compile_matcher(tokenizer, "json_schema", source, stops)
        except GrammarError:
            refused += 1
            continue
        for index, test in enumerate(case["tests"]):
            text = json.dumps(test["data"], ensure_ascii=False)
            tokens = tokenizer.tokenize_str(text)
            if accepts(compiled.copy(), tokens, stops, mask) != test["valid"]:
                wrong.append((name, index, test["valid"]))
    return refused, wrong


def check(refused: int, wrong, expected_refused: int) -> None:
    unsound = [w for w in wrong if not w[2]]
    assert unsound == [], f"invalid instances accepted: {unsound}"
    assert {(name, index) for name, index, _ in wrong} <= KEY_ORDER, f"valid instances rejected: {wrong}"
    assert refused == expected_refused


def test_a_sample_of_the_public_schemas(vocabulary):
    schemas = cases(SAMPLE_EVERY)
    refused, wrong = judge(vocabulary, schemas)
    check(refused, wrong, REFUSED_SAMPLE)


@pytest.mark.slow
def test_every_public_schema(vocabulary):
    schemas = cases()
    assert len(schemas) == 1021 and sum(len(c["tests"]) for _, c in schemas) == 1424 + 2056
    refused, wrong = judge(vocabulary, schemas)
    check(refused, wrong, REFUSED_ALL)
    assert {(name, index) for name, index, _ in wrong} == KEY_ORDER
