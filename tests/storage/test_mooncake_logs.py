"""Mooncake's logs: warnings and errors by default, all of it with PORTABLE_KV_DEBUG=1, a level the
user set kept (docs/API.md, "Mooncake's logs").  The level is read when Mooncake's module is first
imported, so each case runs a put and a get in a fresh process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from storekit import needs_mooncake

from portable_kv.storage import mooncake_logs

HERE = Path(__file__).resolve().parent
GLOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ (\S+?):\d+\] (.*)$")
# What Mooncake 0.3.13's client prints on every start at ERROR, whatever the level (MC_LOG_LEVEL stops at ERROR).
SETUP_ERROR = ("transfer_metadata.cpp", "Local segment descriptor not found")
LEVEL_VARIABLES = ("MC_LOG_LEVEL", "GLOG_minloglevel", "PORTABLE_KV_DEBUG")

RUN = """
import json, sys, torch
from storekit import make_host, page_tokens, unique_keys
from portable_kv import storage
from portable_kv.storage.master import MooncakeMaster

with MooncakeMaster() as master:
    _, host = make_host()
    keys = unique_keys(2)
    with storage.MooncakeStore(host, master=master.address, segment_size_gb=0.0625) as store:
        put = store.put(keys, page_tokens(torch.tensor([1, 2]), host.page_size))
        got = store.get(keys, page_tokens(torch.tensor([5, 6]), host.page_size))
    host.close()
    log = master.log_tail(1 << 20)
print(json.dumps({"put": put, "get": got, "master_log": log}))
"""


def run(**env: str) -> tuple[list[str], list[str]]:
    """A put and a get in a fresh process with its own master: (the client process's stderr lines, the master's log lines)."""
    environ = {k: v for k, v in os.environ.items() if k not in LEVEL_VARIABLES}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", RUN], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["put"] == [True, True] and answer["get"] == [True, True]
    return done.stderr.splitlines(), answer["master_log"].splitlines()


def glog(lines: list[str], severity: str) -> list[tuple[str, str]]:
    return [(m.group(2), m.group(3)) for m in map(GLOG_LINE.match, lines) if m and m.group(1) == severity]


@needs_mooncake
def test_a_default_run_prints_only_mooncakes_setup_error():
    client, master = run()
    assert glog(client, "I") == [] and glog(client, "W") == [], "Mooncake's INFO or WARNING lines on a default run"
    # The one line left: Mooncake logs it at ERROR while its client sets up, and nothing but a level
    # above ERROR (which Mooncake does not accept) would hide it without hiding real errors.
    assert glog(client, "E") == [SETUP_ERROR]
    assert glog(master, "I") == [], "the master's INFO lines on a default run"


@needs_mooncake
def test_portable_kv_debug_shows_everything():
    client, master = run(PORTABLE_KV_DEBUG="1")
    assert ("real_client.cpp", "Mounting segment: 67108864 bytes, 67108864 of 67108864") in glog(client, "I")
    assert SETUP_ERROR in glog(client, "E")
    assert any(text.startswith("Master service started on port") for _, text in glog(master, "I"))


@needs_mooncake
def test_a_level_the_user_set_is_kept():
    client, master = run(MC_LOG_LEVEL="INFO")
    assert glog(client, "I") and glog(master, "I"), "MC_LOG_LEVEL=INFO was overridden"
    client, master = run(GLOG_minloglevel="2")
    assert glog(client, "I") == [] and glog(client, "W") == []
    assert glog(master, "I") == [] and glog(master, "W") == [], "GLOG_minloglevel=2 was overridden for the master"


@pytest.mark.parametrize(
    "environ,client,master",
    [
        ({}, "WARNING", "1"),
        ({"PORTABLE_KV_DEBUG": "1"}, None, None),
        ({"MC_LOG_LEVEL": "ERROR"}, "ERROR", "2"),
        ({"MC_LOG_LEVEL": "TRACE", "PORTABLE_KV_DEBUG": "0"}, "TRACE", "0"),
        ({"GLOG_minloglevel": "0"}, "INFO", "0"),
        ({"GLOG_minloglevel": "3", "PORTABLE_KV_DEBUG": "1"}, "ERROR", "3"),
        ({"MC_LOG_LEVEL": "WARNING", "GLOG_minloglevel": "2"}, "WARNING", "2"),
    ],
)
def test_which_level_each_side_gets(monkeypatch, environ, client, master):
    for name in LEVEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)  # PORTABLE_KV_DEBUG is read from the process environment
    env = dict(environ)
    mooncake_logs.client_environment(env)
    assert env.get("MC_LOG_LEVEL") == client
    assert mooncake_logs.master_environment([], environ).get("GLOG_minloglevel") == master
    assert "GLOG_minloglevel" not in mooncake_logs.master_environment(["--minloglevel=0"], {}), "a --minloglevel flag is the user's level"
