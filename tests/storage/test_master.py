"""MooncakeMaster's own lifetime: no master process outlives a failed or interrupted start,
a dropped object, or a kill followed by a restart."""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest

from portable_kv.storage import master as master_module
from portable_kv.storage.master import MooncakeMaster


@pytest.fixture
def silent_master(tmp_path, monkeypatch):
    """A stand-in mooncake_master that starts but never listens (a slow or stuck master)."""
    binary = tmp_path / "mooncake_master"
    binary.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    binary.chmod(0o755)
    monkeypatch.setattr(master_module, "master_binary", lambda: str(binary))
    return binary


def running(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:  # reaped: gone
        return False


def test_an_interrupted_start_leaves_no_master_running(silent_master):
    master = MooncakeMaster()
    started = []
    real_wait = master._wait_ready

    def interrupted(timeout_s):
        started.append(master.pid)
        raise KeyboardInterrupt  # Ctrl-C while waiting for the port

    master._wait_ready = interrupted
    with pytest.raises(KeyboardInterrupt):
        with master:
            pass
    master._wait_ready = real_wait
    assert started and started[0] is not None
    assert not running(started[0]), "the master outlived an interrupted start"
    assert master.process is None


def test_a_start_that_times_out_leaves_no_master_running(silent_master):
    master = MooncakeMaster()
    with pytest.raises(RuntimeError, match="did not answer within"):
        master.start(timeout_s=0.5)
    assert master.process is None


def test_a_dropped_master_object_stops_its_process(silent_master):
    master = MooncakeMaster()
    master._wait_ready = lambda timeout_s: None  # taken as ready
    master.start()
    pid = master.pid
    del master
    gc.collect()
    deadline = time.monotonic() + 15
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid), "a dropped MooncakeMaster left its process running"


def test_a_killed_master_can_be_started_again(own_master):
    first = own_master.pid
    own_master.kill()
    own_master.start()
    assert own_master.pid != first and own_master.process.poll() is None
    os.kill(own_master.pid, 0)  # alive
    own_master.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # reaped by kill(): gone
