"""A loopback `mooncake_master` for tests, benchmarks and the command line.

Binds its RPC and metrics servers to one address (127.0.0.1 by default) on
free ports, waits until the RPC port accepts a connection (bounded), and is
stopped by its PID: `with MooncakeMaster() as master: ... master.address`.
Production clusters run their own masters; this module never starts the
HTTP metadata server, which binds 0.0.0.0 whatever host it is given.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import IO, Any

from . import mooncake_logs

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


# How to get Mooncake's client and master: the package's `mooncake` extra.
INSTALL_HINT = ("install the mooncake extra: pip install 'portable-kv[mooncake]' (from a checkout: pip install -e \".[mooncake]\"; "
                "its binaries need libibverbs1)")


def master_binary() -> str | None:
    """Path of the `mooncake_master` executable the installed Mooncake wheel ships, or on PATH; None if absent."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "mooncake_master"
            if candidate.is_file():
                return str(candidate)
    return shutil.which("mooncake_master")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on at the moment of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def answers(address: str, timeout_s: float = 1.0) -> bool:
    """True if a TCP connection to `address` ("host:port") opens within `timeout_s`."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port"; ValueError naming the expectation otherwise."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master: expected 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


class MooncakeMaster:
    """One `mooncake_master` process on `host`, started by `start()` and stopped by PID in `stop()`.

    `lease_ttl_ms` shortens how long an object stays pinned after a get
    (Mooncake's default is 10 s), so tests can fill and evict quickly.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, lease_ttl_ms: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.host = host
        self.port = port
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._finalizer: weakref.finalize | None = None  # stops the process if the object is dropped or at exit

    @property
    def address(self) -> str:
        """"host:port" of the RPC server, what `MooncakeStore(master=...)` takes."""
        if self.port is None:
            raise RuntimeError("MooncakeMaster: not started")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The master's process id while it runs."""
        return self.process.pid if self.process is not None else None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> MooncakeMaster:
        """Start the master and return once its RPC port answers; RuntimeError (with its log) if it exits or stays silent for `timeout_s`."""
        if self.process is not None:
            if self.process.poll() is None:
                raise RuntimeError(f"MooncakeMaster: already running as PID {self.process.pid}")
            self.stop()  # killed or exited: reaped, its log closed; start afresh
        binary = master_binary()
        if binary is None:
            raise FileNotFoundError(f"mooncake_master: not found; {INSTALL_HINT}")
        self.port = self.port or free_port(self.host)
        args = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            # The metrics server would otherwise take 0.0.0.0:9003, shared by every master on the host.
            f"--metrics_host={self.host}",
            f"--metrics_port={free_port(self.host)}",
            *([f"--default_kv_lease_ttl={self.lease_ttl_ms}"] if self.lease_ttl_ms is not None else []),
            *self.extra_args,
        ]
        self._log = tempfile.TemporaryFile()
        env = mooncake_logs.master_environment(args)
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        # Detached from the terminal's process group: a Ctrl-C never reaches it, so this object stops it,
        # also when dropped without stop() or at interpreter exit.
        self._finalizer = weakref.finalize(self, _terminate, self.process, self._log)
        try:
            self._wait_ready(timeout_s)
        except BaseException:  # an interrupt too: no master is left running behind a failed start
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master on {self.host}:{self.port} exited at start:\n{self.log_tail()}")
            if answers(self.address, timeout_s=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master on {self.host}:{self.port} did not answer within {timeout_s:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the master by PID (a crash, for fault tests) and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after STOP_TIMEOUT_S; idempotent."""
        finalizer, self._finalizer = self._finalizer, None
        self.process, self._log = None, None
        if finalizer is not None:
            finalizer()

    def log_tail(self, limit: int = 4000) -> str:
        """The last `limit` characters of the master's output."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def __enter__(self) -> MooncakeMaster:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(process: subprocess.Popen, log: Any) -> None:
    """SIGTERM by PID, SIGKILL after STOP_TIMEOUT_S, then reap; the log file closed."""
    try:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        log.close()

