"""Grammar engines on JSONSchemaBench: soundness first, then speed (docs/structured_outputs.md).

    .venv/bin/python -m bench.grammar_bench [--data ../shared/jsonschemabench] [--engines llguidance,xgrammar]
                                            [--limit N] [--details FILE.json]
    .venv/bin/python -m bench.grammar_bench --step-batches 16,32 [--limit N] [--steps 300]

Each schema is compiled as the service compiles it, with the embedded model's tokenizer (SmolLM2-135M: the
GGUF's tokenizer as the decode engine converts and caches it). Each of its instances is then fed as text:
json.dumps(data, ensure_ascii=False), i.e. ", " between items and ": " after keys and no other whitespace, the
one spelling both engines' JSON grammars allow as configured (no free whitespace). The text is tokenized, and
token by token the engine computes the mask (timed) and must allow the token and take it; at the end it must allow
an end-of-sequence token. An instance is accepted when all of that holds.

Per engine: schemas compiled or refused; among the instances of compiled schemas, invalid ones accepted (unsound:
the engine would let output through that breaks the schema) and valid ones rejected (too strict); schemas fully
correct (compiled, every instance judged right); compile time p50/p99 over all schemas; mask time per token.

--step-batches: the mask's cost per decode step instead, as the engine pays it (decode_gpu.sample.structured):
B constrained sequences side by side, each writing a valid instance of its schema token by token; per step every
row's mask is filled into one [B, words] int32 array, then every row takes its token; a sequence that ends gives
its row to the next instance. Only instances every engine accepts, of schemas every engine compiles, so each engine
does the same work; compiles and matcher starts are outside the timing. llguidance-par fills the batch with
llguidance's own thread pool (LLExecutor) instead of row by row.
  llguidance  the project's engine: contracts.grammar (the gateway's check, then the matcher's compile over the
              vocabulary), strict (unsupported keywords refused), separators ", " and ": ".
  xgrammar    0.2.9 as this project configured it before: Grammar.from_json_schema(any_whitespace=False), strict
              mode, compiled by a GrammarCompiler over TokenizerInfo.from_huggingface. Skipped if not installed.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "shared" / "jsonschemabench"  # shared/ beside the repository


def load_schemas(data: Path, limit: int | None = None) -> list[tuple[str, str, list[tuple[bool, object]]]]:
    """(name, schema as JSON text, [(valid, instance)]) per file, in name order."""
    cases = []
    for path in sorted(data.glob("*.json")):
        case = json.loads(path.read_text())
        cases.append((path.stem, json.dumps(case["schema"]), [(t["valid"], t["data"]) for t in case["tests"]]))
    return cases[:limit] if limit else cases


def instance_text(data) -> str:
    """An instance as the engine writes JSON (see the module docstring)."""
    return json.dumps(data, ensure_ascii=False)


def hf_tokenizer():
    """The embedded model's transformers tokenizer, as the decode engine loads it (converted once, cached)."""
    from contracts.identity import read_gguf_identity
    from decode_gpu.model.loader import load_tokenizer
    from prefill_cpu.embedded_model import embedded_model_path
    return load_tokenizer(read_gguf_identity(embedded_model_path()))


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stops: tuple[int, ...]) -> None:
        import llguidance

        from decode_gpu.sample.structured import llg_tokenizer
        self.version = llguidance.__version__
        self._tokenizer = llg_tokenizer(tokenizer, vocab_size, stops)
        self._stops = stops

    def compile(self, schema: str):
        from contracts.grammar import build_grammar, compile_matcher
        build_grammar("json_schema", schema)  # the gateway's check
        return compile_matcher(self._tokenizer, "json_schema", schema, self._stops)

    def start(self, compiled):
        return compiled.copy()

    def fill(self, matcher, mask: np.ndarray) -> None:  # mask: [1, words] int32
        matcher.fill_bitmask(mask.ctypes.data, mask.nbytes)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_batch(self, matchers: list, mask: np.ndarray) -> None:  # mask: [B, words] int32, as the engine does
        row_bytes = mask.shape[1] * 4
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(mask.ctypes.data + row * row_bytes, row_bytes)


class LLGuidanceParallel(LLGuidanceEngine):
    """llguidance with the batch's masks filled by its own thread pool (not what the engine does today)."""
    name = "llguidance-par"

    def __init__(self, tokenizer, vocab_size: int, stops: tuple[int, ...]) -> None:
        import llguidance
        super().__init__(tokenizer, vocab_size, stops)
        self._executor = llguidance.LLExecutor()

    def fill_batch(self, matchers: list, mask: np.ndarray) -> None:
        self._executor.unsafe_compute_mask_ptr([(m._matcher, row) for row, m in enumerate(matchers)],
                                               mask.ctypes.data, mask.shape[1] * 4, mask.shape[0])


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stops: tuple[int, ...]) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.version = importlib.metadata.version("xgrammar")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: str):
        grammar = self._xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        return self._compiler.compile_grammar(grammar)

    def start(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher, mask: np.ndarray) -> None:
        import torch
        matcher.fill_next_token_bitmask(torch.from_numpy(mask))

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_batch(self, matchers: list, mask: np.ndarray) -> None:  # mask: [B, words] int32
        import torch
        target = torch.from_numpy(mask)
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(target, row)


ENGINES = {"llguidance": LLGuidanceEngine, "llguidance-par": LLGuidanceParallel, "xgrammar": XGrammarEngine}


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[0, token >> 5]) >> (token & 31)) & 1)


def feed(engine, compiled, tokens: list[int], stops: tuple[int, ...], mask: np.ndarray,
         mask_times: list[float]) -> bool:
    """Whether the engine lets this token sequence through and then lets it end."""
    matcher = engine.start(compiled)
    try:
        for token in tokens:
            started = time.perf_counter()
            engine.fill(matcher, mask)
            mask_times.append(time.perf_counter() - started)
            if not allowed(mask, token) or not engine.accept(matcher, token):
                return False
        engine.fill(matcher, mask)
        return any(allowed(mask, stop) for stop in stops)
    except Exception:  # a matcher error rejects
        return False


def run_engine(engine, cases, encode, stops: tuple[int, ...], vocab_size: int) -> dict:
    mask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)  # [1, words]
    compile_times, mask_times, reasons = [], [], collections.Counter()
    result = dict(engine=engine.name, version=engine.version, schemas=len(cases), compiled=0, refused=0,
                  valid=0, invalid=0, invalid_accepted=0, valid_rejected=0, fully_correct=0, failures=[])
    for name, schema, tests in cases:
        started = time.perf_counter()
        try:
            compiled = engine.compile(schema)
        except Exception as err:
            compile_times.append(time.perf_counter() - started)
            result["refused"] += 1
            reasons[str(err).split(":", 1)[-1].strip()[:90]] += 1
            continue
        compile_times.append(time.perf_counter() - started)
        result["compiled"] += 1
        correct = True
        for index, (valid, data) in enumerate(tests):
            accepted = feed(engine, compiled, encode(instance_text(data)), stops, mask, mask_times)
            result["valid" if valid else "invalid"] += 1
            if accepted != valid:
                correct = False
                result["invalid_accepted" if accepted else "valid_rejected"] += 1
                result["failures"].append(dict(schema=name, instance=index, valid=valid))
        result["fully_correct"] += correct
    result.update(compile_p50_ms=_pct(compile_times, 50) * 1e3, compile_p99_ms=_pct(compile_times, 99) * 1e3,
                  mask_p50_us=_pct(mask_times, 50) * 1e6, mask_p99_us=_pct(mask_times, 99) * 1e6,
                  masks=len(mask_times), refusals=reasons.most_common(12))
    return result


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def print_table(results: list[dict]) -> None:
    print("| engine | schemas | compiled | refused | invalid accepted | valid rejected | fully correct | "
          "compile p50 / p99 ms | mask per token p50 / p99 us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} {r['version']} | {r['schemas']} | {r['compiled']} | {r['refused']} | "
              f"{r['invalid_accepted']} of {r['invalid']} | {r['valid_rejected']} of {r['valid']} | "
              f"{r['fully_correct']} | {r['compile_p50_ms']:.2f} / {r['compile_p99_ms']:.1f} | "
              f"{r['mask_p50_us']:.0f} / {r['mask_p99_us']:.0f} |")
    for r in results:
        print(f"\n{r['engine']}: most common refusals")
        for reason, count in r["refusals"]:
            print(f"  {count:4d}  {reason}")


def step_tasks(engines: list, cases, encode, stops: tuple[int, ...], vocab_size: int) -> tuple[list, list]:
    """Per engine its compiled grammars, and the (schema index, tokens) of the valid instances every engine
    accepts, of the schemas every engine compiles."""
    mask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)  # [1, words]
    compiled: list[list] = [[] for _ in engines]
    tasks = []
    for index, (_name, schema, tests) in enumerate(cases):
        try:
            grammars = [engine.compile(schema) for engine in engines]
        except Exception:
            grammars = None
        for per_engine, grammar in zip(compiled, grammars or [None] * len(engines)):
            per_engine.append(grammar)
        if grammars is None:
            continue
        for valid, data in tests:
            tokens = encode(instance_text(data))
            if valid and all(feed(e, g, tokens, stops, mask, []) for e, g in zip(engines, grammars)):
                tasks.append((index, tokens))
    return compiled, tasks


def step_cost(engine, compiled: list, tasks: list, batch: int, steps: int, vocab_size: int) -> dict:
    """Mask fill per step of `batch` rows (and fill plus every row taking its token), p50 and p99 over `steps`."""
    mask = np.zeros((batch, (vocab_size + 31) // 32), dtype=np.int32)  # [B, words]
    upcoming = itertools.cycle(tasks)

    def start():
        index, tokens = next(upcoming)
        return [engine.start(compiled[index]), tokens, 0]
    rows = [start() for _ in range(batch)]
    fills, totals = [], []
    for _ in range(steps):
        started = time.perf_counter()
        engine.fill_batch([row[0] for row in rows], mask)
        filled = time.perf_counter()
        for row in rows:
            matcher, tokens, at = row
            engine.accept(matcher, tokens[at])
            row[2] += 1
        done = time.perf_counter()
        fills.append(filled - started)
        totals.append(done - started)
        rows = [row if row[2] < len(row[1]) else start() for row in rows]
    return dict(engine=engine.name, version=engine.version, batch=batch, fill_p50_ms=_pct(fills, 50) * 1e3,
                fill_p99_ms=_pct(fills, 99) * 1e3, total_p50_ms=_pct(totals, 50) * 1e3,
                row_us=_pct(fills, 50) * 1e6 / batch)


def print_step_table(results: list[dict], n_tasks: int, n_schemas: int) -> None:
    print(f"{n_tasks} valid instances of {n_schemas} schemas, every engine accepting them")
    print("| engine | batch | mask per step p50 / p99 ms | per row p50 us | mask + accept per step p50 ms |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} {r['version']} | {r['batch']} | {r['fill_p50_ms']:.2f} / {r['fill_p99_ms']:.2f} | "
              f"{r['row_us']:.0f} | {r['total_p50_ms']:.2f} |")


def main_steps(args, tokenizer, engines: list) -> None:
    vocab_size, stops = len(tokenizer), (tokenizer.eos_token_id,)
    cases = load_schemas(args.data, args.limit)
    compiled, tasks = step_tasks(engines, cases, lambda text: tokenizer.encode(text, add_special_tokens=False),
                                 stops, vocab_size)
    results = [step_cost(engine, grammars, tasks, int(batch), args.steps, vocab_size)
               for batch in args.step_batches.split(",") for engine, grammars in zip(engines, compiled)]
    print_step_table(results, len(tasks), len({index for index, _ in tasks}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--limit", type=int, default=None, help="the first N schemas only")
    parser.add_argument("--details", type=Path, default=None, help="write every result, failures included, here")
    parser.add_argument("--step-batches", default=None, help="e.g. 16,32: the mask's cost per decode step instead")
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed per engine and batch")
    args = parser.parse_args()
    if args.step_batches:
        tokenizer = hf_tokenizer()
        engines = []
        for name in args.engines.split(","):
            try:
                engines.append(ENGINES[name](tokenizer, len(tokenizer), (tokenizer.eos_token_id,)))
            except ImportError as err:
                print(f"{name}: not installed ({err}); skipped")
        main_steps(args, tokenizer, engines)
        return
    cases = load_schemas(args.data, args.limit)
    tokenizer = hf_tokenizer()
    vocab_size, stops = len(tokenizer), (tokenizer.eos_token_id,)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    results = []
    for name in args.engines.split(","):
        try:
            engine = ENGINES[name](tokenizer, vocab_size, stops)
        except ImportError as err:
            print(f"{name}: not installed ({err}); skipped")
            continue
        started = time.perf_counter()
        results.append(run_engine(engine, cases, encode, stops, vocab_size))
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    print_table(results)
    if args.details:
        args.details.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
