"""portable-kv: info | check | bench | build.

Expected failures (a backend that cannot run here, a bad flag or setting, too
little memory, a missing optional package) end as one line on stderr naming the
cause and the fix, exit status 2; PORTABLE_KV_DEBUG=1 shows the traceback.
Nothing here imports torch before a command needs it, so --help and --version
answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from . import __version__, config

USAGE_ERROR = 2  # argparse's own status for a bad command line


class CommandLine(argparse.ArgumentParser):
    """argparse's parser, with an unknown argument reported by the parser it was given to.

    argparse reports a command's unknown arguments with the top-level usage, which
    does not list the command's flags, and a missing command before any unknown
    flag, which hides the flag (`portable-kv --frobnicate`). Here the command's own
    parser reports what came after the command, the top level what came before it.
    """

    commands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> argparse.Namespace:
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
        if config.DEBUG.flag() or not expected(exc):
            raise
        print(f"portable-kv {args.command}: {one_line(exc)} [PORTABLE_KV_DEBUG=1 shows the traceback]", file=sys.stderr)
        return USAGE_ERROR


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


def cmd_info(_: argparse.Namespace) -> int:
    import shutil

    import torch

    from . import backends

    rows: list[tuple[str, str]] = [("portable_kv", __version__),
                                   ("torch", f"{torch.__version__} (cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)})")]
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
    forced = config.BACKEND.raw()
    for name in backends.names():
        reason = backends.unavailable_reason(name)
        status = "can run here" if reason is None else f"cannot run here: {reason}"
        rows.append((f"backend {name}", status + (f" (forced by {config.BACKEND.name})" if name == forced else "")))
    for tool in ("nvcc", "hipcc", "clang++-19"):
        rows.append((tool, shutil.which(tool) or "not found"))
    print_rows(rows)
    print("\nsettings (environment variables)")
    current = {s.name: s.raw() for s in config.SETTINGS}
    print_rows([(name, f"{current.get(name) or '-'}{'' if (current.get(name) or '-') == default else f' (default {default})'}: {meaning}")
                for name, default, meaning in config.table()])
    return 0


def print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def cmd_check(_: argparse.Namespace) -> int:
    from . import backends
    from .check import run_check, storage_check, table

    backend = backends.current()
    print(f"split K/V and MLA latent roundtrips on backend {backend.name} ({backend.vendor}, {backend.device})")
    results = run_check() + storage_check()
    print("\n".join(table(results)))
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    if backend.device.type == "cpu":
        what = "the Triton kernel logic ran in its CPU interpreter" if backend.name == "triton" else "the CPU reference backend ran"
        print(f"No GPU here: {what}; the GPU kernels and DMA paths were not exercised. On a GPU host run `portable-kv check`; "
              "here, `PORTABLE_KV_BACKEND=triton TRITON_INTERPRET=1 portable-kv check` runs the Triton kernel logic on the CPU.")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def cmd_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    out = Path(args.out) if args.out else config.cache_dir() / "prebuilt"
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
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=argparse.ArgumentParser)
    p.commands = sub.choices

    def command(name: str, func: Callable[[argparse.Namespace], int], summary: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=summary, description=summary)
        cmd.set_defaults(func=func)
        return cmd

    command("info", cmd_info, "every backend and whether it can run here (and why not), the device, compilers, settings")
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
