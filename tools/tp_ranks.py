"""Tensor-parallel ranks on one host: each GPU's process with its own host pool, alone and together.

An engine running tensor-parallel holds one process per GPU; each has a shard of
the KV heads, its own device pool and host pool, and all of them share the
host's memory, PCIe switches and sockets.  This tool starts one process per GPU
(spawn), and in each:

1. builds a MiMo-like device pool (K 4x192, V 4x128 bf16, 8 layers, page 64) and
   a host pool, placed on the GPU's NUMA node (`--numa local`) or wherever the
   kernel puts it (`--numa off`), and reads back which nodes its pages sit on;
2. measures, one rank at a time, its own ceiling (bulk pinned memcpy H2D and
   D2H) and its per-layer loads and all-layer backups alone;
3. then all ranks at once (a barrier) run the same loads, then the same backups,
   for `--seconds` each;
4. checks a round trip bit for bit: device pages -> host (all-layer backup) ->
   other device pages (per-layer loads).

With `--l3 mooncake` (and a Mooncake install) a loopback `mooncake_master` is
started and rank 0 puts pages that the last rank, another process, gets back
into its own host pool, compared bit for bit.

    python tools/tp_ranks.py --ranks 8 --json tp8.json
    python tools/tp_ranks.py --ranks 1 --seconds 1          # a smoke test

Prints a table (GB/s, and % of the rank's own ceiling) and writes JSON with
`--json`.  Exit status: 0 when every check passed, 1 when one failed, 2 when
fewer GPUs than `--ranks` are visible.  A requested L3 check that cannot run
(no Mooncake here) says so in one line and counts as failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

import torch

LAYERS, PAGE_SIZE, K_HEADS, K_DIM, V_HEADS, V_DIM = 8, 64, 4, 192, 4, 128
DTYPE = torch.bfloat16
TOKEN_LAYER_BYTES = (K_HEADS * K_DIM + V_HEADS * V_DIM) * 2
CEILING_BYTES = 256 << 20
BARRIER_TIMEOUT_S = 600.0
SEED = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tp_ranks", description="Per-rank host-pool bandwidth of tensor-parallel ranks on one host, alone and together.")
    parser.add_argument("--ranks", type=int, default=None, help="processes, one per visible GPU (default: every visible GPU)")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each timed phase runs (default 3)")
    parser.add_argument("--device-tokens", type=int, default=131072, help="tokens of each rank's device pool (default 131072: 2.7 GB)")
    parser.add_argument("--host-ratio", type=float, default=2.0, help="host tokens per device token (default 2)")
    parser.add_argument("--batch-pages", type=int, default=256, help="pages one load or backup moves (default 256)")
    parser.add_argument("--io", choices=("kernel", "direct"), default="kernel", help="io backend of the host pools (default kernel)")
    parser.add_argument("--backend", choices=("cuda", "rocm", "triton"), default=None, help="portable_kv backend (default: detected)")
    parser.add_argument("--numa", choices=("local", "off"), default="local", help="host pool on the GPU's NUMA node, or the kernel's default (default local)")
    parser.add_argument("--l3", choices=("none", "mooncake"), default="none", help="also check pages across ranks through a loopback Mooncake store")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.ranks is not None and args.ranks < 1:
        parser.error(f"--ranks: expected >= 1, got {args.ranks}")
    if args.seconds <= 0:
        parser.error(f"--seconds: expected > 0, got {args.seconds}")
    if args.host_ratio <= 0:
        parser.error(f"--host-ratio: expected > 0, got {args.host_ratio}")
    if args.batch_pages < 1:
        parser.error(f"--batch-pages: expected >= 1, got {args.batch_pages}")
    if args.device_tokens < 2 * args.batch_pages * PAGE_SIZE:
        parser.error(f"--device-tokens: expected >= 2 * batch-pages * {PAGE_SIZE} = {2 * args.batch_pages * PAGE_SIZE}, got {args.device_tokens}")
    if args.l3 == "mooncake" and args.ranks == 1:
        parser.error("--l3 mooncake: the check moves pages between two processes, expected --ranks >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    visible = torch.cuda.device_count()
    ranks = args.ranks if args.ranks is not None else max(visible, 1)
    if visible < ranks:
        print(f"tp_ranks: --ranks {ranks} needs {ranks} GPU{'s' if ranks > 1 else ''}, {visible} visible", file=sys.stderr)
        return 2
    l3 = {"requested": args.l3}
    master = None
    if args.l3 == "mooncake":
        master, l3 = start_mooncake()
    try:
        results = run_ranks(ranks, vars(args), l3.get("master"))
    finally:
        if master is not None:
            master.stop()
    if args.l3 == "mooncake" and "master" in l3:
        l3.update(next((r["l3"] for r in results if r.get("l3", {}).get("role") == "get"), {"passed": False, "error": "no rank reported the get"}))
    report = {"config": {**vars(args), "ranks": ranks}, "ranks": results, "l3": l3}
    print(table(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    passed = all(r.get("round_trip_exact") for r in results) and (args.l3 == "none" or bool(l3.get("passed")))
    return 0 if passed else 1


def start_mooncake() -> tuple[Any, dict]:
    """A loopback master where portable_kv's Mooncake store is installed; else the reason it is not."""
    try:
        from portable_kv.storage import MooncakeStore  # noqa: F401  (its presence is the question)
        from portable_kv.storage.master import MooncakeMaster
    except ImportError as exc:
        return None, {"requested": "mooncake", "passed": False, "error": f"L3 check: not available, portable_kv.storage.MooncakeStore cannot be imported ({exc})"}
    try:
        master = MooncakeMaster().start()
    except (OSError, RuntimeError) as exc:
        return None, {"requested": "mooncake", "passed": False, "error": f"L3 check: not available, no loopback mooncake_master ({exc})"}
    return master, {"requested": "mooncake", "master": master.address}


# -- the ranks ---------------------------------------------------------------------------


def run_ranks(ranks: int, options: dict, master: str | None) -> list[dict]:
    """Start one spawned process per rank and collect each one's result (or its error)."""
    context = mp.get_context("spawn")
    barrier = context.Barrier(ranks)
    results = context.Queue()
    processes = [context.Process(target=rank_main, args=(rank, ranks, options, master, barrier, results), name=f"tp-rank-{rank}") for rank in range(ranks)]
    for process in processes:
        process.start()
    collected: dict[int, dict] = {}
    try:
        while len(collected) < ranks:
            try:
                result = results.get(timeout=1.0)
                collected[result["rank"]] = result
                if "error" in result:
                    barrier.abort()
            except queue.Empty:
                for rank, process in enumerate(processes):
                    if rank not in collected and process.exitcode is not None:
                        collected[rank] = {"rank": rank, "error": f"exited with status {process.exitcode} before reporting"}
                        barrier.abort()
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join()
    return [collected[rank] for rank in range(ranks)]


def rank_main(rank: int, ranks: int, options: dict, master: str | None, barrier: Any, results: Any) -> None:
    try:
        results.put(RankRun(rank, ranks, options, master, barrier).run())
    except threading.BrokenBarrierError:
        results.put({"rank": rank, "error": "another rank failed (barrier broken)"})
    except Exception:
        results.put({"rank": rank, "error": traceback.format_exc()})
        barrier.abort()


class RankRun:
    """One rank's pools and measurements, in the process that owns its GPU."""

    def __init__(self, rank: int, ranks: int, options: dict, master: str | None, barrier: Any) -> None:
        self.rank, self.ranks, self.options, self.master, self.barrier = rank, ranks, options, master, barrier
        # Before portable_kv is imported: the backend binds the current device at import.
        torch.cuda.set_device(rank)
        import portable_kv as pk
        from portable_kv import backends, numa

        self.pk, self.numa = pk, numa
        self.backend = backends.use(options["backend"]) if options["backend"] else backends.current()
        self.device = self.backend.device
        self.batch_tokens = options["batch_pages"] * PAGE_SIZE
        self.dev = pk.DeviceKVPool(LAYERS, options["device_tokens"], PAGE_SIZE, K_HEADS, K_DIM, V_DIM, V_HEADS, dtype=DTYPE, device=self.device)
        # A fresh block for each pinned buffer: a cached one may sit on any node.
        numa.release_cached_host_memory()
        self.host = pk.AsymmetricHostPool(self.dev, host_to_device_ratio=options["host_ratio"], layout="page_first_direct", io_backend=options["io"],
                                          numa_node=None if options["numa"] == "local" else numa.OFF)
        self.placement = self.host.placement
        with numa.bind_allocations(self.placement.node):
            self.bulk_host = torch.empty(CEILING_BYTES, dtype=torch.uint8, pin_memory=True)
        self.bulk_device = torch.empty(CEILING_BYTES, dtype=torch.uint8, device=self.device)
        self.host_indices = torch.arange(self.batch_tokens, dtype=torch.int64)
        self.device_indices = torch.arange(self.batch_tokens, dtype=torch.int64)

    def run(self) -> dict:
        result = {
            "rank": self.rank,
            "gpu": torch.cuda.get_device_name(self.device),
            "backend": self.backend.name,
            "numa_node": self.placement.node,
            "numa_reason": self.placement.reason,
            "host_page_nodes": self.host_page_nodes(),
        }
        seconds = self.options["seconds"]
        for turn in range(self.ranks):
            self.wait()
            if turn == self.rank:
                result["ceiling_h2d"] = self.timed(lambda: self.bulk_device.copy_(self.bulk_host, non_blocking=True), CEILING_BYTES, seconds)
                result["ceiling_d2h"] = self.timed(lambda: self.bulk_host.copy_(self.bulk_device, non_blocking=True), CEILING_BYTES, seconds)
                result["load_alone"] = self.timed(self.load, self.batch_bytes, seconds)
                result["backup_alone"] = self.timed(self.backup, self.batch_bytes, seconds)
        self.wait()
        result["load_together"] = self.timed(self.load, self.batch_bytes, seconds)
        self.wait()
        result["backup_together"] = self.timed(self.backup, self.batch_bytes, seconds)
        self.wait()
        result["round_trip_exact"] = self.round_trip()
        if self.master is not None:
            result["l3"] = self.l3_check()
        self.host.close()
        return result

    @property
    def batch_bytes(self) -> int:
        return self.batch_tokens * LAYERS * TOKEN_LAYER_BYTES

    def wait(self) -> None:
        self.barrier.wait(BARRIER_TIMEOUT_S)

    def load(self) -> None:
        for layer in range(LAYERS):
            self.host.load_to_device_per_layer(self.dev, self.host_indices, self.device_indices, layer)

    def backup(self) -> None:
        self.host.backup_from_device_all_layer(self.dev, self.host_indices, self.device_indices)

    def timed(self, step: Any, step_bytes: int, seconds: float) -> float:
        """GB/s of `step` repeated for about `seconds` (after one warm-up step)."""
        step()
        torch.cuda.synchronize(self.device)
        steps, start = 0, time.perf_counter()
        while True:
            for _ in range(4):
                step()
            torch.cuda.synchronize(self.device)
            steps += 4
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return steps * step_bytes / elapsed / 1e9

    def host_page_nodes(self) -> dict[str, int]:
        """How many sampled pages of the host pool sit on each NUMA node."""
        nodes: Counter[int] = Counter()
        for buffer in (self.host.k_buffer, self.host.v_buffer):
            nodes.update(self.numa.tensor_page_nodes(buffer, step_pages=256))
        return {str(node): count for node, count in sorted(nodes.items())}

    def round_trip(self) -> bool:
        """Device pages -> host (all-layer backup) -> other device pages (per-layer loads), bit for bit."""
        generator = torch.Generator(device=self.device).manual_seed(SEED + self.rank)
        source = torch.arange(self.batch_tokens, 2 * self.batch_tokens, dtype=torch.int64)
        target = torch.arange(self.batch_tokens, dtype=torch.int64)
        for buffer in self.dev.k_buffer + self.dev.v_buffer:
            bits = buffer.view(torch.int16)
            bits[source] = torch.randint(-(1 << 15), 1 << 15, bits[source].shape, dtype=torch.int16, device=self.device, generator=generator)
            bits[target] = 0
        self.host.backup_from_device_all_layer(self.dev, self.host_indices, source)
        for layer in range(LAYERS):
            self.host.load_to_device_per_layer(self.dev, self.host_indices, target, layer)
        torch.cuda.synchronize(self.device)
        return all(torch.equal(buffer.view(torch.int16)[source], buffer.view(torch.int16)[target]) for buffer in self.dev.k_buffer + self.dev.v_buffer)

    def l3_check(self) -> dict:
        """Rank 0 puts pages; the last rank (another process) gets them into its own pool, bit for bit."""
        from portable_kv.storage import MooncakeStore

        pages = self.options["batch_pages"]
        keys = [f"tp-ranks-{os.getppid()}-{page}" for page in range(pages)]
        tokens = torch.arange(pages * PAGE_SIZE, dtype=torch.int64)
        role = "put" if self.rank == 0 else "get" if self.rank == self.ranks - 1 else None
        report: dict = {"role": role}
        # The getter names rank 0's shard: keys carry the tensor-parallel rank as their suffix.
        store = MooncakeStore(self.host, master=self.master, tp_rank=0) if role else None
        try:
            if role == "put":
                for page in range(pages):
                    self.host.set_from_flat_data_page(page * PAGE_SIZE, self.expected_page(page))
                report["stored"] = sum(store.put(keys, tokens))
            self.wait()
            if role == "get":
                for page in range(pages):
                    self.host.set_from_flat_data_page(page * PAGE_SIZE, self.host.get_dummy_flat_data_page())
                read = store.get(keys, tokens)
                exact = [bool(ok) and torch.equal(self.host.get_data_page(page * PAGE_SIZE, flat=True), self.expected_page(page)) for page, ok in enumerate(read)]
                report.update(pages=pages, read=sum(bool(ok) for ok in read), exact=sum(exact), passed=all(exact))
            self.wait()
        finally:
            if store is not None:
                store.close()
        return report

    def expected_page(self, page: int) -> torch.Tensor:
        """The same flat page in every process: random bits from a seed and the page number."""
        size = self.host.get_dummy_flat_data_page().numel()
        generator = torch.Generator().manual_seed(SEED * 1_000_003 + page)
        return torch.randint(-(1 << 15), 1 << 15, (size,), dtype=torch.int16, generator=generator).view(DTYPE)


# -- the report --------------------------------------------------------------------------


def table(report: dict) -> str:
    """The per-rank table: GB/s alone and together, each as % of the rank's own ceiling."""
    lines = [
        f"{report['config']['ranks']} ranks, io {report['config']['io']}, batch {report['config']['batch_pages']} pages of {PAGE_SIZE} tokens x {LAYERS} layers; "
        "load: per-layer H2D, % of the rank's H2D ceiling; backup: all-layer D2H, % of its D2H ceiling",
        "| rank | GPU | NUMA | host pages by node | ceiling H2D / D2H | load alone | load together | backup alone | backup together | round trip |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["ranks"]:
        if "error" in r:
            lines.append(f"| {r['rank']} | error: {r['error'].strip().splitlines()[-1]} |")
            continue
        h2d, d2h = r["ceiling_h2d"], r["ceiling_d2h"]
        lines.append(
            f"| {r['rank']} | {r['gpu']} | {r['numa_reason']} | {r['host_page_nodes']} | {h2d:.1f} / {d2h:.1f} | "
            f"{cell(r['load_alone'], h2d)} | {cell(r['load_together'], h2d)} | {cell(r['backup_alone'], d2h)} | {cell(r['backup_together'], d2h)} | "
            f"{'bit-exact' if r['round_trip_exact'] else 'MISMATCH'} |"
        )
    l3 = report["l3"]
    if l3["requested"] == "mooncake":
        if "pages" in l3:
            lines.append(f"L3 check (Mooncake, rank 0 put, rank {report['config']['ranks'] - 1} get): {l3['exact']}/{l3['pages']} pages bit-exact, {'PASS' if l3['passed'] else 'FAIL'}")
        else:
            lines.append(l3.get("error", "L3 check: FAIL"))
    return "\n".join(lines)


def cell(gbps: float, ceiling: float) -> str:
    return f"{gbps:.1f} ({100 * gbps / ceiling:.0f}%)"


if __name__ == "__main__":
    sys.exit(main())
