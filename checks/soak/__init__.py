"""Chaos soak: the real service for a bounded time under a modest mix of streaming and non-streaming requests at
several priorities, client disconnects, hostile bodies and scheduled faults (SIGKILL and SIGSTOP of a prefill
worker, SIGKILL of the decode engine, a bad policy file). Then it checks what an operator relies on: every request
ended in one outcome its client saw (never a 500, never a hang), the service settles back to idle and still serves
every class, no process's memory grew, and nothing outlived the service. Prints markdown tables; exit status 1
when a check failed (docs/reliability.md).

    python -m checks.soak --duration 300

service.py: the service's config and policy, and how the soak reads it; client.py: what the clients send and how
they judge each answer; faults.py: the faults and their recovery; memory.py: RSS per process and what outlived
the service; report.py: the checks and the tables; harness.py: the threads, and run_soak.
"""

import sys
from pathlib import Path

# tests/server_process.py starts and stops the service; checks/ and tests/ are not installed packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
