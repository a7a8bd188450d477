"""GGUF -> torch weights: transformers' whole-model load + save_pretrained against the streamed conversion.

    .venv/bin/python -m bench.convert_bench [--model PATH] [--dtype float32|bfloat16|float16] [--shard-mb 512]

Each way runs in its own interpreter, so each peak RSS (VmHWM) is its own; "after imports" is the RSS
before the conversion starts, and the seconds count the conversion only. The old way always writes
float32 (what model_loader did); the streamed one writes --dtype in shards of --shard-mb, which it holds
in memory while it fills them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = {"old": "old (transformers load + save_pretrained)", "streamed": "streamed"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF; the embedded model by default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shard-mb", type=int, default=512)
    parser.add_argument("--run", choices=list(WAYS), help=argparse.SUPPRESS)  # the child's side
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from prefill_cpu.embedded_model import embedded_model_path
        args.model = embedded_model_path()
    if args.run:
        print(json.dumps(convert(args.run, Path(args.model), Path(args.out), args.dtype, args.shard_mb)))
        return
    print(f"{'way':44s} {'peak RSS MB':>12s} {'after imports MB':>17s} {'seconds':>8s} {'bytes on disk':>14s}")
    for way, label in WAYS.items():
        row = run_child(way, args.model, args.dtype, args.shard_mb)
        print(f"{label:44s} {row['peak_mb']:12.0f} {row['imports_mb']:17.0f} {row['seconds']:8.1f} {row['disk']:14,d}")


def run_child(way: str, model: str, dtype: str, shard_mb: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "converted"
        command = [sys.executable, "-m", "bench.convert_bench", "--run", way, "--model", model, "--out", str(out),
                   "--dtype", dtype, "--shard-mb", str(shard_mb)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.splitlines()[-1])
        row["disk"] = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    return row


def convert(way: str, gguf_path: Path, out: Path, dtype: str, shard_mb: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from decode_gpu.model.gguf_convert import convert_gguf

    imports_mb = _rss_mb("VmRSS")
    started = time.perf_counter()
    if way == "old":
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        model.config.quantization_config = None  # as model_loader did: the saved weights are plain floats
        model.hf_quantizer = None
        model.save_pretrained(out)
    else:
        convert_gguf(gguf_path, out, getattr(torch, dtype), shard_mb * 2**20)
    return {"peak_mb": _rss_mb("VmHWM"), "imports_mb": imports_mb, "seconds": time.perf_counter() - started}


def _rss_mb(field: str) -> float:
    """VmHWM, not ru_maxrss: an exec'd child inherits ru_maxrss from its parent."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1]) / 1024


if __name__ == "__main__":
    main()
