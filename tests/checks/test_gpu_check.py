"""The GPU check's driver on the CPU with a tiny model: every stage runs, a failing stage is reported in the
table instead of stopping the run, and the result block of the output file is replaced, its prose kept."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checks import gpu_check, gpu_models, gpu_report

PROSE = "# GPU check\n\nWhat it does.\n\n"
OLD_BLOCK = f"{gpu_report.BEGIN} -->\nNOT run on a GPU yet.\n{gpu_report.END}\n\n## After\n"


def _rows(text: str) -> dict[tuple[int, int], list[str]]:
    """(batch, context) -> the cells of the result table's tiny rows."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "tiny":
            rows[int(cells[1]), int(cells[2])] = cells
    return rows


def _number(cell: str) -> float:
    return float(re.match(r"[0-9.]+", cell).group())


@pytest.mark.slow
def test_tiny_cpu_run_fills_the_table_and_reports_a_failing_stage(tmp_path, monkeypatch):
    real = gpu_models.time_generate

    def generate_failing_at_batch_2(model, shape, device, context, batch, steps):
        if batch == 2:
            raise RuntimeError("injected failure")
        return real(model, shape, device, context, batch, steps)

    monkeypatch.setattr(gpu_models, "time_generate", generate_failing_at_batch_2)
    out = tmp_path / "gpu.md"
    out.write_text(PROSE + OLD_BLOCK)
    code = gpu_check.main(["--device", "cpu", "--tiny", "--skip-tests", "--out", str(out),
                           "--wheels", str(tmp_path / "no-wheels")])
    text = out.read_text()
    assert code == 1  # the injected failure makes the run fail, after writing everything else
    assert text.startswith(PROSE) and text.endswith("\n\n## After\n") and "NOT run on a GPU yet" not in text
    rows = _rows(text)
    assert sorted(rows) == [(1, 32), (1, 64), (2, 32), (2, 64)]
    column = {name: i for i, name in enumerate(gpu_report.COLUMNS)}
    for (batch, _), cells in rows.items():
        ms = _number(cells[column["ours ms/step"]])
        assert ms > 0 and _close(_number(cells[column["ours tok/s"]]), batch * 1e3 / ms)
        assert 0 < _number(cells[column["% of floor"]]) <= 100
        assert _number(cells[column["generate_batch ms/step"]]) > 0
        generate = cells[column["generate ms/step"]]
        assert generate.startswith("error: RuntimeError: injected failure") if batch == 2 else _number(generate) > 0
    assert re.search(r"\| device \| ok \|", text) and "torch " in text and "copy bandwidth:" in text
    for held in ("float32", "int8", "int4"):  # the weight_dtype stage (checks/gpu_weights.py)
        assert re.search(rf"weights tiny context 32 {held}: [0-9.]+ GiB; batch 1: \d+ tok/s", text), held
    assert re.search(r"int4 / float32 at batch 1 = [0-9.]+x", text)
    # the native forward stage (checks/gpu_forward.py): every configuration ran on the model edge serve serves,
    # graphs and eager agree
    assert re.search(r"native forward tiny \(serving model\) context 32 batch 2: step native graphs [0-9.]+ ms", text)
    assert "native forward tiny: deterministic tokens, graphs against eager: identical" in text
    assert re.search(r"native forward tiny: tokens equal to transformers' forward \(eager\): \d+/\d+", text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure of the device stage")
def test_no_cuda_device_is_a_failed_stage_and_the_report_is_still_written(tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--device", "cuda", "--out", str(out), "--wheels", str(tmp_path)]) == 1
    text = out.read_text()
    assert "| device | FAILED: RuntimeError: --device cuda was asked for" in text
    assert text.startswith(gpu_report.BEGIN) and text.rstrip().endswith(gpu_report.END)


@pytest.mark.slow
def test_the_gpu_test_files_collect_without_llama_cpp():
    """The GPU machines have no llama.cpp: the files the check hands to pytest must not import it."""
    files = gpu_check.gpu_test_files()
    assert {"tests/decode_gpu/test_triton_attention.py", "tests/decode_gpu/test_sampler.py"} <= set(files)
    folders = sorted({str(Path(f).parent) for f in files})
    modules = [Path(f).stem for f in ["tests/conftest.py", *files]]
    probe = (f"import sys; sys.path[:0] = ['tests', '.', *{folders!r}]; import {', '.join(modules)}; "
             "bad = [m for m in sys.modules if m.split('.')[0] in ('llama_cpp', 'prefill_cpu')]; "
             "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _close(printed_tok_s: float, from_printed_ms: float) -> bool:
    """tok/s is printed as an integer from the unrounded step time, ms with two decimals: allow both roundings."""
    return abs(printed_tok_s - from_printed_ms) <= 0.5 + 0.01 * from_printed_ms
