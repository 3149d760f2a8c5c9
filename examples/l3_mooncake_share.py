"""Two processes share KV pages through a Mooncake Store, over a master this example runs.

A `mooncake_master` is started on 127.0.0.1 (free ports, stopped by its PID at the
end). The writer fills its device pool with random bits, backs pages up to its host
pool and puts them; its client contributes the memory segment the pages are stored
in, so it stays up until the reader has them. The reader, a separate process that
contributes no memory, gets the pages by key into other host slots and loads them
into other device slots; the bytes that arrive are compared with the writer's, bit
for bit. Clients find each other through the master (metadata_server="P2PHANDSHAKE")
and move bytes over TCP; a cluster of hosts would name a reachable master and
local_hostname, and RDMA where it has it.

Needs the mooncake extra (pip install 'portable-kv[mooncake]', or from a checkout
pip install -e ".[mooncake]"; its binaries need libibverbs1); without it the example
says so in one line and exits 2. Runs on a GPU or, with the cpu backend, on any machine:
python3 examples/l3_mooncake_share.py
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys

import torch

import portable_kv as pk
from portable_kv import backends
from portable_kv.storage import MooncakeStore
from portable_kv.storage.master import INSTALL_HINT, MooncakeMaster, master_binary
from portable_kv.testing import bits, page_tokens, randomize

PAGE = 16
KEYS = ["prefix-0", "prefix-1", "prefix-2", "prefix-3"]  # an engine's keys: hashes of each page's tokens and prefix
WAIT_S = 300


def pools() -> tuple[pk.DeviceKVPool, pk.AsymmetricHostPool]:
    dev = pk.DeviceKVPool(num_layers=4, num_tokens=32 * PAGE, page_size=PAGE, k_heads=4, k_head_dim=192, v_head_dim=128,
                          dtype=torch.bfloat16)
    return dev, pk.AsymmetricHostPool(dev, host_to_device_ratio=2.0, layout="page_first_direct")


def slots(pages: list[int]) -> torch.Tensor:
    """Every token of whole pages: a store moves whole pages."""
    return page_tokens(torch.tensor(pages), PAGE)


def device_bytes(dev: pk.DeviceKVPool, tokens: torch.Tensor) -> list[bytes]:
    """The K and V bytes of `tokens` over every layer (bf16 as raw bits: random bits include NaNs)."""
    return [b"".join(bits(layer[tokens.to(layer.device)]).numpy().tobytes() for layer in side) for side in (dev.k_buffer, dev.v_buffer)]


def store(host: pk.AsymmetricHostPool, master: str, segment_size_gb: float) -> MooncakeStore:
    return MooncakeStore(host, master=master, metadata_server="P2PHANDSHAKE", protocol="tcp", local_hostname="127.0.0.1",
                         segment_size_gb=segment_size_gb, model_name="org/model")


def writer(master: str, answer, stored, done) -> None:
    dev, host = pools()
    random = torch.Generator().manual_seed(0)
    for buffer in dev.k_buffer + dev.v_buffer:
        randomize(buffer, random)
    device_pages, host_pages = slots([5, 1, 6, 2]), slots([9, 3, 12, 0])
    host.backup_from_device_all_layer(dev, host_pages, device_pages)
    backends.current().synchronize()  # put reads host memory: the backup must have landed
    # 64 MiB: Mooncake's smallest segment is 16 MiB, and these pages take far less.
    with store(host, master, segment_size_gb=0.0625) as client:
        answer.put((client.put(KEYS, host_pages), device_bytes(dev, device_pages)))
        stored.set()
        done.wait(timeout=WAIT_S)  # the pages live in this client's segment
    host.close()


def reader(master: str, answer, stored) -> None:
    dev, host = pools()
    host_pages, device_pages = slots([2, 14, 7, 4]), slots([0, 7, 3, 4])
    with store(host, master, segment_size_gb=0) as client:
        stored.wait(timeout=WAIT_S)
        hits = client.exists(KEYS)
        arrived = client.get(KEYS, host_pages)
    host.load_to_device_all_layer(dev, host_pages, device_pages)
    backends.current().synchronize()
    answer.put((hits, arrived, device_bytes(dev, device_pages)))
    host.close()


def main() -> int:
    if importlib.util.find_spec("mooncake") is None or master_binary() is None:
        # Checked before any process starts: each would otherwise fail on its own, deep inside Mooncake's setup.
        print(f"l3_mooncake_share.py needs Mooncake's client and mooncake_master; {INSTALL_HINT}", file=sys.stderr)
        return 2
    context = multiprocessing.get_context("spawn")
    to_writer, to_reader, stored, done = context.Queue(), context.Queue(), context.Event(), context.Event()
    with MooncakeMaster(host="127.0.0.1") as master:
        processes = [context.Process(target=writer, args=(master.address, to_writer, stored, done)),
                     context.Process(target=reader, args=(master.address, to_reader, stored))]
        for process in processes:
            process.start()
        try:
            put, sent = to_writer.get(timeout=WAIT_S)
            hits, arrived, received = to_reader.get(timeout=WAIT_S)
        finally:
            done.set()
            for process in processes:
                process.join(timeout=WAIT_S)
                if process.is_alive():
                    process.kill()
        failed = [p.name for p in processes if p.exitcode != 0]
    if failed:
        print(f"{', '.join(failed)} exited with an error", file=sys.stderr)
        return 1
    if put != [True] * len(KEYS) or hits != len(KEYS) or arrived != [True] * len(KEYS):
        print(f"the store lost pages: put {put}, exists {hits}, get {arrived}", file=sys.stderr)
        return 1
    if received != sent:
        print("the reader's K or V differ from the writer's", file=sys.stderr)
        return 1
    print(f"{len(KEYS)} pages, {sum(map(len, sent))} bytes of K and V, from one process's device to another's "
          f"through MooncakeStore (master {master.address}, stopped) on the {backends.current().name} backend: bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
