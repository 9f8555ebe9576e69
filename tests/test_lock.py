"""One writer per run folder (issue 30): rundir.acquire_lock holds run.lock with an flock that the OS
drops however the holder dies; a second process is refused with one sentence naming the holder; a
lock written on another host is honoured until it goes stale, then taken over with a warning. (A
second run started beside a live one, on 1 and 2 ranks: tests/test_ckpt.py.)"""

import json
import os
import socket
import time

from retrieval_kit import rundir
from tests.conftest import python_run

PROBE = """import sys
from retrieval_kit import rundir
said = rundir.acquire_lock(sys.argv[1])
print("REFUSED: " + said if said else "ACQUIRED")
"""


def other_process_tries(run_dir, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = python_run([script, run_dir])
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_a_second_process_is_refused_while_the_first_holds_the_folder(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    assert rundir.acquire_lock(run_dir) is None
    try:
        holder = json.loads((tmp_path / "run" / rundir.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        said = other_process_tries(run_dir, tmp_path)
        assert said.startswith("REFUSED: --output-dir") and f"pid {os.getpid()}" in said, said
        assert rundir.acquire_lock(run_dir) is None  # this process already holds it
    finally:
        rundir.release_lock(run_dir)
    released = json.loads((tmp_path / "run" / rundir.LOCK_FILE).read_text())
    assert released["released"] is True and released["pid"] == os.getpid()  # who held it stays said
    assert other_process_tries(run_dir, tmp_path) == "ACQUIRED"  # its holder (the probe) has exited since


def test_a_lock_from_another_host_holds_until_stale_then_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / rundir.LOCK_FILE
    lock.write_text(json.dumps({"host": "node-b", "pid": 4242, "started": "earlier"}))
    said = rundir.acquire_lock(str(run_dir))
    assert said and "a run on host node-b (pid 4242) holds it" in said and "delete" in said
    old = time.time() - rundir.LOCK_STALE_S - 5
    os.utime(lock, (old, old))
    try:
        assert rundir.acquire_lock(str(run_dir)) is None
        assert "taking over the lock of host node-b" in capsys.readouterr().out
    finally:
        rundir.release_lock(str(run_dir))
    lock.write_text(json.dumps({"host": "node-b", "pid": 4242, "released": True}))  # ended cleanly there
    try:
        assert rundir.acquire_lock(str(run_dir)) is None and "taking over" not in capsys.readouterr().out
    finally:
        rundir.release_lock(str(run_dir))
