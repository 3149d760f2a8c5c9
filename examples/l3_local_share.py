"""Two processes share KV pages through a LocalStore, a directory of page files.

The writer fills its device pool with random bits, backs pages up to its host pool
and puts them in the store under page keys. The reader, a separate process with its
own pools, gets the pages by key into other host slots and loads them into other
device slots. The K and V bytes that arrive on the reader's device are compared with
the writer's, bit for bit. A page file appears whole or not at all, so processes and
hosts that share the directory never read a partial page.

Runs on a GPU or, with the cpu backend, on any machine: python3 examples/l3_local_share.py
"""

from __future__ import annotations

import multiprocessing
import sys
import tempfile

import torch

import portable_kv as pk
from portable_kv import backends
from portable_kv.storage import LocalStore
from portable_kv.testing import bits, page_tokens, randomize

PAGE = 16
KEYS = ["prefix-0", "prefix-1", "prefix-2", "prefix-3"]  # an engine's keys: hashes of each page's tokens and prefix


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


def writer(path: str, answer: multiprocessing.Queue) -> None:
    dev, host = pools()
    random = torch.Generator().manual_seed(0)
    for buffer in dev.k_buffer + dev.v_buffer:
        randomize(buffer, random)
    device_pages, host_pages = slots([5, 1, 6, 2]), slots([9, 3, 12, 0])
    host.backup_from_device_all_layer(dev, host_pages, device_pages)
    backends.current().synchronize()  # put reads host memory: the backup must have landed
    with LocalStore(host, path, model_name="org/model") as store:
        stored = store.put(KEYS, host_pages)
    answer.put((stored, device_bytes(dev, device_pages)))
    host.close()


def reader(path: str, answer: multiprocessing.Queue) -> None:
    dev, host = pools()
    host_pages, device_pages = slots([2, 14, 7, 4]), slots([0, 7, 3, 4])
    with LocalStore(host, path, model_name="org/model") as store:
        hits = store.exists(KEYS)
        arrived = store.get(KEYS, host_pages)
    host.load_to_device_all_layer(dev, host_pages, device_pages)
    backends.current().synchronize()
    answer.put((hits, arrived, device_bytes(dev, device_pages)))
    host.close()


def run(role, path: str) -> tuple:
    """`role` in a process of its own (spawned, as an engine's processes are), and what it answered."""
    context = multiprocessing.get_context("spawn")
    answer = context.Queue()
    process = context.Process(target=role, args=(path, answer))
    process.start()
    result = answer.get(timeout=300)
    process.join(timeout=60)
    if process.exitcode != 0:
        sys.exit(f"{role.__name__} exited with status {process.exitcode}")
    return result


def main() -> int:
    with tempfile.TemporaryDirectory() as path:
        stored, sent = run(writer, path)  # the writer is gone before the reader starts: the pages live in the files
        hits, arrived, received = run(reader, path)
    if stored != [True] * len(KEYS) or hits != len(KEYS) or arrived != [True] * len(KEYS):
        print(f"the store lost pages: put {stored}, exists {hits}, get {arrived}", file=sys.stderr)
        return 1
    if received != sent:
        print("the reader's K or V differ from the writer's", file=sys.stderr)
        return 1
    print(f"{len(KEYS)} pages, {sum(map(len, sent))} bytes of K and V, from one process's device to another's "
          f"through LocalStore on the {backends.current().name} backend: bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
