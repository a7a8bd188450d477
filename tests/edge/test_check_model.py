"""`edge check-model`: the report on the embedded model, checked against arithmetic of our own, and a one-line
failure (never a traceback) on broken or unsupported GGUFs built from the tiny fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from contracts.identity import UnsupportedModelError, check_supported, read_gguf_identity
from edge.check_model.command import parse_size
from edge.cli import main

GIB = 2**30
EDGE = Path(sys.executable).parent / "edge"  # the venv's console script


def check_model(capsys, *argv) -> tuple[int, str, str]:
    """Run `edge check-model ARGV` through the real entry point: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["check-model", *map(str, argv)])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def assert_one_line_failure(status: int, out: str, err: str, *fragments: str) -> str:
    assert status == 1
    assert "Traceback" not in out + err
    failures = [line for line in out.splitlines() if line.startswith("FAIL:")]
    assert len(failures) == 1, out
    for fragment in fragments:
        assert fragment in failures[0]
    return failures[0]


def patched_gguf(src: Path, dst: Path, metadata: dict | None = None, arch: str | None = None,
                 drop: str | None = None) -> Path:
    """A copy of `src` with some metadata values replaced, the architecture renamed (its keys with it), or a tensor
    left out."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.get_field("general.architecture").contents()
    arch = arch or old_arch
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes these itself
        name = arch + field.name[len(old_arch):] if field.name.startswith(old_arch + ".") else field.name
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, (metadata or {}).get(name, field.contents()), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name != drop:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def embedded_table(embedded_model_path):
    """The full command, fidelity included, on the embedded model, as an operator runs it: once, read by the
    tests below."""
    done = subprocess.run([str(EDGE), "check-model", embedded_model_path], capture_output=True, text=True,
                          timeout=300)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.slow
def test_the_embedded_model_passes_with_every_row(embedded_table):
    status, out, err = embedded_table
    assert status == 0, out + err
    assert "Traceback" not in out + err
    lines = out.splitlines()
    assert lines[-1] == "PASS"
    assert lines[0].startswith("architecture  llama (interleaved RoPE)")
    for row in ("shape         30 layers, 9 heads, 3 KV heads, head size K 64 / V 64", "parameters    134.5 M",
                "GGUF weights", "KV per token  handoff f16 22.5 KiB, q8_0 12.0 KiB, q4_0 6.3 KiB"):
        assert any(line.startswith(row) for line in lines), row
    for weight_dtype in ("float32", "bfloat16", "float16", "int8", "int4", "q8_0"):
        assert any(line.split()[:1] == [weight_dtype] for line in lines), weight_dtype
    for kv_type in ("f16", "q8_0"):
        fidelity = next(line for line in lines if line.strip().startswith(f"KV {kv_type} "))
        assert fidelity.endswith("PASS") and "(>= 0.95)" in fidelity and "(<= 0.01)" in fidelity
    assert "loading the decode model" in err  # the slow step says so


@pytest.mark.slow
def test_the_numbers_match_arithmetic(capsys, embedded_model_path):
    status, out, _ = check_model(capsys, embedded_model_path, "--json", "--no-fidelity", "--memory", "8GiB")
    assert status == 0
    report = json.loads(out)
    assert report["passed"] and report["error"] is None and "fidelity" not in report
    model, ident = report["model"], read_gguf_identity(embedded_model_path)
    layers, kv_width = ident.n_layer, ident.num_kv_heads * ident.head_dim_k  # 30, 3 x 64
    # K and V rows of kv_width elements per layer: f16 2 bytes each; q8_0/q4_0 blocks of 32 in 34/18 bytes
    assert model["handoff_kv_bytes"] == {"f16": 2 * layers * kv_width * 2, "q8_0": 2 * layers * kv_width // 32 * 34,
                                         "q4_0": 2 * layers * kv_width // 32 * 18}
    assert model["pool_kv_bytes"] == {"float32": 2 * layers * kv_width * 4, "float16": 2 * layers * kv_width * 2,
                                      "bfloat16": 2 * layers * kv_width * 2,
                                      "int8": 2 * layers * (kv_width + 2 * kv_width // 32),
                                      "int4": 2 * layers * (kv_width // 2 + 4 * kv_width // 32)}
    # SmolLM2-135M: tied 49152 x 576 embedding; per layer q, o 576x576, k, v 576x192, MLP 3 x 576x1536, 2 norms
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    params = 49152 * 576 + 30 * per_layer + 576
    assert model["num_params"] == params
    weights = model["weight_bytes"]
    assert 0 <= weights["float32"] - 4 * params < 1024  # plus RoPE's inverse frequencies
    assert weights["bfloat16"] == weights["float16"] == weights["float32"] // 2
    linear = params - 61 * 576  # less the norms; the tied lm_head is the embedding
    assert weights["int8"] == pytest.approx(linear + 2 * (30 * (2 * 576 + 2 * 192 + 2 * 1536 + 576) + 49152)
                                            + 2 * 61 * 576, abs=1024)  # int8 + a bfloat16 scale per output row
    # int4 layers (half a byte + a bfloat16 scale and zero per 32 inputs); the GGUF's head is Q8_0, so the head is
    # int8 and the embedding shares its table
    embedding = 49152 * 576
    layers = linear - embedding
    assert weights["int4"] == pytest.approx(layers // 2 + layers // 32 * 4 + embedding + 2 * 49152 + 2 * 61 * 576,
                                            abs=1024)
    # q8_0: every layer matrix, the tied head too, in Q8_0 blocks of 32 weights in 34 bytes; the embedding int8
    assert weights["q8_0"] == pytest.approx(linear // 32 * 34 + embedding + 2 * 49152 + 2 * 61 * 576, abs=1024)
    budget = int(8 * GIB * 0.9)
    for weight_dtype, held in weights.items():
        for storage, per_token in model["pool_kv_bytes"].items():
            assert model["pool_tokens"][weight_dtype][storage] == (budget - held) // per_token


@pytest.mark.slow
def test_it_says_which_weights_the_prefill_workers_load(capsys, embedded_model_path, tmp_path, monkeypatch):
    """prefill_weights = auto: what the first start will do, then the decision an earlier start recorded; reading
    it converts and measures nothing."""
    from contracts.cache import converted_dir
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path / "cache"))
    status, out, _ = check_model(capsys, embedded_model_path, "--no-fidelity")
    assert status == 0
    row = next(line for line in out.splitlines() if line.startswith("prefill auto"))
    assert "not measured yet: the first start converts it to f16" in row  # the embedded GGUF is Q4_1
    assert not (tmp_path / "cache").exists()
    record = converted_dir(read_gguf_identity(embedded_model_path)) / "prefill-weights.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"key": {"cpu": "x", "threads": 2, "n_batch": 256}, "choice": "f16",
                                  "candidate": "f16", "given_tok_s": 280.4, "converted_tok_s": 501.2}))
    status, out, _ = check_model(capsys, embedded_model_path, "--no-fidelity", "--json")
    assert json.loads(out)["model"]["prefill_weights"].startswith(
        "its f16 copy, as measured at an earlier start (2 threads, n_batch 256: 280 tok/s given, 501 its f16 copy")


def test_memory_sizes_parse_and_bad_arguments_are_refused(capsys, tiny_gguf):
    assert parse_size("24GiB") == 24 * GIB and parse_size("24GB") == 24 * 10**9
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5gib") == int(1.5 * GIB)
    assert parse_size("4096") == 4096
    status, _, err = check_model(capsys, tiny_gguf("llama"), "--memory", "lots")
    assert status == 2 and "'lots' is not a memory size" in err and "Traceback" not in err
    status, _, err = check_model(capsys, tiny_gguf("llama"), "--gpu-memory-utilization", "1.5")
    assert status == 2 and "--gpu-memory-utilization: expected a value <= 1, got 1.5" in err  # as the config says


def test_a_truncated_gguf_fails_in_one_line(capsys, tiny_gguf, tmp_path):
    data = tiny_gguf("llama").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:len(data) // 2])
    assert_one_line_failure(*check_model(capsys, truncated), "truncated.gguf: not a readable GGUF file")


@pytest.mark.parametrize("metadata,fragments", [
    # 5 heads do not divide the 256-wide embedding (contracts.identity may refuse it first, in its own words)
    ({"llama.attention.head_count": 5}, ("heads.gguf:", "5 ", "heads", "wrong")),
    # 8 heads of 32 make the query's 256, but 2 KV heads of 32 are not the K tensor's 128
    ({"llama.attention.head_count": 8}, ("blk.0.attn_k has 128 outputs, but the metadata's 2 KV heads of size 32",
                                         "head count is wrong")),
    ({"llama.attention.head_count_kv": 4}, ("blk.0.attn_k has 128 outputs, but the metadata's 4 KV heads of size 64",
                                            "head count is wrong")),
], ids=["heads-do-not-divide", "heads-mismatch-tensors", "kv-heads-mismatch-tensors"])
def test_a_wrong_head_count_fails_in_one_line(capsys, tiny_gguf, tmp_path, metadata, fragments):
    broken = patched_gguf(tiny_gguf("llama"), tmp_path / "heads.gguf", metadata)
    assert_one_line_failure(*check_model(capsys, broken), *fragments)


@pytest.mark.parametrize("arch", ["bert", "gptneox"])
def test_an_unsupported_architecture_gives_the_serve_message(capsys, tiny_gguf, tmp_path, arch):
    other = patched_gguf(tiny_gguf("llama"), tmp_path / f"{arch}.gguf", arch=arch)
    with pytest.raises(UnsupportedModelError) as refused:
        check_supported(str(other))
    line = assert_one_line_failure(*check_model(capsys, other))
    assert line == f"FAIL: {refused.value}"


def test_llama_cpp_refusing_the_file_fails_in_one_line(capsys, tiny_gguf, tmp_path):
    """A tensor missing: the metadata reads fine, llama.cpp's load fails, and its error is the message."""
    broken = patched_gguf(tiny_gguf("llama"), tmp_path / "no-norm.gguf", drop="output_norm.weight")
    assert_one_line_failure(*check_model(capsys, broken), "llama.cpp could not load", "output_norm.weight")


def test_memory_prints_the_plan_edge_serve_would_make(capsys, tiny_gguf, monkeypatch):
    """--memory is the budget: the same plan as `edge serve --memory-budget` (edge/check_model/memory.py), part by
    part, in the table and in the JSON."""
    from contracts.memory_plan import MemoryPlan, plan_memory
    from contracts.model_sizes import model_sizes
    from edge.check_model import memory
    from edge.config import ServeConfig
    monkeypatch.setattr(memory, "gpu_memory_bytes", lambda: 0)  # a CPU box whatever runs the test
    path = tiny_gguf("llama")
    box = memory.machine("cpu")
    config = ServeConfig(memory_budget=4 * GIB)
    plan = plan_memory(model_sizes(str(path)), box, memory.plan_config(config, box, "f16"))
    status, out, _ = check_model(capsys, path, "--no-fidelity", "--memory", "4GiB")
    assert status == 0 and out.splitlines()[-1] == "PASS"
    assert "\n".join("  " + line if line else "" for line in plan.describe().splitlines()) in out
    assert "of the 4096.0 MiB budget" in out
    status, out, _ = check_model(capsys, path, "--no-fidelity", "--memory", "4GiB", "--json")
    shown = json.loads(out)["memory_plan"]
    assert status == 0 and shown["describe"] == plan.describe()
    assert shown["budgets"] == {"host": 4 * GIB} and shown["kv_cache_tokens"] == plan.kv_cache_tokens
    assert [p["name"] for p in shown["parts"]] == [p.name for p in plan.parts] and isinstance(plan, MemoryPlan)


def test_memory_that_cannot_hold_the_model_fails_with_the_refusal_serve_gives(capsys, tiny_gguf, monkeypatch):
    from edge.check_model import memory
    monkeypatch.setattr(memory, "gpu_memory_bytes", lambda: 0)
    status, out, err = check_model(capsys, tiny_gguf("llama"), "--no-fidelity", "--memory", "200MiB")
    line = assert_one_line_failure(status, out, err, "FAIL: would be refused at start: ", "budget host 200 MiB")
    assert "memory plan: would be refused at start: " in out and "decode weights" in line and "MiB (host)" in line
    status, out, _ = check_model(capsys, tiny_gguf("llama"), "--no-fidelity", "--memory", "200MiB", "--json")
    report = json.loads(out)
    assert status == 1 and not report["passed"] and "budget host 200 MiB" in report["memory_plan"]["refused"]
    assert report["error"] == f"would be refused at start: {report['memory_plan']['refused']}"
