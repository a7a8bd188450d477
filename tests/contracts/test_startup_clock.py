"""since_start: the seconds a process has run, as the start-up log lines give them."""

import subprocess
import sys

CHILD = "import time; time.sleep(0.5); from contracts.startup_clock import since_start; print(since_start())"


def test_a_process_reads_how_long_it_has_run():
    ran_s = float(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= ran_s < 5.0  # the sleep, plus the interpreter's start and the import
