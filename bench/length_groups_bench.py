"""CPU decode step ms with the rows attended in groups of similar context length (decode_gpu.attention.length_groups.
length_groups) and all together, padded to the longest, side by side in one process (in turns, so that a busy
neighbour slows both alike).

    .venv/bin/python -m bench.length_groups_bench [--weights bfloat16,auto] [--reps 9]

The embedded model, its weights as `edge serve --weight-dtype X` loads them. The rows are dummy sequences whose
context lengths follow a batch of the serving benchmark's mixed workload (a shared system prompt, then user
prompts of about 64/256/1024 tokens in a 6:3:1 mix, then up to 48 generated tokens), and two controls. The table
gives the median step of each. Two more rows time a speculative verify step (4 sequences feeding 5 tokens each),
whose multi-token attention is grouped alike.
"""

from __future__ import annotations

import argparse
import random
import time

SYSTEM_PROMPT_TOKENS = 100  # about bench.workloads' shared system prompt


def batches() -> dict[str, list[int]]:
    draw = random.Random(0)
    mixed = [SYSTEM_PROMPT_TOKENS + draw.choice([64] * 6 + [256] * 3 + [1024]) + draw.randint(0, 48)
             for _ in range(16)]
    return {"16 rows, mixed workload lengths": mixed, "16 rows: 15 x 300 + 1 x 1100": [300] * 15 + [1100],
            "8 rows x 256 (one group)": [256] * 8}


VERIFY = {"verify, 4 sequences x 5 queries: 120/150/200/1100": [120, 150, 200, 1100],
          "verify, 4 sequences x 5 queries: 4 x 256 (one group)": [256] * 4}
DRAFT = 4  # draft tokens a sequence in the verify rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="bfloat16,auto")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    import torch

    from decode_gpu.attention import length_groups as grouping
    from decode_gpu.model.weight_quant import load_weights
    from decode_gpu.runner.cost_probe import Probe
    from decode_gpu.runner.device import resolve_dtype
    from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
    from prefill_cpu.embedded_model import embedded_model_path
    from prefill_cpu.prefiller import PrefillConfig, Prefiller
    cpu = torch.device("cpu")
    prefiller = Prefiller(PrefillConfig(embedded_model_path(), n_ctx=512, kv_type="f16"))
    identity = prefiller.identity
    prefiller.close()
    print(f"\nCPU decode step ms ({torch.get_num_threads()} threads), median of {args.reps}")
    print("| weights | rows (context lengths) | groups | one group ms | in groups ms | in groups / one |")
    print("|---|---|---|---|---|---|")
    grouped_max = grouping.MAX_GROUPS
    for weight_dtype in args.weights.split(","):
        model, report = load_weights(identity, cpu, resolve_dtype("auto", cpu), weight_dtype, 32)
        runner = ModelRunner(model, identity, RunnerConfig(kv_cache_tokens=16384, max_num_seqs=32), cpu)
        bs = runner.pool.shape.block_size
        for name, contexts in (batches() | VERIFY).items():
            draft = DRAFT if name in VERIFY else 0
            seqs, tables, next_block = [], {}, 0
            for i, context in enumerate(contexts):  # each about to decode (and verify a draft) after `context` tokens
                seqs.append(Probe(str(i), [0] * (context + 1 + draft), context))
                n_blocks = -(-(context + 1 + draft) // bs)
                tables[str(i)] = list(range(next_block, next_block + n_blocks))
                next_block += n_blocks
            step = (lambda: runner.verify(seqs, tables, [[0] * draft] * len(seqs))) if draft else \
                (lambda: runner.forward(seqs, tables))
            times: dict[int, list[float]] = {1: [], grouped_max: []}
            for rep in range(args.reps + 1):
                for groups in times:
                    grouping.MAX_GROUPS = groups
                    started = time.perf_counter()
                    step()
                    if rep:  # the first round warms up
                        times[groups].append((time.perf_counter() - started) * 1e3)
            grouping.MAX_GROUPS = grouped_max
            one, grouped = (sorted(t)[len(t) // 2] for t in times.values())
            print(f"| {report.weight_dtype} | {name} | {len(grouping.length_groups(contexts, bs))} | {one:.1f} "
                  f"| {grouped:.1f} | {grouped / one:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
