"""The gateway's temporary run dir (local sockets): it names its owner, and the run dirs of a gateway that was killed
before its cleanup ran are removed at the next start; any other dir is left alone (issue 48)."""

import os
import subprocess
import sys
from pathlib import Path

import psutil

import edge.launch.local
from edge.config import ServeConfig
from edge.launch.local import OWNER_FILE, remove_stale_run_dirs


def _gone_gateway() -> str:
    """The owner line of a process that ran and was killed (SIGKILL: no cleanup of its own)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    line = _owner_line(child.pid)
    child.kill()
    child.wait()
    return line


def _owner_line(pid: int) -> str:
    return f"{pid} {psutil.Process(pid).create_time()}\n"


def test_only_the_run_dirs_of_gone_gateways_are_removed(tmp_path):
    gone = _gone_gateway()
    dead = tmp_path / "edge-dead"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(gone)
    (dead / "engine.sock").write_text("")
    live = tmp_path / "edge-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(_owner_line(os.getpid()))
    reused = tmp_path / "edge-reused"  # its pid is a process that started after the dir was made: another one
    reused.mkdir()
    (reused / OWNER_FILE).write_text(f"{os.getpid()} {psutil.Process().create_time() - 3600}\n")
    no_owner = tmp_path / "edge-unowned"  # made by something else (or an older build): not ours to judge
    no_owner.mkdir()
    other = tmp_path / "other-dir"
    other.mkdir()
    (other / OWNER_FILE).write_text(gone)

    removed = remove_stale_run_dirs(str(tmp_path))
    assert sorted(Path(p).name for p in removed) == ["edge-dead", "edge-reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edge-live", "edge-unowned", "other-dir"]


def test_a_new_run_dir_names_this_gateway_and_clears_a_killed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(edge.launch.local.tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / "edge-stale"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(_gone_gateway())
    run_dir = Path(edge.launch.local.make_run_dir(ServeConfig()))
    assert run_dir.parent == tmp_path and not stale.exists()
    assert (run_dir / OWNER_FILE).read_text() == _owner_line(os.getpid())
    assert run_dir.stat().st_mode & 0o777 == 0o700
