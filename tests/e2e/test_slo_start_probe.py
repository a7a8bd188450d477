"""Issue 47, item 1, against the real server: with a class that promises a TTFT, `edge serve` knows its prefill line
before /health turns 200. threads_per_worker = 3 (settings no other test serves with, and this test sends no request,
so no record is written for them): the line is measured at start by real prefills on the embedded model, and the
log says so before its ready line."""

import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.slow

CONFIG = "kv_cache_tokens = 8192\nmax_model_len = 1200\nprefill_workers = 1\nthreads_per_worker = 3\n"
POLICY = """version = 1
default_class = "chat"
[classes.chat]
priority = 0
ttft_slo_ms = 2000
on_slo_miss = "reject"
"""


def test_the_prefill_line_is_known_before_ready(tmp_path):
    with ServerProcess(CONFIG, tmp_path, POLICY).start():
        pass
    # read once the server stopped: its ready line may be written a moment after /health turns 200
    lines = (tmp_path / "serve.log").read_text().splitlines()
    ready = next(i for i, line in enumerate(lines) if "ready: the decode engine and" in line)
    known = [i for i, line in enumerate(lines) if "slo: prefill line measured at start:" in line
             or "TTFT prediction starts from the prefill line recorded" in line]  # a record from an earlier run
    assert known and known[0] < ready, "\n".join(lines[-40:])
