"""N-gram speculative decoding on the CPU: decode tok/s and acceptance with speculation on and off, side by side.

    .venv/bin/python -m bench.spec_bench [--batches 1,4] [--streams 4] [--tokens 256] [--k 4] [--weights auto,bfloat16]

The embedded model (SmolLM2-135M-Instruct), greedy, weights as `edge serve --weight-dtype X --speculative ngram`
loads them on the CPU (auto for the embedded model: int4, lm_head int8, up to 8 rows, bfloat16 above, which
verifies several tokens per sequence for less). Drafts are planned with the cost model the engine measures at
start-up (printed below the table). Three workloads, each of chat prompts (batch b: --streams x b requests, the
workload's prompts in turn, queued together into an engine of max_num_seqs b, so b answers decode at once until the
queue runs dry), each answer ending at the model's end-of-sequence token or at a stop string (at most --tokens):
  code edit       a function in the prompt, and the request to return it with one name changed; the answer ends
                  with its code block (stop "```\n"), as a code-editing client asks for it: prompt lookup finds
                  the quoted code
  code + prose    the same prompts without the stop: the model quotes the code, then explains it in prose
  non-repetitive  open questions answered in prose
Prefill (llama.cpp) happens before the clock starts; the clock covers every decode step after the first (the
first imports the handoffs). tok/s: generated tokens over the time until the last answer ends (throughput);
stream tok/s: each answer's tokens after its first over the time from its first to its last, averaged over the
answers (the speed a client sees). The best of --repeats runs of each mode, off and on
alternating (the machine is shared); acceptance is accepted / proposed draft tokens.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from contracts.handoff import SamplingParams
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.core.speculative import SpecConfig, StepCosts
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.model.loader import eos_token_ids, load_tokenizer
from decode_gpu.model.weight_quant import FLOAT_WEIGHTS, load_weights
from decode_gpu.runner.device import resolve_dtype
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from prefill_cpu.embedded_model import embedded_model_path
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest

FUNCTIONS = [
    "def moving_average(values, window):\n    total = 0.0\n    result = []\n"
    "    for index, value in enumerate(values):\n"
    "        total += value\n        if index >= window:\n            total -= values[index - window]\n"
    "        if index >= window - 1:\n            result.append(total / window)\n    return result\n",
    "def count_words(text):\n    counts = {}\n    for line in text.splitlines():\n        for word in line.split():\n"
    "            word = word.strip('.,;:!?').lower()\n            if word:\n"
    "                counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda item: item[1], reverse=True)\n",
    "def merge_intervals(intervals):\n    intervals = sorted(intervals)\n    merged = []\n"
    "    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n            merged.append([start, end])\n    return merged\n",
    "def parse_config(path):\n    settings = {}\n    with open(path) as handle:\n        for line in handle:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
    "            key, _, value = line.partition('=')\n            settings[key.strip()] = value.strip()\n"
    "    return settings\n",
]
MAX_NUM_SEQS = 8  # the engine's largest batch: its weights are loaded for this many sequences' verify rows
RENAMES = ["result", "counts", "merged", "settings"]
QUESTIONS = ["Why do people enjoy walking in the mountains?", "What makes a good teacher?",
             "How did the invention of the printing press change Europe?", "What should I pack for a week of camping?"]


WORKLOADS = ("code edit", "code + prose", "non-repetitive")
CODE_BLOCK_END = "```\n"  # the closing fence; the opening one carries the language ("```python\n")


def prompts(workload: str) -> list[list[dict]]:
    if workload != "non-repetitive":
        return [[{"role": "user", "content": f"Here is a Python function:\n```python\n{code}```\nReturn the whole "
                  f"function again with the variable `{name}` renamed to `output`. Reply with the code only."}]
                for code, name in zip(FUNCTIONS, RENAMES)]
    return [[{"role": "user", "content": question}] for question in QUESTIONS]


def handoffs(prefiller: Prefiller, tokenizer, workload: str, n: int, max_tokens: int) -> list:
    """n requests, the workload's prompts in turn."""
    stop = (CODE_BLOCK_END,) if workload == "code edit" else ()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop)
    out = []
    chats = prompts(workload)
    for i, messages in enumerate(chats[j % len(chats)] for j in range(n)):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = tuple(prefiller.tokenize(text, add_special=False))
        out.append(prefiller.prefill(PrefillRequest(f"{workload}{i}", tokens, params)).handoff)
    return out


def runner_for(model, identity, spec: SpecConfig) -> ModelRunner:
    return ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=4096, max_num_seqs=MAX_NUM_SEQS,
                                                     num_speculative_tokens=spec.num_speculative_tokens),
                       torch.device("cpu"))


@dataclass(frozen=True)
class Target:
    """The model an engine is built around, with what ends its answers."""
    model: object
    identity: object
    tokenizer: object  # for stop strings

    def engine(self, batch: int, spec: SpecConfig, costs: StepCosts | None) -> DecodeEngine:
        return DecodeEngine(runner_for(self.model, self.identity, spec),
                            EngineConfig(scheduler=SchedulerConfig(max_num_seqs=batch), speculative=spec),
                            self.tokenizer, eos_token_ids(self.tokenizer, self.model), costs)


def run(target: Target, handoffs_: list, batch: int, spec: SpecConfig, costs: StepCosts | None = None) -> dict:
    engine = target.engine(batch, spec, costs)
    outputs: dict[str, list[int]] = {}
    for handoff in handoffs_:
        for event in engine.add(handoff):
            outputs.setdefault(event.request_id, []).extend(event.token_ids)

    # each answer's first step: (time, its tokens before that step's), and when it ended
    began: dict[str, tuple[float, int]] = {}
    ended: dict[str, float] = {}

    def step() -> None:
        before, events = time.perf_counter(), engine.step()
        for event in events:
            began.setdefault(event.request_id, (before, len(outputs[event.request_id])))
            outputs[event.request_id].extend(event.token_ids)
            if event.finish_reason is not None:
                ended[event.request_id] = time.perf_counter()

    step()  # imports the handoffs
    counted, started = sum(map(len, outputs.values())), time.perf_counter()
    began = {rid: (started, len(outputs[rid])) for rid in began}  # the stream starts after the import
    while engine.has_work:
        step()
    seconds = time.perf_counter() - started
    stats = engine.stats()
    drafted = stats.num_spec_draft_tokens
    per_stream = [(len(outputs[rid]) - began[rid][1]) / (ended[rid] - began[rid][0]) for rid in ended]
    return dict(tok_s=(sum(map(len, outputs.values())) - counted) / seconds,
                answer_tokens=sum(map(len, outputs.values())) / len(outputs),
                stream_tok_s=sum(per_stream) / len(per_stream), outputs=outputs,
                acceptance=stats.num_spec_accepted_tokens / drafted if drafted else None, drafts=stats.num_spec_drafts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each answer")
    parser.add_argument("--streams", type=int, default=4, help="requests per batch slot, queued together")
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
    work = {(w, b): handoffs(prefiller, tokenizer, w, args.streams * b, args.tokens)
            for w in WORKLOADS for b in batches}
    prefiller.close()
    on = SpecConfig(method="ngram", num_speculative_tokens=args.k)
    print(f"\nN-gram speculative decoding on the CPU ({torch.get_num_threads()} threads, greedy, at most {args.tokens} "
          f"tokens an answer, K = {args.k}; same tokens: speculation changed no token)")
    print("| weights | workload | batch | tokens an answer | tok/s off | tok/s ngram | speed-up | stream tok/s off "
          "| stream tok/s ngram | stream speed-up | acceptance | drafts | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    models = []
    for weight_dtype in args.weights.split(","):
        float_weights = FLOAT_WEIGHTS.get(weight_dtype)
        model, report = load_weights(identity, cpu, float_weights or resolve_dtype("auto", cpu), weight_dtype,
                                     on.max_rows(MAX_NUM_SEQS))  # as edge serve loads them with speculation on
        costs = runner_for(model, identity, on).step_costs(MAX_NUM_SEQS, on.num_speculative_tokens)
        models.append(f"- {report.weight_dtype}: {costs.describe()}")
        rows(Target(model, identity, tokenizer), work, on, args.repeats, report.weight_dtype, costs)
    print("\nThe cost model the drafts were planned with, ms by rows fed:", *models, sep="\n")


def rows(target: Target, work: dict, on: SpecConfig, repeats: int, weights: str, costs: StepCosts) -> None:
    for (workload, batch), hs in work.items():
        runs = [(run(target, hs, batch, SpecConfig()), run(target, hs, batch, on, costs))
                for _ in range(repeats)]
        off = max((r[0] for r in runs), key=lambda r: r["tok_s"])
        spec = max((r[1] for r in runs), key=lambda r: r["tok_s"])
        acceptance = f"{spec['acceptance']:.2f}" if spec["acceptance"] is not None else "-"
        print(f"| {weights} | {workload} | {batch} | {off['answer_tokens']:.0f} | {off['tok_s']:.1f} "
              f"| {spec['tok_s']:.1f} | {spec['tok_s'] / off['tok_s']:.2f}x | {off['stream_tok_s']:.1f} "
              f"| {spec['stream_tok_s']:.1f} "
              f"| {spec['stream_tok_s'] / off['stream_tok_s']:.2f}x "
              f"| {acceptance} | {spec['drafts']} | {'yes' if spec['outputs'] == off['outputs'] else 'no'} |",
              flush=True)


if __name__ == "__main__":
    main()
