"""The chaos soak (checks/soak/) for 60 s in CI: mixed load, client disconnects, hostile bodies, a killed and
a frozen prefill worker, a killed decode engine and a bad policy reload; every check of the soak must hold."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # checks/ is not an installed package

from checks.soak.harness import run_soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_60_second_chaos_soak_keeps_every_promise(tmp_path):
    report = run_soak(duration_s=60, workdir=tmp_path, warmup_s=20)
    print(report.markdown())  # pytest -s shows the tables; a failure message carries them too
    assert not report.failures, "\n".join(report.failures) + "\n\n" + report.markdown() + \
        f"\n\nservice log: {report.log_path}"
