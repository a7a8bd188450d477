"""Build llama.cpp's own `llama-server` from the llama.cpp source inside the pinned llama-cpp-python sdist.

    .venv/bin/python -m checks.llama_server      # prints the binary's path; cached after the first build

Same llama.cpp version as our prefill workers, so the comparison (bench/serving_bench.py, bench/systems.py) is
engine against engine, not version against version. The build takes several minutes on 2 cores, once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

from contracts.cache import cache_root

VERSION = "0.3.36"
CACHE = cache_root() / f"llama-server-{VERSION}"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]


# ggml's CMake option for each /proc/cpuinfo flag, as the Makefile sets them for llama-cpp-python
GGML_FEATURES = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX_VNNI": "avx_vnni",
                 "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
                 "AVX512_BF16": "avx512_bf16"}


def cpu_flags() -> list[str]:
    """The CPU flags our prefill workers' llama.cpp was built with (the Makefile's CMAKE_ARGS: this CPU's
    AVX/AVX-512 features without AMX, whose kernels crash here), so both engines run the same kernels. Without
    CMAKE_ARGS (run outside make) the same flags come from /proc/cpuinfo: GGML_NATIVE would build -march=native,
    AMX kernels included, and that binary segfaults on its first prompt on AMX machines."""
    if os.environ.get("CMAKE_ARGS"):
        return shlex.split(os.environ["CMAKE_ARGS"])
    try:
        have = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return ["-DGGML_NATIVE=ON"]  # not Linux: no AMX crash known there
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{name}={'ON' if flag in have else 'OFF'}"
                                   for name, flag in GGML_FEATURES.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def binary_path() -> Path:
    return CACHE / "build" / "bin" / "llama-server"


def source_dir() -> Path:
    extracted = CACHE / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if extracted.is_dir():
        return extracted
    (CACHE / "src").mkdir(parents=True, exist_ok=True)
    print(f"fetching the llama-cpp-python {VERSION} sdist (pip's cache is used when it has it)", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(CACHE / "src")], check=True)
    with tarfile.open(next((CACHE / "src").glob("llama_cpp_python-*.tar.gz"))) as tar:
        tar.extractall(CACHE / "src", filter="data")
    return extracted


def build(jobs: int) -> Path:
    """The binary, built for the current flags: a binary built with other flags (an older build's -march=native)
    is rebuilt."""
    flags = [*CMAKE_FLAGS, *cpu_flags()]
    stamp = CACHE / "build" / "edge-llm-flags.txt"
    if binary_path().exists() and stamp.exists() and stamp.read_text() == " ".join(flags):
        return binary_path()
    src = source_dir()
    print(f"building llama-server in {CACHE / 'build'} (several minutes on 2 cores, once)", flush=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(CACHE / "build"), *flags], check=True)
    subprocess.run(["cmake", "--build", str(CACHE / "build"), "--target", "llama-server", "-j", str(jobs)], check=True)
    stamp.write_text(" ".join(flags))
    return binary_path()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    print(build(parser.parse_args().jobs))


if __name__ == "__main__":
    main()
