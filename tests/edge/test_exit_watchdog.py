"""SIGTERM's bound holds past the drain: a non-daemon thread that never returns cannot hold `edge serve`'s
interpreter at exit (it joins such threads), because a watchdog ends the process and logs what held it."""

import subprocess
import sys
import time

SCRIPT = """
import threading
from edge.cli import _exit_within
held = threading.Event()
threading.Thread(target=held.wait, name="stuck-worker").start()  # non-daemon, never set: exit would wait forever
_exit_within(1.0, 3)
"""


def test_a_thread_that_never_returns_cannot_hold_the_exit():
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - began < 30  # 1 s watchdog; an interpreter start on a loaded box is the rest
    assert "did not exit within 1 s" in done.stderr and "stuck-worker" not in done.stdout
    assert "Thread 0x" in done.stderr  # faulthandler's dump of the threads, the stuck one among them


def test_a_clean_exit_is_not_delayed():
    script = "from edge.cli import _exit_within\n_exit_within(30.0, 3)\n"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and time.monotonic() - began < 25, done.stderr


def test_main_called_in_process_arms_no_watchdog(monkeypatch):
    """Only the command (the console script) bounds the exit: a test calling main() in its own process, with the
    server stubbed, must not be ended 10 s later (an armed watchdog once ended a whole test run with status 0)."""
    import threading

    from aiohttp import web

    import edge.app
    from edge import cli
    monkeypatch.setattr(edge.app, "make_app", lambda config: web.Application())
    monkeypatch.setattr(cli.web, "run_app", lambda app, **kwargs: None)
    cli.main(["serve", "--port", "0"])
    assert not [t for t in threading.enumerate() if t.name == "exit-watchdog"]


def test_the_console_script_is_the_bounded_command():
    import importlib.metadata
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "edge"]
    assert script.value == "edge.cli:command"
