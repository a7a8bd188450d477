"""Where edge-llm keeps what it builds once: converted weights, the prefill workers' weight copies, the benchmark's
llama-server. Torch-free, so the prefill worker and the benchmarks find the same folders as the decode engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # contracts.identity keeps its fingerprints under cache_root(): no import circle at run time
    from contracts.identity import GGUFIdentity


def cache_root() -> Path:
    """EDGE_LLM_CACHE, else ~/.cache/edge-llm."""
    return Path(os.environ.get("EDGE_LLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "edge-llm"))


def converted_dir(identity: GGUFIdentity, cache_dir: Path | None = None) -> Path:
    """A GGUF's own folder of converted files, by its fingerprint; cache_dir: instead of cache_root()/converted."""
    return (cache_dir or cache_root() / "converted") / identity.fingerprint.replace(":", "-")


def write_record(path: Path, text: str) -> None:
    """Write a small record whole: to a partial file of this process, then moved to `path`, so a process reading it
    meanwhile finds the old record or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".partial-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
