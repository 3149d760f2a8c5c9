"""portable-kv info | check | bench | build"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def cmd_info(_: argparse.Namespace) -> int:
    import torch

    from . import backends

    backend = backends.current()
    rows = [
        ("backend", backend.name),
        ("vendor", backend.vendor),
        ("device", str(backend.device) + (f" ({torch.cuda.get_device_name(backend.device)})" if backend.device.type != "cpu" else "")),
        ("io backends", ", ".join(backend.io_backends)),
        ("available", ", ".join(backends.available())),
        ("torch", f"{torch.__version__} (cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)})"),
    ]
    for name in backends.names():
        reason = backends.unavailable_reason(name)
        if reason:
            rows.append((f"not {name}", reason))
    for tool in ("nvcc", "hipcc", "clang++-19"):
        rows.append((tool, shutil.which(tool) or "not found"))
    rows += list(backend.describe().items())
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_check(_: argparse.Namespace) -> int:
    from . import backends
    from .check import run_check

    backend = backends.current()
    print(f"split K/V roundtrip on backend {backend.name} ({backend.device})")
    results = run_check()
    print(f"{'layout':<18} {'io':<7} {'result':<6} {'bytes moved':>12}  detail")
    for r in results:
        print(f"{r.layout:<18} {r.io_backend:<7} {'PASS' if r.passed else 'FAIL':<6} {r.bytes_moved:>12}  {r.detail}")
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def cmd_build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.vendor == "cuda":
        from .backends.cuda import AOT_ARCHS as archs
        from .backends.cuda import nvcc_build as build
    else:
        from .backends.rocm import AOT_ARCHS as archs
        from .backends.rocm import clang_build as build
    written = build(out, tuple(args.arch.split(",")) if args.arch else archs)
    for path in written:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portable-kv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="bound backend, device, compilers, io backends").set_defaults(func=cmd_info)
    sub.add_parser("check", help="split K/V roundtrip for every layout x io backend").set_defaults(func=cmd_check)
    bench = sub.add_parser("bench", help="bandwidth against the link's ceiling")
    from .bench import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    build = sub.add_parser("build", help="ahead-of-time code objects (nvcc or clang)")
    build.add_argument("--vendor", choices=("cuda", "rocm"), required=True)
    build.add_argument("--arch", help="comma-separated: sm_80,sm_90,sm_100 or gfx90a,gfx942,gfx950")
    build.add_argument("--out", default=str(Path(__file__).parent / "prebuilt"))
    build.set_defaults(func=cmd_build)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
