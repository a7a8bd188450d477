"""N-gram speculative decoding on the CPU: decode tok/s and acceptance with speculation on and off, side by side.

    .venv/bin/python -m bench.spec_bench [--batches 1,4] [--tokens 128] [--k 4] [--weights auto,bfloat16]

The embedded model (SmolLM2-135M-Instruct), greedy, weights as `edge serve --weight-dtype X` loads them on the
CPU (auto: int8 here, the fastest plain step; bfloat16 verifies several tokens per sequence for less). Two
workloads, each a chat prompt per sequence (batch b: the first b prompts of the workload):
  repetitive      a function in the prompt, and the request to return it with one name changed: the answer
                  quotes the prompt's code, which prompt lookup finds
  non-repetitive  open questions answered in prose
Prefill (llama.cpp) happens before the clock starts; the clock covers every decode step after the first (the
first imports the handoffs). tok/s counts generated tokens, the best of --repeats runs of each mode, off and on
alternating (the machine is shared); acceptance is accepted / proposed draft tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from contracts.handoff import SamplingParams
from decode_gpu.device import resolve_dtype
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.model_loader import load_tokenizer
from decode_gpu.model_runner import ModelRunner, RunnerConfig
from decode_gpu.scheduler import SchedulerConfig
from decode_gpu.speculative import SpecConfig
from decode_gpu.weight_quant import FLOAT_WEIGHTS, load_weights
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

FUNCTIONS = [
    "def moving_average(values, window):\n    total = 0.0\n    result = []\n    for index, value in enumerate(values):\n"
    "        total += value\n        if index >= window:\n            total -= values[index - window]\n"
    "        if index >= window - 1:\n            result.append(total / window)\n    return result\n",
    "def count_words(text):\n    counts = {}\n    for line in text.splitlines():\n        for word in line.split():\n"
    "            word = word.strip('.,;:!?').lower()\n            if word:\n                counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda item: item[1], reverse=True)\n",
    "def merge_intervals(intervals):\n    intervals = sorted(intervals)\n    merged = []\n    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n            merged.append([start, end])\n    return merged\n",
    "def parse_config(path):\n    settings = {}\n    with open(path) as handle:\n        for line in handle:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
    "            key, _, value = line.partition('=')\n            settings[key.strip()] = value.strip()\n    return settings\n",
]
RENAMES = ["result", "counts", "merged", "settings"]
QUESTIONS = ["Why do people enjoy walking in the mountains?", "What makes a good teacher?",
             "How did the invention of the printing press change Europe?", "What should I pack for a week of camping?"]


def prompts(workload: str) -> list[list[dict]]:
    if workload == "repetitive":
        return [[{"role": "user", "content": f"Here is a Python function:\n```python\n{code}```\nReturn the whole "
                  f"function again with the variable `{name}` renamed to `output`. Reply with the code only."}]
                for code, name in zip(FUNCTIONS, RENAMES)]
    return [[{"role": "user", "content": question}] for question in QUESTIONS]


def handoffs(prefiller: Prefiller, tokenizer, workload: str, batch: int, max_tokens: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)  # every run makes max_tokens
    out = []
    for i, messages in enumerate(prompts(workload)[:batch]):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tuple(prefiller.tokenize(text, add_special=False))
        out.append(prefiller.prefill(PrefillRequest(f"{workload}{i}", tokens, params)).handoff)
    return out


def run(model, identity, handoffs_: list, spec: SpecConfig) -> dict:
    runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=4096, num_speculative_tokens=spec.num_speculative_tokens),
                         torch.device("cpu"))
    engine = DecodeEngine(runner, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8), speculative=spec))
    outputs: dict[str, list[int]] = {}
    for handoff in handoffs_:
        for event in engine.add(handoff):
            outputs.setdefault(event.request_id, []).extend(event.token_ids)

    def step() -> None:
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)

    step()  # imports the handoffs
    counted, started = sum(map(len, outputs.values())), time.perf_counter()
    while engine.has_work:
        step()
    seconds = time.perf_counter() - started
    stats = engine.stats()
    drafted = stats.num_spec_draft_tokens
    return dict(tok_s=(sum(map(len, outputs.values())) - counted) / seconds, outputs=outputs,
                acceptance=stats.num_spec_accepted_tokens / drafted if drafted else None, drafts=stats.num_spec_drafts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per sequence")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--weights", default="auto,bfloat16", help="--weight-dtype values to compare")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    prefiller = Prefiller(PrefillConfig(args.model or embedded_model_path(), n_ctx=1024, kv_type="f16"))
    identity = prefiller.identity
    tokenizer = load_tokenizer(identity)
    cpu = torch.device("cpu")
    work = {(w, b): handoffs(prefiller, tokenizer, w, b, args.tokens) for w in ("repetitive", "non-repetitive")
            for b in batches}
    prefiller.close()
    on = SpecConfig(method="ngram", num_speculative_tokens=args.k)
    print(f"\nN-gram speculative decoding on the CPU ({torch.get_num_threads()} threads, greedy, {args.tokens} tokens "
          f"per sequence, K = {args.k}; same tokens: speculation changed no token)")
    print("| weights | workload | batch | tok/s off | tok/s ngram | speed-up | acceptance | drafts | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for weight_dtype in args.weights.split(","):
        float_weights = FLOAT_WEIGHTS.get(weight_dtype)
        model, report = load_weights(identity, cpu, float_weights or resolve_dtype("auto", cpu), weight_dtype,
                                     max(batches))
        rows(model, identity, work, on, args.repeats, report.weight_dtype)


def rows(model, identity, work: dict, on: SpecConfig, repeats: int, weights: str) -> None:
    for (workload, batch), hs in work.items():
        runs = [(run(model, identity, hs, SpecConfig()), run(model, identity, hs, on)) for _ in range(repeats)]
        off = max((r[0] for r in runs), key=lambda r: r["tok_s"])
        spec = max((r[1] for r in runs), key=lambda r: r["tok_s"])
        acceptance = f"{spec['acceptance']:.2f}" if spec["acceptance"] is not None else "-"
        print(f"| {weights} | {workload} | {batch} | {off['tok_s']:.1f} | {spec['tok_s']:.1f} | {spec['tok_s'] / off['tok_s']:.2f}x "
              f"| {acceptance} | {spec['drafts']} | {'yes' if spec['outputs'] == off['outputs'] else 'no'} |",
              flush=True)


if __name__ == "__main__":
    main()
