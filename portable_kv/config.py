"""Every setting portable_kv reads from the environment, in one place.

Each `PORTABLE_KV_*` variable is read here and nowhere else, when it is asked
for (tests and `portable-kv` set them per run); docs/API.md lists them in one
table.  A value is validated wherever it is read: a malformed one raises
`ConfigError` naming the variable and what it takes.  `check_all()` validates
every setting at once, so that an entry point (`portable-kv check`,
`portable_kv.engines.sglang.install()`) fails at its start rather than at the first
read deep inside a pool; binding a backend checks the io settings
(`IO_SETTINGS`) whatever the backend; `states()` reports each one for
`portable-kv info`.

This module imports nothing of the package: it is the lowest layer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


class ConfigError(ValueError):
    """A PORTABLE_KV_* variable holds a value that cannot be used."""


# The io paths a host pool offers (portable_kv.io.mover keeps the movers behind them; a test holds the two together).
IO_PATHS = ("kernel", "direct", "staged", "auto", "bulk")
# SGLang's --hicache-io-backend choices, which PORTABLE_KV_SGLANG_IO maps to io paths.
SGLANG_IO_CHOICES = ("kernel", "direct")
BACKEND_NAMES = ("cuda", "rocm", "triton", "cpu")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# A parser takes a set value and returns None, or a sentence saying what the variable expects.
Parser = Callable[[str], "str | None"]


def _any(_: str) -> str | None:
    return None


def _integer(minimum: int) -> Parser:
    def check(value: str) -> str | None:
        try:
            number = int(value)
        except ValueError:
            return f"expected an integer, got {value!r}"
        return None if number >= minimum else f"expected an integer >= {minimum}, got {number}"

    return check


def _choice(names: tuple[str, ...], case_sensitive: bool = True) -> Parser:
    def check(value: str) -> str | None:
        given = value if case_sensitive else value.upper()
        return None if given in names else f"expected one of {', '.join(names)}, got {value!r}"

    return check


def _flag(value: str) -> str | None:
    return None if value.lower() in TRUE_WORDS + FALSE_WORDS else f"expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)}, got {value!r}"


def sglang_io_mapping(value: str) -> dict[str, str]:
    """PORTABLE_KV_SGLANG_IO parsed: SGLang's io choice -> portable_kv io path.

    One path (every choice takes it) or pairs ``kernel=auto,direct=staged``."""
    pairs = [part.strip() for part in value.split(",") if part.strip()]
    if len(pairs) == 1 and "=" not in pairs[0]:
        pairs = [f"{choice}={pairs[0]}" for choice in SGLANG_IO_CHOICES]
    mapping = {}
    for pair in pairs:
        choice, _, path = (text.strip() for text in pair.partition("="))
        if choice not in SGLANG_IO_CHOICES or path not in IO_PATHS:
            raise ConfigError(f"PORTABLE_KV_SGLANG_IO: expected one of {', '.join(IO_PATHS)} or pairs like "
                              f"kernel=staged,direct=auto (SGLang's choices: {', '.join(SGLANG_IO_CHOICES)}), got {value!r}")
        mapping[choice] = path
    return mapping


def _sglang_io(value: str) -> str | None:
    try:
        sglang_io_mapping(value)
    except ConfigError as exc:
        return str(exc).partition(": ")[2]
    return None


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None
    meaning: str
    parser: Parser = _any

    def given(self) -> str | None:
        """The value set in the environment, unchecked; None where unset or blank."""
        return os.environ.get(self.name, "").strip() or None

    def problem(self) -> str | None:
        """What is wrong with the value set, or None where it can be used (or none is set)."""
        value = self.given()
        return None if value is None else self.parser(value)

    def raw(self) -> str | None:
        """The value in force (set, else the default), validated: a malformed one raises ConfigError."""
        value = self.given()
        if value is None:
            return self.default
        problem = self.parser(value)
        if problem:
            raise ConfigError(f"{self.name}: {problem}")
        return value

    def integer(self, minimum: int = 0) -> int | None:
        """The value as an int, None where unset without a default; below `minimum` (a reader's own bound) is a ConfigError."""
        value = self.raw()
        if value is None:
            return None
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{self.name}: expected an integer, got {value!r}") from None
        if number < minimum:
            raise ConfigError(f"{self.name}: expected an integer >= {minimum}, got {number}")
        return number

    def flag(self) -> bool:
        # Not "in TRUE_WORDS": Triton's own switch, read here unvalidated, is on for any value but a false word.
        return (self.raw() or "0").lower() not in FALSE_WORDS


BACKEND = Setting("PORTABLE_KV_BACKEND", None, "backend to bind at first use: cuda, rocm, triton or cpu (default: detected)",
                  _choice(BACKEND_NAMES))
BLOCKS = Setting("PORTABLE_KV_BLOCKS", None, "block quota of the kernel io path (default: 16 on NVIDIA, 32 on AMD)", _integer(1))
DMA_STREAMS = Setting("PORTABLE_KV_DMA_STREAMS", "4", "streams one direct-io transfer of short copies is spread over, one copy engine each (on NVIDIA copies of 1 MiB and more on average: one call on the caller's stream)", _integer(1))
CACHE = Setting("PORTABLE_KV_CACHE", None, "directory of compiled kernels (default: $XDG_CACHE_HOME/portable_kv or ~/.cache/portable_kv)")
PREBUILT = Setting("PORTABLE_KV_PREBUILT", None, "extra directory searched first for ahead-of-time code objects")
HOST_RESERVE = Setting("PORTABLE_KV_HOST_RESERVE", str(2 << 30), "bytes of host memory a new pool leaves free for the OS and the engine",
                       _integer(0))
CLANG = Setting("PORTABLE_KV_CLANG", None, "clang++ used to build HIP code objects ahead of time (default: clang++-19 or clang++ on PATH)")
HIP_BITCODE = Setting("PORTABLE_KV_HIP_BITCODE", None, "directory of the AMD device bitcode (ockl.bc) for clang builds")
STAGING_BYTES = Setting("PORTABLE_KV_STAGING_BYTES", str(64 << 20),
                        "device memory of one pool's staged io path per direction, two halves that alternate chunks", _integer(1))
STAGING_BLOCKS = Setting("PORTABLE_KV_STAGING_BLOCKS", "8",
                         "block quota of the staged io path's kernel between staging and the KV buffers", _integer(1))
SGLANG = Setting("PORTABLE_KV_SGLANG", "0",
                 "1: SGLang's plugin loader calls portable_kv.engines.sglang.install() in every server process (HiCache on portable_kv)", _flag)
SGLANG_IO = Setting("PORTABLE_KV_SGLANG_IO", None,
                    f"io path of portable_kv pools under SGLang: one of {', '.join(IO_PATHS)} for every call, "
                    "or pairs kernel=...,direct=... (default: SGLang's --hicache-io-backend as passed)", _sglang_io)
LOG_LEVEL = Setting("PORTABLE_KV_LOG_LEVEL", "WARNING",
                    "level of the portable_kv logger: DEBUG, INFO (a line per host pool built), WARNING, ERROR or CRITICAL",
                    _choice(LOG_LEVELS, case_sensitive=False))
DEBUG = Setting("PORTABLE_KV_DEBUG", "0", "1: the command line shows full tracebacks, and Mooncake its full logs", _flag)

SETTINGS = (BACKEND, BLOCKS, DMA_STREAMS, STAGING_BYTES, STAGING_BLOCKS, CACHE, PREBUILT, HOST_RESERVE, CLANG, HIP_BITCODE, SGLANG, SGLANG_IO,
            LOG_LEVEL, DEBUG)
# What a backend and its io paths read: refused when any backend is bound, the cpu
# backend included, although it reads none of them, so that a value that would be
# refused on a GPU is not accepted silently on the CPU.
IO_SETTINGS = (BLOCKS, DMA_STREAMS, STAGING_BYTES, STAGING_BLOCKS)
# Triton's own switch (Triton reads it too): it decides whether the triton backend
# runs on the CPU; not a PORTABLE_KV_* setting, so not in SETTINGS' table.
TRITON_INTERPRET = Setting("TRITON_INTERPRET", "0", "1: Triton kernels run on the CPU under Triton's interpreter")


class SettingState(NamedTuple):
    """One setting as `portable-kv info` shows it."""

    name: str
    value: str | None  # None: unset and without a default
    source: str  # "default", "env" or "argument" (a value a command was given in place of the environment)
    problem: str | None  # None where the value can be used, else what the variable expects

    @property
    def valid(self) -> bool:
        return self.problem is None


def states(arguments: Mapping[str, str] | None = None) -> list[SettingState]:
    """Every setting's value, where it comes from and whether it can be used; never raises.

    `arguments` are values a command was given for some settings and has put in
    force (in the environment) for this process: those are reported as from an argument."""
    arguments = arguments or {}
    found = []
    for setting in SETTINGS:
        given = setting.given()
        source = "default" if given is None else "argument" if setting.name in arguments else "env"
        found.append(SettingState(setting.name, setting.default if given is None else given, source, setting.problem()))
    return found


def check(settings: Iterable[Setting]) -> None:
    """Raise ConfigError for the first of `settings` whose value cannot be used, naming the variable and what it takes."""
    for setting in settings:
        problem = setting.problem()
        if problem:
            raise ConfigError(f"{setting.name}: {problem}")


def check_all() -> None:
    """check() of every setting."""
    check(SETTINGS)


def block_quota(vendor: str) -> int:
    """Blocks (workgroups) a kernel-io transfer may occupy.  16 saturate PCIe Gen5 on
    the H200 (docs/PERFORMANCE.md); 32 on AMD follows published CDNA figures, not ours."""
    configured = BLOCKS.integer(minimum=1)
    if configured is not None:
        return configured
    return 32 if vendor == "amd" else 16


def cache_dir() -> Path:
    configured = CACHE.raw()
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "portable_kv"


def table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) of every setting, for docs and `portable-kv info`."""
    return [(s.name, s.default or "-", s.meaning) for s in SETTINGS]
