import os
import sys
from pathlib import Path

# Triton interprets its kernels on CPU tensors only if this is set before triton is first imported, and
# torch or transformers may import it early (their "is triton available" checks): so set it here, first.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/ helpers such as tiny_gguf

from tiny_gguf import write_tiny_gguf  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_model_path() -> str:
    from prefill_cpu.embedded_model import embedded_model_path as locate
    return locate()


@pytest.fixture(scope="session")
def embedded_identity(embedded_model_path):
    from contracts.identity import read_gguf_identity
    return read_gguf_identity(embedded_model_path)


@pytest.fixture(scope="session")
def embedded_float32(embedded_identity):
    """The embedded model in float32, loaded once for every module that decodes with it (the engine's native forward
    reads its modules and changes nothing). A test that changes the model works on a copy.deepcopy, or puts back what
    it changed."""
    from decode_gpu.model.loader import load_decode_model
    return load_decode_model(embedded_identity, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def embedded_greedy_runs(embedded_float32, embedded_identity) -> list:
    """Each of embedded_continuations.PROMPTS followed by the tokens embedded_float32 decodes greedily after it (the
    teacher-forced fidelity tests' inputs). # each [1, prompt + POSITIONS]"""
    from decode_gpu.model.loader import load_tokenizer
    from embedded_continuations import greedy_continuations
    return greedy_continuations(embedded_float32, load_tokenizer(embedded_identity))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Factory: tiny_gguf(arch in tiny_gguf.ARCHS, "f32" | "f16") -> path of a tiny random-weight GGUF."""
    made: dict[tuple[str, str], Path] = {}

    def make(arch: str, weight_dtype: str = "f32") -> Path:
        key = (arch, weight_dtype)
        if key not in made:
            made[key] = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{arch}-{weight_dtype}.gguf",
                                        arch, weight_dtype)
        return made[key]

    return make


@pytest.fixture(scope="session")
def conversion_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("converted")
