"""paths.staged: a directory appears whole or not at all, whatever stops its writer."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from scripts.common import paths
from tests.conftest import assert_killed_cleanly, kill_midway


def test_staged_renames_on_success_and_replaces_the_old(tmp_path):
    dest = tmp_path / "w"
    dest.mkdir()
    (dest / "old").write_text("old")
    with paths.staged(dest) as tmp:
        assert tmp.parent == dest.parent and tmp.name.startswith(".w.partial-") and not any(tmp.iterdir())
        (tmp / "new").write_text("new")
        assert (dest / "old").exists()  # the old one stays until the new one is complete
    assert [p.name for p in dest.iterdir()] == ["new"] and paths.staging_dirs(dest) == []


def test_staged_removes_its_work_when_the_block_raises(tmp_path):
    dest = tmp_path / "w"
    with pytest.raises(RuntimeError), paths.staged(dest) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")
    assert not dest.exists() and paths.staging_dirs(dest) == []


def test_clear_stale_keeps_a_live_writers_directory(tmp_path):
    dest = tmp_path / "w"
    live = tmp_path / f".w{paths.STAGING}1"  # pid 1 is alive
    dead = tmp_path / f".w{paths.STAGING}999999999"
    live.mkdir()
    dead.mkdir()
    assert paths.clear_stale(dest) == [dead] and live.exists()


WRITER = """
import sys, time
from pathlib import Path
from scripts.common import paths
with paths.staged(Path(sys.argv[1])) as tmp:
    for i in range(600):
        (tmp / f"part{i}").write_text("x" * 1000)
        time.sleep(0.05)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_writer_stopped_midway_leaves_no_half_written_directory(tmp_path, sig):
    dest = tmp_path / "w"
    rc, out = kill_midway([sys.executable, "-c", WRITER, str(dest)], dest, sig)
    if sig == signal.SIGINT:  # Ctrl-C: KeyboardInterrupt, the block's cleanup runs
        assert rc == -signal.SIGINT and "KeyboardInterrupt" in out and paths.staging_dirs(dest) == [] and not dest.exists()
    else:
        assert_killed_cleanly(rc, sig, dest, None, out)


def test_the_next_run_after_a_kill_starts_clean_and_completes(tmp_path):
    dest = tmp_path / "w"
    rc, _ = kill_midway([sys.executable, "-c", WRITER, str(dest)], dest, signal.SIGKILL)
    stale = paths.staging_dirs(dest)
    assert rc == -signal.SIGKILL and len(stale) == 1
    done = subprocess.run([sys.executable, "-c", WRITER.replace("range(600)", "range(3)"), str(dest)],
                          cwd=paths.ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["part0", "part1", "part2"] and paths.staging_dirs(dest) == []
    assert time.time() - dest.stat().st_mtime < 60


CLEANUP = """
import os, signal, sys, time
from pathlib import Path
from scripts.common import paths
with paths.terminate_raises():
    try:
        Path(sys.argv[1]).write_text("started")
        time.sleep(60)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM while cleaning up (make forwards the group's one)
        time.sleep(0.5)
        Path(sys.argv[1]).write_text("cleaned up")
"""


def test_a_second_sigterm_does_not_cut_the_clean_up_short(tmp_path):
    flag = tmp_path / "flag"
    p = subprocess.Popen([sys.executable, "-c", CLEANUP, str(flag)], cwd=paths.ROOT)
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert flag.read_text() == "cleaned up"
