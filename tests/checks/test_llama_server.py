"""The benchmark's llama-server build flags: outside make, the same CPU features as the prefill workers, never AMX."""

from checks import llama_server


def test_without_cmake_args_the_flags_come_from_the_cpu_and_leave_amx_out(monkeypatch):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    flags = llama_server.cpu_flags()
    # -march=native would compile ggml's AMX kernels on AMX machines, and they segfault on the first prompt
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_NATIVE=ON" not in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    have = set(open("/proc/cpuinfo").read().split())
    assert ("-DGGML_AVX2=ON" in flags) == ("avx2" in have)


def test_cmake_args_win(monkeypatch):
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_NATIVE=OFF -DGGML_AVX=ON")
    assert llama_server.cpu_flags() == ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON"]
