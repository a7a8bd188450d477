"""--dtype auto: bfloat16 on CUDA and on a CPU with native bfloat16 (faster there, docs/decode.md), float32 on
other CPUs; explicit dtypes are kept; the CPU's flags come from /proc/cpuinfo."""

import logging

import pytest
import torch

from decode_gpu.runner import device as device_module
from decode_gpu.runner.device import cpu_flags, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_the_cpu_follows_native_bfloat16(monkeypatch, caplog, native, expected):
    monkeypatch.setattr(device_module, "cpu_supports_bfloat16", lambda: native)
    with caplog.at_level(logging.INFO, logger="decode_gpu.runner.device"):
        assert resolve_dtype("auto", CPU) == expected
    assert f"--dtype auto: {str(expected).removeprefix('torch.')} on a CPU with" in caplog.text


def test_auto_on_cuda_is_bfloat16_and_explicit_dtypes_are_kept(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_supports_bfloat16", lambda: False)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert [resolve_dtype(n, CPU) for n in ("float32", "float16", "bfloat16")] == \
        [torch.float32, torch.float16, torch.bfloat16]
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        resolve_dtype("fp8", CPU)


@pytest.mark.parametrize("flags,native", [("fpu avx512f avx512_bf16 amx_tile", True), ("fpu amx_bf16", True),
                                          ("fpu avx2 avx512f", False)])
def test_native_bfloat16_is_read_from_the_cpu_flags(monkeypatch, tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert cpu_flags(cpuinfo) == frozenset(flags.split())
    monkeypatch.setattr(device_module, "cpu_flags", lambda: cpu_flags(cpuinfo))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert device_module.cpu_supports_bfloat16() is native


def test_no_cpuinfo_means_no_flags(tmp_path):
    assert cpu_flags(tmp_path / "absent") == frozenset()
