"""portable-kv: info | check | bench | build.

Expected failures (a backend that cannot run here, a bad flag or setting, too
little memory, a missing optional package) end as one line on stderr naming the
cause and the fix, exit status 2; PORTABLE_KV_DEBUG=1 shows the traceback.
Nothing here imports torch before a command needs it, so --help and --version
answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

from . import __version__, config

USAGE_ERROR = 2  # argparse's own status for a bad command line


class OneLineErrors(argparse.ArgumentParser):
    """argparse's parser, a usage error one line as every expected failure is (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (`{self.prog} --help` lists the arguments)\n")


class CommandLine(OneLineErrors):
    """argparse's parser, with an unknown argument reported by the parser it was given to.

    argparse reports a command's unknown arguments as the top level's, whose --help
    does not list the command's flags, and a missing command before any unknown
    flag, which hides the flag (`portable-kv --frobnicate`). Here the command's own
    parser reports what came after the command, the top level what came before it.
    """

    commands: Mapping[str, argparse.ArgumentParser]

    def parse_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        parsed, unknown = self.parse_known_args(argv, namespace)
        command = getattr(parsed, "command", None)
        if unknown:
            # The top level takes no values, so its part of the line ends at the first positional: the command.
            at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv)) if command else len(argv)
            before = [arg for arg in argv[:at] if arg in unknown]
            owner = self if before or command is None else self.commands[command]
            owner.error(f"unrecognized arguments: {' '.join(before or unknown)}")
        if command is None:
            self.error("the following arguments are required: COMMAND")
        return parsed


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"portable-kv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debugging() or not expected(exc):
            raise
        print(f"portable-kv {args.command}: {one_line(exc)} [PORTABLE_KV_DEBUG=1 shows the traceback]", file=sys.stderr)
        return USAGE_ERROR


def debugging() -> bool:
    """PORTABLE_KV_DEBUG, read where a failure is being reported: a malformed value counts as off
    (the failure may be that very value)."""
    try:
        return config.DEBUG.flag()
    except config.ConfigError:
        return False


def expected(exc: BaseException) -> bool:
    """Failures of the machine, the install or the input, as opposed to bugs."""
    if isinstance(exc, (ValueError, TypeError, MemoryError, ImportError, OSError)):
        return True
    # Only imported once a backend was asked for: an exception of that type cannot exist before.
    base = sys.modules.get("portable_kv.backends.base")
    return base is not None and isinstance(exc, base.BackendUnavailable)


def one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    if isinstance(exc, MemoryError):
        text = f"out of memory ({text}); ask for less (--pages, --layers, host_size_gb) or free memory"
    elif isinstance(exc, config.ConfigError):
        text += "; fix or unset the variable (`portable-kv info` lists every setting)"
    elif isinstance(exc, ImportError) and getattr(exc, "name", None):
        text += f"; install it (pip install {exc.name}) or use a command that does not need it"
    return text


def cmd_info(args: argparse.Namespace) -> int:
    import shutil

    arguments = dict(setting_argument(text) for text in args.set)
    # In force for this process, before anything reads them: every row below sees them.
    os.environ.update(arguments)

    import torch

    from . import backends

    rows: list[tuple[str, str]] = [("portable_kv", __version__),
                                   ("torch", f"{torch.__version__} (cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)})")]
    placed_for = torch.device("cpu")  # the device whose NUMA node a host pool would take
    try:
        bound = backends.current()
    except Exception as exc:
        if not expected(exc):
            raise
        rows.append(("bound backend", f"none: {one_line(exc)}"))
    else:
        device = str(bound.device) + (f" ({torch.cuda.get_device_name(bound.device)})" if bound.device.type != "cpu" else "")
        rows += [("bound backend", bound.name), ("vendor", bound.vendor), ("device", device), ("io backends", ", ".join(bound.io_backends))]
        rows += list(bound.describe().items())
        placed_for = bound.device
    forced = config.BACKEND.given()
    for name in backends.names():
        reason = backends.unavailable_reason(name)
        status = "can run here" if reason is None else f"cannot run here: {reason}"
        rows.append((f"backend {name}", status + (f" (forced by {config.BACKEND.name})" if name == forced else "")))
    for tool in ("nvcc", "hipcc", "clang++-19"):
        rows.append((tool, shutil.which(tool) or "not found"))
    rows += numa_rows(placed_for)
    rows.append(("kernel cache", kernel_cache_summary()))
    print_rows(rows)
    print("\nsettings: value (source: default, env or argument), then what it sets")
    states = config.states(arguments)
    print_rows([(state.name, f"{state.value or '-'} ({state.source})" + ("" if state.valid else f" INVALID: {state.problem}") + f"; {meaning}")
                for state, (_, _, meaning) in zip(states, config.table())])
    bad = [state.name for state in states if not state.valid]
    if bad:
        print(f"\n{len(bad)} setting{'s' if len(bad) > 1 else ''} cannot be used: {', '.join(bad)}. "
              "`portable-kv check` and portable_kv.sglang.install() refuse to start, and whatever reads one raises ConfigError, "
              "until each is fixed or unset.")
    return 0


def setting_argument(text: str) -> tuple[str, str]:
    """`NAME=VALUE` of `info --set`, NAME a setting's variable."""
    name, equals, value = text.partition("=")
    names = [s.name for s in config.SETTINGS]
    if not equals or name not in names:
        raise ValueError(f"--set: expected NAME=VALUE with NAME one of {', '.join(names)}, got {text!r}")
    return name, value


def numa_rows(device: Any) -> list[tuple[str, str]]:
    """This machine's NUMA nodes, and where a host pool for `device` would be placed and why."""
    from . import numa

    nodes = numa.numa_nodes()
    try:
        where = numa.placement(device).reason
    except (OSError, RuntimeError) as exc:  # a GPU torch cannot describe: say so, info still answers
        where = f"unknown: {one_line(exc)}"
    return [("numa nodes", ", ".join(map(str, nodes)) or "none reported (one node)"), ("numa placement", where)]


def kernel_cache_summary() -> str:
    """The kernel cache directory and what it holds: compiled kernels, and ahead-of-time code objects under prebuilt/."""
    try:
        path = config.cache_dir()
    except config.ConfigError as exc:
        return f"unknown: {one_line(exc)}"
    if not path.is_dir():
        return f"{path} (not created yet: kernels are compiled at first use)"
    files = [p for p in path.rglob("*") if p.is_file()]
    prebuilt = sum(1 for p in files if p.relative_to(path).parts[0] == "prebuilt")
    nbytes = sum(p.stat().st_size for p in files)
    return f"{path}: {len(files) - prebuilt} compiled kernels, {prebuilt} ahead-of-time code objects in prebuilt/, {nbytes / 1e6:.1f} MB"


def print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def cmd_check(_: argparse.Namespace) -> int:
    # A malformed setting is one line and exit 2 here, not a FAIL row for every roundtrip that reads it.
    config.check_all()

    from . import backends
    from .check import run_check, storage_check, table

    backend = backends.current()
    print(f"split K/V and MLA latent roundtrips on backend {backend.name} ({backend.vendor}, {backend.device})")
    results = run_check() + storage_check()
    print("\n".join(table(results)))
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    footer = not_exercised(backend.name, backend.device.type)
    if footer:
        print(footer)
    return 1 if failed else 0


def not_exercised(backend: str, device_type: str) -> str | None:
    """`check`'s closing note on a machine without a GPU: what ran, and what to run for more (never the command just run)."""
    if device_type != "cpu":
        return None
    if backend == "triton":
        return ("No GPU here: the Triton kernel logic ran in its CPU interpreter; the GPU kernels and DMA paths were not exercised. "
                "On a GPU host run `portable-kv check`.")
    return ("No GPU here: the CPU reference backend ran; the GPU kernels and DMA paths were not exercised. On a GPU host run "
            "`portable-kv check`; here, `PORTABLE_KV_BACKEND=triton TRITON_INTERPRET=1 portable-kv check` runs the Triton "
            "kernel logic on the CPU.")


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def cmd_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    out = Path(args.out) if args.out else config.cache_dir() / "prebuilt"
    build: Callable[[Path, tuple[str, ...]], list[Path]]
    if args.vendor == "cuda":
        from .backends.cuda import AOT_ARCHS as archs
        from .backends.cuda import nvcc_build as build
    else:
        from .backends.rocm import AOT_ARCHS as archs
        from .backends.rocm import clang_build as build
    for path in build(out, tuple(a.strip() for a in args.arch.split(",")) if args.arch else archs):
        print(path)
    return 0


def parser() -> argparse.ArgumentParser:
    from .bench import add_arguments as bench_arguments  # the bench package's __init__ imports no torch

    p = CommandLine(prog="portable-kv", description="The host tier of a KV cache with asymmetric K/V, on NVIDIA and AMD.",
                                epilog="Expected failures print one line and exit 2; PORTABLE_KV_DEBUG=1 shows the traceback.")
    p.add_argument("--version", action="version", version=f"portable-kv {__version__}")
    # Not required here: CommandLine.parse_args says so itself, after naming any unknown argument.
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrors)
    p.commands = sub.choices

    def command(name: str, func: Callable[[argparse.Namespace], int], summary: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=summary, description=summary)
        cmd.set_defaults(func=func)
        return cmd

    info = command("info", cmd_info, "every backend and whether it can run here (and why not), the device, compilers, NUMA placement, "
                                     "the kernel cache, and every setting with its source and whether it can be used")
    info.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                      help="show everything as if the setting NAME were VALUE (repeatable); marked as from an argument")
    command("check", cmd_check, "split K/V and MLA latent roundtrips for every layout x io backend on the bound backend: PASS/FAIL, exit 1 on a FAIL")
    bench_arguments(command("bench", cmd_bench, "bandwidth of loads and backups against the link's ceiling, beside the engines' own paths"))
    build = command("build", cmd_build, "compile the kernels ahead of time (nvcc, or clang for HIP); the loader prefers these code objects")
    build.add_argument("--vendor", choices=("cuda", "rocm"), required=True, help="cuda: nvcc cubins; rocm: clang (or hipcc) code objects")
    build.add_argument("--arch", default="", help="comma-separated targets, e.g. sm_80,sm_90,sm_100 or gfx90a,gfx942,gfx950 (default: the vendor's list)")
    build.add_argument("--out", default="", help="directory to write to (default: prebuilt/ in the kernel cache, $PORTABLE_KV_CACHE or "
                                                  "~/.cache/portable_kv, which the loader searches)")
    return p


if __name__ == "__main__":
    sys.exit(main())
