"""`edge check-model PATH.gguf`: what an operator runs before trusting a new model.

Reads the GGUF without starting the service: its shape, whether the handoff can carry its KV, its weight and KV
bytes, which weights the prefill workers load (`prefill_weights = "auto"`: a decision recorded by an earlier start,
or what the first start will do), and how many KV tokens a device of `--memory` holds for each decode weight_dtype.
Then a short fidelity check: llama.cpp prefills a few prompts, their KV crosses the handoff into the torch model,
and decoding from it is compared with decoding from transformers' own prefill of the same prompt
(tests/handoff/test_handoff_embedded_model.py holds the same comparison to the same thresholds). Exit 0 when every
check passes, 1 when one fails, with the reason on one line, never a traceback; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from dataclasses import dataclass

from contracts.gguf_header import GGUFError
from contracts.identity import GGUFIdentity, UnsupportedModelError, check_supported, read_gguf_identity
from contracts.options import AUTO, KNOBS
from edge.check_model.memory import memory_plan, print_plan
from edge.check_model.sizes import decode_weight_bytes, handoff_kv_bytes, pool_kv_bytes, pool_tokens

log = logging.getLogger(__name__)
# the handoff's fidelity bounds on the embedded model (issue 15; tests/test_handoff_embedded_model.py)
MIN_TOP1, MAX_KL = 0.95, 0.01
# (prompt, continuation): llama.cpp prefills the prompt; the continuation is fed teacher-forced after it, so
# both KV caches are compared on the same natural text without a token-by-token decode (the slow part on a CPU)
PASSAGES = (
    ("The capital of France is", " Paris, a city on the Seine known for its museums, its cafes and the Eiffel "
     "Tower, which was built for the world's fair of 1889 and was at first disliked by many artists."),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
     "    if n < 2:\n        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n"
     "    return b\n\n\nprint(fibonacci(10))\n"),
    ("<|im_start|>user\nGive me three tips for staying focused while studying.<|im_end|>\n<|im_start|>assistant\n",
     "1. Put your phone in another room so that notifications cannot pull you away.\n2. Work in blocks of "
     "25 minutes with short breaks.\n3. Decide before you start what you want to finish."),
    ("Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
     " had three sons. Every morning he walked into the forest with his axe, and every evening he came home "
     "with a bundle of wood on his back and a story for the children."),
)
DEVICE_MEMORY = 24 * 2**30  # the KV table's device without --memory
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class CheckFailed(Exception):
    """A check the model failed; the message is the one line the operator reads."""


def parse_size(text: str) -> int:
    """'24GiB', '24GB', '512MiB', '1.5GiB' or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].lower() not in _UNITS or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; write e.g. 24GiB, 24GB or 512MiB")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def _utilization(text: str) -> float:
    """A value gpu_memory_utilization allows, as the config checks it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if problem := KNOBS["gpu_memory_utilization"].problem(value):
        raise argparse.ArgumentTypeError(problem)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", metavar="PATH.gguf", help="the model file to check")
    parser.add_argument("--memory", type=parse_size, default=None,
                        help="the memory budget to plan for (memory_budget: every process together on a CPU, the "
                             "GPU's on CUDA; default this box's) and the decode device memory to size the KV pool "
                             "for (default 24GiB; e.g. 8GiB, 80GB)")
    parser.add_argument("--device", choices=KNOBS["device"].choices, default=AUTO,
                        help="where the plan puts the decode engine, as the config's device (default auto)")
    parser.add_argument("--gpu-memory-utilization", type=_utilization, default=KNOBS["gpu_memory_utilization"].default,
                        help="the engine's share of that memory, as in the config (default %(default)s)")
    parser.add_argument("--kv-type", action="append", choices=KNOBS["kv_type"].allowed(exclude=(AUTO,)),
                        help="handoff KV type(s) the fidelity check prefills with (default: f16 and q8_0)")
    parser.add_argument("--no-fidelity", action="store_true", help="skip the prefill/decode comparison")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    _quiet_logs()
    report: dict = {"path": args.gguf}
    device_memory = args.memory or DEVICE_MEMORY
    try:
        report["model"] = dataclasses.asdict(read_model(args.gguf, device_memory, args.gpu_memory_utilization))
        if not args.json:
            print_model(report["model"], device_memory, args.gpu_memory_utilization)
        report["memory_plan"] = memory_plan(args.gguf, args.memory or 0, args.device)
        if not args.json:
            print_plan(report["memory_plan"])
        if not args.no_fidelity:
            fidelity = check_fidelity(args.gguf, args.kv_type or ["f16", "q8_0"])
            report["fidelity"] = [dataclasses.asdict(f) for f in fidelity]
            if not args.json:
                print_fidelity(report["fidelity"])
    except CheckFailed as err:
        report.update(passed=False, error=str(err))
    else:
        refused = report["memory_plan"].get("refused")
        report["passed"] = all(f["passed"] for f in report.get("fidelity", [])) and not refused
        failed = [f"{f['kv_type']} KV" for f in report.get("fidelity", []) if not f["passed"]]
        report["error"] = f"fidelity below the bounds with {' and '.join(failed)}" if failed else None
        if refused:
            report["error"] = f"would be refused at start: {refused}"
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("PASS" if report["passed"] else f"FAIL: {report['error']}")
    return 0 if report["passed"] else 1


def _quiet_logs() -> None:
    """Progress lines on stderr for what is slow (conversion, loading); the table alone on stdout."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="edge check-model: %(message)s")
    for name in (__name__, "decode_gpu.model.loader", "decode_gpu.model.gguf_convert"):
        logging.getLogger(name).setLevel(logging.INFO)
    # llama.cpp's warnings (prefill_cpu.llama_log) are noise here; a load error is in the failure's own line
    logging.getLogger("prefill_cpu.llama_log").setLevel(logging.ERROR)


# ---- what the GGUF holds and what it takes on the decode device ----

@dataclass(frozen=True)
class ModelReport:
    arch: str
    rope_layout: str
    n_layer: int
    n_head: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    num_params: int  # elements of every GGUF tensor
    gguf_bytes: dict[str, int]  # the GGUF's tensor bytes by ggml type
    weight_bytes: dict[str, int | None]  # on the decode device, by weight_dtype (None: this model cannot be held so)
    handoff_kv_bytes: dict[str, int | None]  # per token, by handoff KV type (None: rows are not whole blocks)
    pool_kv_bytes: dict[str, int]  # per token, by decode pool storage
    pool_tokens: dict[str, dict[str, int]]  # weight_dtype -> pool storage -> KV tokens that fit --memory
    prefill_weights: str  # what prefill_weights = "auto" did or will do for this file (prefill_weights.auto_outlook)


def read_model(path: str, memory: int, utilization: float) -> ModelReport:
    import gguf

    from decode_gpu.model.weight_plan import gguf_weight_types  # int4: the lm_head follows the GGUF's
    try:
        check_supported(path)  # the header's bounds first (contracts.gguf_check): nothing below reads a hostile file
        identity = read_gguf_identity(path)
        tensors = gguf.GGUFReader(path).tensors
    except GGUFError as err:
        raise CheckFailed(f"{err.path}: not a readable GGUF file ({err.reason})") from None
    except (UnsupportedModelError, FileNotFoundError) as err:
        raise CheckFailed(str(err)) from None  # word for word what `edge serve` refuses with
    except Exception as err:  # the gguf reader's numpy errors on a truncated or corrupt file
        raise CheckFailed(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    gguf_bytes: dict[str, int] = {}
    for tensor in tensors:
        gguf_bytes[tensor.tensor_type.name] = gguf_bytes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    weights = decode_weight_bytes(_meta_model(path), gguf_weight_types(path).head_int8)
    pool = pool_kv_bytes(identity)
    return ModelReport(
        arch=identity.arch, rope_layout=identity.rope_layout, n_layer=identity.n_layer, n_head=identity.n_head,
        num_kv_heads=identity.num_kv_heads, head_dim_k=identity.head_dim_k, head_dim_v=identity.head_dim_v,
        num_params=sum(int(t.n_elements) for t in tensors), gguf_bytes=gguf_bytes, weight_bytes=weights,
        handoff_kv_bytes=handoff_kv_bytes(identity), pool_kv_bytes=pool,
        pool_tokens={dtype: {storage: pool_tokens(memory, utilization, held, per_token)
                             for storage, per_token in pool.items()}
                     for dtype, held in weights.items() if held is not None},
        prefill_weights=prefill_outlook(identity))


def prefill_outlook(identity: GGUFIdentity) -> str:
    from prefill_cpu.prefill_weights import auto_outlook
    try:
        return auto_outlook(identity)
    except (OSError, ValueError) as err:  # an unreadable cache record or file: say so, the check goes on
        return f"unknown ({type(err).__name__}: {err})"


def _meta_model(path: str):
    """The float32 decode model on the meta device, built as the converter builds it (gguf_convert)."""
    import torch

    from decode_gpu.model.gguf_convert import model_skeleton
    log.info("reading %s's config as transformers does, to size the decode weights", os.path.basename(path))
    try:
        return model_skeleton(path, torch.float32)
    except Exception as err:  # transformers' GGUF loader refuses architectures it does not map
        raise CheckFailed(f"{path}: transformers cannot build a model from this GGUF: {type(err).__name__}: {err}") \
            from None


# ---- fidelity: llama.cpp's prefill, through the handoff, against transformers' own ----

POSITIONS = 32  # teacher-forced continuation tokens per passage, at most


@dataclass(frozen=True)
class Fidelity:
    kv_type: str
    num_prompts: int
    num_positions: int  # next-token predictions compared, all prompts together: first tokens and teacher-forced
    top1_agreement: float  # the same token from llama.cpp (first) or the imported KV (later) as from transformers
    mean_kl: float  # nats per position, KL(from transformers' prompt KV || from the imported KV)
    first_tokens_agree: int  # prompts whose llama.cpp first token is transformers' argmax after the prompt
    passed: bool
    min_top1: float = MIN_TOP1
    max_kl: float = MAX_KL


def check_fidelity(path: str, kv_types: list[str]) -> list[Fidelity]:
    prefiller = _open_prefiller(path, kv_types[0])  # first: llama.cpp refusing the file is the common failure
    try:
        model = _load_decode_model(path)
        references = [_reference(prefiller, model, prompt, continuation) for prompt, continuation in PASSAGES]
        return [_fidelity_at(prefiller, kv_type, model, references) for kv_type in kv_types]
    finally:
        prefiller.close()


def _open_prefiller(path: str, kv_type: str):
    from prefill_cpu.llama_log import captured_llama_log
    from prefill_cpu.prefiller import PrefillConfig, Prefiller
    lines: list[str] = []
    try:
        with captured_llama_log(lines):  # llama.cpp's load log stays off the terminal; its errors explain a failure
            return Prefiller(PrefillConfig(path, n_ctx=512, kv_type=kv_type))
    except Exception as err:
        errors = [line.strip() for line in lines if "error" in line.lower() or "fail" in line.lower()]
        # the first error is the cause ("missing tensor ..."); the later ones say that loading stopped
        raise CheckFailed(f"llama.cpp could not load {path}: {errors[0] if errors else err}") from None


def _load_decode_model(path: str):
    import torch

    from decode_gpu.model.loader import load_decode_model
    log.info("loading the decode model as float32 on the CPU (converted once and cached)")
    try:
        return load_decode_model(read_gguf_identity(path), torch.device("cpu"), torch.float32)
    except Exception as err:
        raise CheckFailed(f"transformers could not load {path}: {type(err).__name__}: {err}") from None


@dataclass(frozen=True)
class _Reference:
    """transformers' own prefill of one passage's prompt: what the handoff is held to, for every KV type."""
    tokens: tuple[int, ...]  # the prompt
    forced: tuple[int, ...]  # the continuation, fed teacher-forced
    first_token: int  # transformers' argmax after the prompt
    logits: object  # torch.Tensor [len(forced), vocab]: teacher-forced from transformers' prompt KV


def _reference(prefiller, model, prompt: str, continuation: str) -> _Reference:
    from decode_gpu.reference.dense_decoder import prompt_cache, teacher_forced_logits
    tokens, forced = prefiller.tokenize(prompt), prefiller.tokenize(continuation, add_special=False)[:POSITIONS]
    cache, last_logits = prompt_cache(model, tokens)  # last_logits: [vocab]
    logits = teacher_forced_logits(model, cache, forced)  # [len(forced), vocab]
    return _Reference(tuple(tokens), tuple(forced), int(last_logits.argmax()), logits)


def _fidelity_at(prefiller, kv_type: str, model, references: list[_Reference]) -> Fidelity:
    """Every passage's prompt prefilled by llama.cpp with `kv_type` KV, imported, its continuation teacher-forced,
    against transformers' own."""
    import torch
    log.info("fidelity check: %d prompts with %s KV", len(references), kv_type)
    other = prefiller if kv_type == prefiller.config.kv_type else prefiller.with_kv_type(kv_type)
    agree, kls, first = [], [], []
    try:
        for i, ref in enumerate(references):
            first_token, got = _through_handoff(other, model, f"check-{i}", ref)  # got: [len(forced), vocab]
            agree.append((ref.logits.argmax(-1) == got.argmax(-1)).float())  # [len(forced)]
            kls.append(torch.sum(ref.logits.softmax(-1) * (ref.logits.log_softmax(-1) - got.log_softmax(-1)), -1))
            first.append(torch.tensor([float(first_token == ref.first_token)]))  # [1]
    except Exception as err:  # a handoff the decode model cannot take: a shape or layout it does not know
        raise CheckFailed(f"the {kv_type} handoff failed: {type(err).__name__}: {err}") from None
    finally:
        if other is not prefiller:
            other.close()
    # a first token is one more next-token prediction: counted in the agreement (a near-tie may flip it, as any)
    top1, kl = float(torch.cat(agree + first).mean()), float(torch.cat(kls).mean())
    return Fidelity(kv_type, len(references), sum(len(a) for a in agree + first), top1, kl, int(sum(first)),
                    passed=top1 >= MIN_TOP1 and kl <= MAX_KL)


def _through_handoff(prefiller, model, request_id: str, ref: _Reference):
    """llama.cpp's first token for the prompt, and the logits over the continuation from its imported KV
    [len(forced), vocab]."""
    import torch

    from contracts.handoff import SamplingParams
    from decode_gpu.kv.importer import import_handoff
    from decode_gpu.reference.dense_cache import DenseKVCache
    from decode_gpu.reference.dense_decoder import teacher_forced_logits
    from prefill_cpu.prefiller import PrefillRequest
    handoff = prefiller.prefill(PrefillRequest(request_id, ref.tokens, SamplingParams(temperature=0))).handoff
    imported = DenseKVCache(model.config, torch.float32)
    import_handoff(handoff, prefiller.identity, imported, torch.device("cpu"))
    return handoff.first_token, teacher_forced_logits(model, imported.cache, list(ref.forced))


# ---- the table ----

def _size(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def print_model(m: dict, memory: int, utilization: float) -> None:
    rows = [
        ("architecture", f"{m['arch']} ({m['rope_layout']} RoPE), supported: the handoff carries its KV"),
        ("shape", f"{m['n_layer']} layers, {m['n_head']} heads, {m['num_kv_heads']} KV heads, "
                  f"head size K {m['head_dim_k']} / V {m['head_dim_v']}"),
        ("parameters", f"{m['num_params'] / 1e6:.1f} M"),
        ("GGUF weights", f"{_size(sum(m['gguf_bytes'].values()))}: "
                         + ", ".join(f"{k} {_size(v)}" for k, v in sorted(m["gguf_bytes"].items()))),
        ("KV per token", "handoff " + ", ".join(f"{k} {_size(v)}" for k, v in m["handoff_kv_bytes"].items())),
        ("", "decode pool " + ", ".join(f"{k} {_size(v)}" for k, v in m["pool_kv_bytes"].items())),
        ("prefill auto", m["prefill_weights"]),
    ]
    for name, value in rows:
        print(f"{name:<14}{value}")
    storages = list(m["pool_kv_bytes"])
    print(f"\ndecode weights, and KV tokens in {_size(memory)} x {utilization:.2f} by pool storage "
          "(upper bound: activations and the CUDA context come off at start)")
    print(f"  {'weight_dtype':<14}{'weights':>12}" + "".join(f"{s:>12}" for s in storages))
    for dtype, held in m["weight_bytes"].items():
        tokens = m["pool_tokens"].get(dtype, {})
        print(f"  {dtype:<14}{_size(held):>12}" + "".join(f"{tokens.get(s, 'n/a'):>12}" for s in storages))


def print_fidelity(results: list[dict]) -> None:
    print("\nfidelity: llama.cpp prefill + handoff against transformers' own prefill, teacher-forced")
    for f in results:
        print(f"  KV {f['kv_type']:<6}top-1 {f['top1_agreement']:.3f} (>= {f['min_top1']}), mean KL "
              f"{f['mean_kl']:.4f} nats (<= {f['max_kl']}), first token {f['first_tokens_agree']}/{f['num_prompts']} "
              f"prompts, over {f['num_positions']} positions: {'PASS' if f['passed'] else 'FAIL'}")
