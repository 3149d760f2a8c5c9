"""Pages shared across processes: one process backs its device pages up and puts them, another
(spawned, its own host and device pool) gets them and loads them to its device, bit-exact."""

from __future__ import annotations

import multiprocessing
import queue

import pytest
import storekit
from storekit import needs_mooncake, unique_keys

from portable_kv import backends

pytestmark = needs_mooncake
WAIT_S = 120


def share_pages(master: str, backend: str, io: str, layout: str) -> None:
    """Run the writer and the reader (storekit) in two spawned processes; compare what arrived on the reader's device."""
    ctx = multiprocessing.get_context("spawn")
    keys = unique_keys(4)
    to_parent_w, to_parent_r, stored, done = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    writer = ctx.Process(target=storekit.writer, args=(backend, io, layout, master, keys, to_parent_w, stored, done))
    reader = ctx.Process(target=storekit.reader, args=(backend, io, layout, master, keys, to_parent_r, stored))
    try:
        writer.start()
        reader.start()
        put, source = to_parent_w.get(timeout=WAIT_S)
        assert put == [True] * 4
        hits, arrived, loaded = to_parent_r.get(timeout=WAIT_S)
        done.set()
        assert hits == 4
        assert arrived == [True] * 4
        assert loaded[0] == source[0], "K differs after device -> host -> store -> host -> device"
        assert loaded[1] == source[1], "V differs after device -> host -> store -> host -> device"
        for process in (writer, reader):
            process.join(timeout=WAIT_S)
            assert process.exitcode == 0
    except queue.Empty:
        pytest.fail(f"a store process did not answer within {WAIT_S} s (exit codes: writer {writer.exitcode}, reader {reader.exitcode})")
    finally:
        done.set()
        for process in (writer, reader):
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def test_two_processes_share_pages_through_mooncake(master):
    share_pages(master.address, "cpu", "direct", "page_first_direct")


GPU = [n for n in ("cuda", "rocm") if backends.unavailable_reason(n) is None]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU backend: " + str(backends.unavailable_reason("cuda")))
@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("layout", ["page_first_direct", "page_first", "page_head"])
def test_gpu_to_store_to_gpu_across_processes(master, io, layout):
    share_pages(master.address, GPU[0], io, layout)
