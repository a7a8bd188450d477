"""The decode engine's side of structured outputs (decode_gpu.sample.structured) with the embedded model's
tokenizer: matchers advance and end as the engine expects, the batch bitmask masks exactly the constrained rows,
a matcher that errs fails its row with a clear error, and a compile past the time limit is refused."""

import json
import time

import pytest
import torch

from contracts.grammar import GrammarError, GrammarTooComplexError
from decode_gpu.sample.structured import Grammars
from sampling.token_mask import apply_mask

pytestmark = pytest.mark.slow  # the embedded model's tokenizer, converted once per session
SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                     "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer(embedded_model_path, conversion_cache):
    from contracts.identity import read_gguf_identity
    from decode_gpu.model.loader import load_tokenizer
    return load_tokenizer(read_gguf_identity(embedded_model_path), conversion_cache)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


def test_a_matcher_takes_the_text_and_ends_on_the_end_token(grammars, tokenizer):
    matcher = grammars.matcher("json_schema", SCHEMA)
    for token in tokenizer.encode('{"n": 12}', add_special_tokens=False):
        assert not matcher.is_terminated() and matcher.accept_token(token)
    rows, mask = grammars.bitmask([matcher], torch.device("cpu"))
    assert rows == [0] and allowed(mask, 0, tokenizer.eos_token_id)
    assert sum(allowed(mask, 0, t) for t in range(len(tokenizer))) == 1  # the object is complete: only the end
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_the_mask_touches_the_constrained_rows_only(grammars, tokenizer):
    matchers = [None, grammars.matcher("regex", "[0-9]+"), None]
    token_mask = grammars.bitmask(matchers, torch.device("cpu"))
    scores = torch.randn(3, len(tokenizer))  # [3, vocab]
    before = scores.clone()
    apply_mask(scores, token_mask)
    assert torch.equal(scores[0], before[0]) and torch.equal(scores[2], before[2])
    kept = torch.isfinite(scores[1]).nonzero().flatten().tolist()
    assert kept and all(tokenizer.decode([t]).isdigit() for t in kept)
    assert torch.equal(scores[1][kept], before[1][kept])


def test_a_matcher_that_erred_fails_its_row_naming_why(grammars, tokenizer):
    matcher = grammars.matcher("regex", "[0-9]+")
    letters = tokenizer.encode("abc", add_special_tokens=False)[0]
    assert not matcher.accept_token(letters)  # what the engine reports as outside the grammar
    with pytest.raises(GrammarError, match="grammar failed"):
        grammars.bitmask([None, matcher], torch.device("cpu"))


def test_a_compiled_grammar_is_reused_and_each_sequence_gets_its_own_matcher(grammars):
    first, second = grammars.matcher("regex", "[a-z]+"), grammars.matcher("regex", "[a-z]+")
    assert first is not second and grammars.prepare("regex", "[a-z]+").done()


def test_a_compile_past_the_time_limit_is_stopped_and_does_not_hold_the_engine(tokenizer):
    explosive = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {
        "type": "string", "pattern": f"^(x+x+)+y{{{i},{i + 30}}}$"}}} for i in range(9)]} for j in range(4)]}
    grammars = Grammars(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), timeout_s=0.2)
    grammars.matcher("regex", "[0-9]+")  # the compile process started
    started = time.perf_counter()
    with pytest.raises(GrammarTooComplexError, match="longer than the limit of 0.2 s"):
        grammars.matcher("json_schema", json.dumps(explosive))
    # 5 s leaves a busy machine room and still catches a caller left waiting far past its 0.2 s
    assert time.perf_counter() - started < 5.0
    # killed at the limit (let run, it would end by itself as too complex, never killed); by the pool's thread,
    # which a busy machine may run after the caller stopped waiting (0.5 s past the limit): polled for
    processes, deadline = grammars.compiled._processes, time.monotonic() + 30.0
    while processes.killed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert processes.killed == 1
    # a new process takes its place: the compile below waits for its start (imports, seconds on a busy machine)
    # and runs in it at nice 10, so its limit is made generous
    grammars.compiled.timeout_s = 30.0
    assert grammars.matcher("json_schema", SCHEMA)
    assert processes.killed == 1 and processes.state()["compiles"] == 3
    grammars.compiled.close()


def test_a_schema_that_does_not_compile_is_a_grammar_error(grammars):
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammars.matcher("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
