"""since_start: the seconds a process has run, as the start-up log lines give them."""

import subprocess
import sys
import time

CHILD = "import time; time.sleep(0.5); from contracts.startup_clock import since_start; print(since_start())"


def test_a_process_reads_how_long_it_has_run():
    began = time.monotonic()
    ran_s = float(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout)
    lived_s = time.monotonic() - began
    # At least the sleep, and no more than the child lived as seen from here (its start to its exit), plus the
    # clock's 10 ms steps: as tight as the old 5 s bound on an idle machine, and a loaded one cannot break it.
    assert 0.5 <= ran_s <= lived_s + 0.05, (ran_s, lived_s)
