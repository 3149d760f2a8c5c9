"""How much Mooncake prints: its warnings and errors by default, all of it with PORTABLE_KV_DEBUG=1.

Mooncake logs through glog to stderr.  Its client (the `mooncake.store`
module) takes its level from MC_LOG_LEVEL (INFO, WARNING or ERROR; TRACE is
INFO with transfer traces), read once, when the module is first imported, and
that level replaces glog's own GLOG_minloglevel.  `mooncake_master` reads
glog's GLOG_minloglevel (0 INFO, 1 WARNING, 2 ERROR) or its --minloglevel
flag.  Neither accepts a level above ERROR, so what is left by default is
Mooncake's warnings and errors (docs/API.md, "Mooncake's logs").

A level the user set is kept: MC_LOG_LEVEL for the client, GLOG_minloglevel
or --minloglevel for the master; one given only in the other variable is
carried over, so either variable sets both sides.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

from .. import config

QUIET = "WARNING"
# MC_LOG_LEVEL's names and glog's numbers for them.
SEVERITY = {"TRACE": 0, "INFO": 0, "WARNING": 1, "ERROR": 2}
NAMES = ("INFO", "WARNING", "ERROR")


def client_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set MC_LOG_LEVEL before `mooncake.store` is first imported; a module imported earlier keeps the level it read."""
    if environ.get("MC_LOG_LEVEL", "").strip():
        return
    glog = environ.get("GLOG_minloglevel", "").strip()
    if glog.isdigit():
        # The client would ignore it: Mooncake sets glog's level from MC_LOG_LEVEL alone.
        environ["MC_LOG_LEVEL"] = NAMES[min(int(glog), len(NAMES) - 1)]
    elif not config.DEBUG.flag():
        environ["MC_LOG_LEVEL"] = QUIET


def master_environment(args: Sequence[str], environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The environment for a `mooncake_master` started with `args`: GLOG_minloglevel set unless the user chose a level."""
    env = dict(environ)
    if env.get("GLOG_minloglevel", "").strip() or any(arg.lstrip("-").startswith("minloglevel") for arg in args):
        return env
    level = env.get("MC_LOG_LEVEL", "").strip()
    if level in SEVERITY:
        env["GLOG_minloglevel"] = str(SEVERITY[level])
    elif not level and not config.DEBUG.flag():
        env["GLOG_minloglevel"] = str(SEVERITY[QUIET])
    return env
