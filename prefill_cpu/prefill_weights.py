"""The weights llama.cpp prefills with: the given GGUF, or a copy converted once for prefill speed.

Prefill is compute-bound, decode reads weights: the worker only prefills, so it can use the type llama.cpp's CPU
matmuls run fastest, whatever the engine decodes with. llama.cpp has no fast CPU path for some types: on the
development machine (2-core Xeon, AVX-512) a Q4_1 GGUF prefills 283-299 tok/s, the same weights dequantized to f16
551-560 (docs/handoff.md, "Prefill weights"). f16 holds every value of a 4/5/6-bit GGUF exactly (up to f16 rounding
of scale x quant + min), so the converted copy computes the same model.

Choices (`prefill_weights` in the serve config, `--prefill-weights` of a worker):
- "given": the GGUF as it is.
- "f16", "bf16", "q8_0": a converted copy, made once with llama.cpp's own quantizer and cached beside the decode
  engine's converted weights (EDGE_LLM_CACHE, default ~/.cache/edge-llm, "converted/<fingerprint>/").
- "auto": measures a 256-token prefill with the given file and with a converted copy (f16, or q8_0 when f16 would
  take more than a quarter of the memory) once per file, CPU and thread count, keeps the copy only when it is at
  least MIN_GAIN faster, and records the decision (prefill-weights.json) so later starts do not measure again.
  No copy is made when even q8_0 would take more than a quarter of the memory or the disk lacks room.
  A worker holds its prefills' live rate against the recorded one (prefill_cpu.prefill_rate); a record whose
  measurement it finds slowed is marked stale, and the next start measures again.

The memory plan (contracts/memory_plan.py) may say which copies fit beside everything else on the box
(`copy_kinds`): auto then measures only those, best first, in place of its own quarter-of-the-memory rule, and
prefills from the given file when none fits (a recorded decision for a copy that no longer fits included). A copy
asked for by name is the plan's to refuse at start, not this module's.

The worker's identity (fingerprint, KV shape) stays the given file's: the engine checks handoffs against it.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

import llama_cpp
import psutil

from contracts.cache import converted_dir, write_record
from contracts.gguf_header import read_header
from contracts.identity import GGUFIdentity
from prefill_cpu.prefill_rate import Recorded

log = logging.getLogger(__name__)
CHOICES = ("auto", "given", "f16", "bf16", "q8_0")
FTYPES = {"f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
          "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}  # the copies a worker may load
FILE_TYPES = {**FTYPES, "f32": llama_cpp.LLAMA_FTYPE_ALL_F32}  # what quantize_gguf writes; f32: a fidelity reference
BYTES_PER_WEIGHT = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
UNCONVERTED = {llama_cpp.LLAMA_FTYPE_ALL_F32, llama_cpp.LLAMA_FTYPE_MOSTLY_F16, llama_cpp.LLAMA_FTYPE_MOSTLY_BF16}
MIN_GAIN = 1.15  # auto keeps a converted copy only if it prefills at least this much faster than the given file
MEMORY_SHARE = 0.25  # auto converts only if the copy takes at most this share of the machine's memory
PROBE_TOKENS = 256  # the prompt auto measures with
DECISION_FILE = "prefill-weights.json"


def prefill_weights_path(identity: GGUFIdentity, choice: str, threads: int, n_batch: int,
                         copy_kinds: tuple[str, ...] | None = None) -> str:
    """The file llama.cpp should load for prefill under `choice`; the given file when nothing better is known.
    copy_kinds: the copies the memory plan leaves room for, best first (None: auto's own memory rule)."""
    if choice not in CHOICES:
        raise ValueError(f"prefill weights {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "given":
        return identity.path
    try:
        folder = converted_dir(identity)  # beside the decode engine's converted weights
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "prefill-weights.lock", "w") as lock:  # workers starting together convert and measure once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if choice != "auto":
                return str(converted_copy(identity, choice, folder))
            return _auto(identity, folder, threads, n_batch, copy_kinds)
    except (OSError, RuntimeError) as err:
        if choice != "auto":  # asked for by name: fail clearly rather than prefill from another file
            raise RuntimeError(f"prefill weights {choice}: {err}") from err
        log.warning("prefill weights: prefilling from the given file, no converted copy (%s)", err)
        return identity.path


def converted_copy(identity: GGUFIdentity, kind: str, folder: Path) -> Path:
    """The GGUF converted to `kind` by llama.cpp's quantizer, made once (atomically) and cached."""
    target = folder / f"prefill-{kind}.gguf"
    if target.exists():
        return target
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    started = time.perf_counter()
    log.info("converting %s to %s for prefill once; cached in %s", os.path.basename(identity.path), kind, target)
    try:
        quantize_gguf(identity.path, partial, kind)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("converted %s to %s in %.1f s (%.0f MB)", os.path.basename(identity.path), kind,
             time.perf_counter() - started, target.stat().st_size / 1e6)
    return target


def quantize_gguf(source: str, target: Path, kind: str) -> None:
    """Write `source` to `target` in `kind` (FILE_TYPES) with llama.cpp's quantizer, requantizing."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[kind]
    params.allow_requantize = True  # the given file is usually quantized already
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(source.encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not convert {source} to {kind}")


def _auto(identity: GGUFIdentity, folder: Path, threads: int, n_batch: int,
          copy_kinds: tuple[str, ...] | None = None) -> str:
    key = {"cpu": llama_cpp.llama_print_system_info().decode(errors="replace").strip(), "threads": threads,
           "n_batch": n_batch}
    decision_file = folder / DECISION_FILE
    try:
        decision = json.loads(decision_file.read_text())
    except (OSError, ValueError):
        decision = None
    if decision and decision.get("key") == key and "stale" not in decision:
        if not copy_allowed(decision.get("choice"), copy_kinds):
            log.info("prefill weights: the given file; the %s copy an earlier start chose does not fit the memory "
                     "plan (%s kept)", decision.get("choice"), decision_file)
            return identity.path
        log.info("prefill weights: %s, as measured at an earlier start (%s; delete it to measure again)",
                 decision.get("choice"), decision_file)
        return _chosen(identity, folder, decision)
    if copy_kinds == ():  # nothing to measure; no record either, so a start with room measures as usual
        log.info("prefill weights: the given file; the memory plan leaves no room for a copy")
        return identity.path
    if decision and "stale" in decision:
        log.info("prefill weights: measuring again; a worker found the recorded measurement slowed (%s)",
                 decision["stale"])
    kind = candidate(identity.path, folder, copy_kinds)
    if kind is None:
        decision = {"key": key, "choice": "given", "why": "a copy would not fit, or not prefill faster"}
    else:
        copy = converted_copy(identity, kind, folder)
        given_tok_s, copy_tok_s = measure_prefill([identity.path, str(copy)], threads, n_batch)
        gain = copy_tok_s / given_tok_s
        decision = {"key": key, "choice": kind if gain >= MIN_GAIN else "given", "candidate": kind,
                    "given_tok_s": round(given_tok_s, 1), "converted_tok_s": round(copy_tok_s, 1)}
        log.info("prefill weights: %s prefills %.0f tok/s, its %s copy %.0f tok/s (%.2fx); using %s",
                 os.path.basename(identity.path), given_tok_s, kind, copy_tok_s, gain,
                 f"the {kind} copy" if decision["choice"] == kind else "the given file")
        if decision["choice"] == "given":
            copy.unlink(missing_ok=True)
    write_record(decision_file, json.dumps(decision, indent=1))  # whole: a worker starting meanwhile reads old or new
    return _chosen(identity, folder, decision)


def recorded_rate(identity: GGUFIdentity, weights_path: str, threads: int, n_batch: int) -> Recorded | None:
    """What auto's measurement recorded for the file a worker loaded (at these threads and n_batch), if anything:
    the rate its prefills are held against while serving."""
    record = converted_dir(identity) / DECISION_FILE
    try:
        decision = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    key = decision.get("key") or {}
    if "converted_tok_s" not in decision or (key.get("threads"), key.get("n_batch")) != (threads, n_batch):
        return None
    if weights_path == identity.path:
        return Recorded(float(decision["given_tok_s"]), record)
    if Path(weights_path).name == f"prefill-{decision.get('candidate')}.gguf":
        return Recorded(float(decision["converted_tok_s"]), record)
    return None


def _chosen(identity: GGUFIdentity, folder: Path, decision: dict) -> str:
    if decision.get("choice") in FTYPES:
        return str(converted_copy(identity, decision["choice"], folder))  # made again if someone deleted it
    return identity.path


def copy_allowed(choice: str | None, copy_kinds: tuple[str, ...] | None) -> bool:
    """Whether a recorded choice may be used under the memory plan's copy_kinds (the given file always may)."""
    return choice not in FTYPES or copy_kinds is None or choice in copy_kinds


def candidate(path: str, folder: Path, copy_kinds: tuple[str, ...] | None = None) -> str | None:
    """f16 if its copy takes at most MEMORY_SHARE of the memory, else q8_0 if that does, else None (also when the disk
    lacks room for the copy twice over, or the file has 16 or 32 bits a weight already). copy_kinds: the memory
    plan's copies, best first, in place of the MEMORY_SHARE rule (() : none fits)."""
    reader = read_header(path)
    file_type = reader.get_field("general.file_type")
    if file_type is not None and int(file_type.contents()) in UNCONVERTED:
        return None  # already 16 or 32 bits a weight: a copy would prefill no faster
    weights = sum(int(tensor.n_elements) for tensor in reader.tensors)
    memory = psutil.virtual_memory().total
    free = shutil.disk_usage(folder).free
    planned = copy_kinds is not None
    for kind in copy_kinds if planned else ("f16", "q8_0"):
        size = weights * BYTES_PER_WEIGHT[kind]
        if (planned or size <= MEMORY_SHARE * memory) and 2 * size <= free:
            return kind
    log.info("prefill weights: no converted copy of %s (%.1f G weights; %.0f GB memory, %.0f GB free disk)",
             os.path.basename(path), weights / 1e9, memory / 1e9, free / 1e9)
    return None


def auto_outlook(identity: GGUFIdentity, copy_kinds: tuple[str, ...] | None = None) -> str:
    """What `auto` did or will do for this file, read without converting or measuring anything (edge check-model):
    the decision an earlier start recorded, else what the first start will do. copy_kinds: the memory plan's."""
    folder = converted_dir(identity)
    record = folder / DECISION_FILE
    try:
        decision = json.loads(record.read_text())
    except (OSError, ValueError):
        decision = None
    if decision and "stale" in decision:
        stale = decision["stale"]
        return (f"to be measured again at the next start: a worker prefilled {stale.get('live_tok_s')} tok/s at "
                f"{stale.get('threads')} threads on {decision.get('choice')}, well above the "
                f"{_recorded_for(decision)} tok/s recorded for it, so the measurement ran slowed ({record})")
    if decision and not copy_allowed(decision.get("choice"), copy_kinds):
        return (f"the given file: the {decision['choice']} copy an earlier start chose does not fit the memory plan "
                f"({record})")
    if decision and decision.get("choice") in ("given", *FTYPES):
        chosen = "the given file" if decision["choice"] == "given" else f"its {decision['choice']} copy"
        key = decision.get("key") or {}
        speeds = (f": {decision['given_tok_s']:.0f} tok/s given, {decision['converted_tok_s']:.0f} its "
                  f"{decision['candidate']} copy" if "converted_tok_s" in decision else "")
        return (f"{chosen}, as measured at an earlier start ({key.get('threads')} threads, n_batch "
                f"{key.get('n_batch')}{speeds}; {record})")
    file_type = read_header(identity.path).get_field("general.file_type")
    if file_type is not None and int(file_type.contents()) in UNCONVERTED:
        return "the given file: it has 16 or 32 bits a weight already"
    existing = next(p for p in (folder, *folder.parents) if p.exists())  # candidate() asks its disk for room
    kind = candidate(identity.path, existing, copy_kinds)
    if kind is None:
        return "the given file: a converted copy would not fit (memory or disk)"
    return (f"not measured yet: the first start converts it to {kind} once and keeps the copy if it prefills at "
            f"least {MIN_GAIN}x as fast (about 10 s; recorded in {record})")


def _recorded_for(decision: dict) -> object:
    return decision.get("given_tok_s") if decision.get("choice") == "given" else decision.get("converted_tok_s")


def measure_prefill(paths: list[str], threads: int, n_batch: int, rounds: int = 3,
                    n_tokens: int = PROBE_TOKENS) -> list[float]:
    """Prefill tok/s of n_tokens tokens with each file: best of `rounds`, the files taking turns, so a neighbour
    busy for a while (the engine loading beside the workers) slows all of them alike."""
    models = [llama_cpp.Llama(path, n_ctx=n_tokens + 16, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                              n_threads_batch=threads, flash_attn=True, verbose=False) for path in paths]
    best = [float("inf")] * len(paths)
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(models[0]._model.vocab)
        tokens = [(i * 7919) % n_vocab for i in range(n_tokens)]  # spread over the vocabulary
        for _ in range(rounds):
            for i, model in enumerate(models):
                model.reset()
                started = time.perf_counter()
                model.eval(tokens)
                best[i] = min(best[i], time.perf_counter() - started)
    finally:
        for model in models:
            model.close()
    return [n_tokens / seconds for seconds in best]
