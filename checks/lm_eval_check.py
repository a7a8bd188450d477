"""lm-eval against this server: a loglikelihood task scored through /v1/completions (`local-completions`, which
sends `echo: true`, `logprobs: 1`, `max_tokens: 1` and reads the prompt's logprobs back) and through lm-eval's own
transformers backend (`hf`) on the same model, with the same tokenizer, on the same questions. Equal accuracy
(within one question) shows the server's prompt logprobs are real: without them the scores fall to chance.

    python -m checks.lm_eval_check            # starts `edge serve` on the embedded model, runs both, compares
    python -m checks.lm_eval_check --limit 8

Needs lm_eval (`pip install lm_eval`; not a dependency of the service). The task is defined from local files
(checks/lm_eval_task/: a YAML and 24 four-way questions), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "edge_mc"
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    config = workdir / "serve.toml"
    config.write_text("kv_cache_tokens = 8192\nmax_model_len = 1200\n")
    log = open(workdir / "serve.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "edge.cli", "serve", "--config", str(config), "--port",
                                str(port)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"edge serve exited: {(workdir / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError("edge serve was not healthy within 300 s")


def _hf_dirs() -> tuple[str, str]:
    """The embedded GGUF as a transformers model (float32) and tokenizer, converted once (the decode engine's)."""
    import torch

    from contracts.cache import converted_dir
    from contracts.identity import read_gguf_identity
    from decode_gpu.model.loader import converted_weights_dir, load_decode_model, load_tokenizer
    from prefill_cpu.embedded_model import embedded_model_path
    identity = read_gguf_identity(embedded_model_path())
    if not (converted_weights_dir(identity, torch.float32) / "config.json").exists():
        load_decode_model(identity, torch.device("cpu"), torch.float32)
    load_tokenizer(identity)
    return str(converted_weights_dir(identity, torch.float32)), str(converted_dir(identity) / "tokenizer")


def _accuracy(model: str, model_args: dict, limit: int | None) -> float:
    import lm_eval
    from lm_eval.tasks import TaskManager
    here = os.getcwd()
    os.chdir(TASK_DIR)  # the task's data_files are named relative to it
    try:
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], limit=limit,
                                          task_manager=TaskManager(include_path=str(TASK_DIR)), batch_size=1)
    finally:
        os.chdir(here)
    return results["results"][TASK]["acc,none"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="questions to ask (default: all 24)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    weights, tokenizer = _hf_dirs()
    with tempfile.TemporaryDirectory() as tmp:
        process, base = _serve(Path(tmp))
        try:
            served = _accuracy("local-completions", {
                "base_url": base + "/v1/completions", "model": MODEL, "tokenizer_backend": "huggingface",
                "tokenizer": tokenizer, "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True}, args.limit)
        finally:
            process.terminate()
            process.wait(60)
    reference = _accuracy("hf", {"pretrained": weights, "tokenizer": tokenizer, "dtype": "float32",
                                 "device": "cpu"}, args.limit)
    questions = args.limit or sum(1 for _ in open(TASK_DIR / "questions.jsonl"))
    apart = round(abs(served - reference) * questions)
    print(f"{TASK}: {questions} questions; accuracy through /v1/completions {served:.3f}, lm-eval's hf backend "
          f"{reference:.3f}; {apart} question(s) apart (chance: 0.25)")
    return 0 if apart <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
