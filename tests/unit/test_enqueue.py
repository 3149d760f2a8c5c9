"""Direct io enqueued by a worker thread (PORTABLE_KV_DIRECT_ENQUEUE=worker), on the simulated
GPU: the same bytes as the caller's own enqueue, the call back before its copies are enqueued,
the caller's stream told to wait for a number the worker's stream writes after the copies,
failures raised by the next call, and no thread left behind."""

from __future__ import annotations

import threading

import pytest
import torch
from fake_gpu import SimulatedGpuBackend
from kvspec import bits, host_row

from portable_kv import config
from portable_kv.backends.runtime import DeviceError
from portable_kv.indices import IndexPair
from portable_kv.layout import LAYOUTS
from portable_kv.transfer import Transfer, tensor_pair

P, LAYERS, TOKENS, HOST_TOKENS = 4, 3, 32, 64


def buffers(backend, layout):
    gen = torch.Generator().manual_seed(5)
    shapes = {"layer_first": (LAYERS, HOST_TOKENS), "page_first": (HOST_TOKENS, LAYERS),
              "page_first_direct": (HOST_TOKENS // P, LAYERS, P), "page_head": (HOST_TOKENS // P, 2, P, LAYERS)}
    host = [torch.randint(-2**15, 2**15, shapes[layout] + ((2, d) if layout != "page_head" else (d,)), dtype=torch.int16, generator=gen)
            for d in (8, 4)]
    device = [[torch.randint(-2**15, 2**15, (TOKENS, 2, d), dtype=torch.int16, generator=gen) for _ in range(LAYERS)] for d in (8, 4)]
    return host, device, tuple(tensor_pair(h, d, layout, P) for h, d in zip(host, device))


def indices():
    host_idx = torch.cat([torch.arange(8, 16), torch.arange(40, 44), torch.arange(28, 32)])
    dev_idx = torch.cat([torch.arange(20, 28), torch.arange(0, 4), torch.arange(12, 16)])
    return host_idx, dev_idx


@pytest.fixture
def worker_backend(monkeypatch):
    monkeypatch.setenv("PORTABLE_KV_DIRECT_ENQUEUE", "worker")
    backend = SimulatedGpuBackend()
    backend.runtime.memops = True
    return backend


def workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "portable_kv direct enqueue"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("to_device", [True, False], ids=["load", "backup"])
def test_worker_enqueue_moves_the_same_bytes_as_the_caller(worker_backend, layout, to_device):
    host, device, pairs = buffers(worker_backend, layout)
    host_idx, dev_idx = indices()
    mover = worker_backend.mover("direct")
    for layer in range(LAYERS):
        mover.move(Transfer(to_device, pairs, IndexPair(host_idx, dev_idx), range(layer, layer + 1), P))
    assert len(mover.workers) == 1, "one worker for the one caller stream"
    mover.close()  # the worker finishes what it was given, then ends
    for layer in range(LAYERS):
        for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
            for buffer, per_layer in zip(host, device):
                assert torch.equal(bits(per_layer[layer][d]), bits(host_row(buffer, layout, P, h, layer))), f"token {h} -> {d}, layer {layer}"
    values = worker_backend.runtime.stream_values
    main = threading.current_thread().name
    assert [v for kind, v, who in values if kind == "wait"] == [1, 2, 3]
    assert all(who == main for kind, _, who in values if kind == "wait"), "the caller's stream waits"
    assert [v for kind, v, who in values if kind == "write"] == [1, 2, 3]
    assert all(who != main for kind, _, who in values if kind == "write"), "the worker's stream writes"
    assert not workers_alive()


def test_the_call_returns_before_its_copies_are_enqueued(worker_backend):
    host, device, pairs = buffers(worker_backend, "page_first")
    host_idx, dev_idx = indices()
    runtime = worker_backend.runtime
    release, entered = threading.Event(), threading.Event()
    copy = runtime.batch_call

    def held(batch, stream):
        entered.set()
        assert release.wait(10)
        return copy(batch, stream)

    runtime.batch_call = held
    mover = worker_backend.mover("direct")
    before = device[0][0][dev_idx].clone()
    mover.move(Transfer(True, pairs, IndexPair(host_idx, dev_idx), range(0, 1), P))
    assert entered.wait(10), "the worker took the copies"
    assert torch.equal(device[0][0][dev_idx], before), "the call returned with its copies not yet enqueued"
    assert ("wait", 1, threading.current_thread().name) in runtime.stream_values
    assert not any(kind == "write" for kind, _, _ in runtime.stream_values), "no number written before the copies"
    release.set()
    mover.close()
    assert not torch.equal(device[0][0][dev_idx], before)
    assert runtime.stream_values[-1][:2] == ("write", 1)


def test_a_failed_enqueue_is_raised_by_the_next_call_and_its_number_still_written(worker_backend):
    host, device, pairs = buffers(worker_backend, "layer_first")
    host_idx, dev_idx = indices()
    runtime = worker_backend.runtime

    def refuse(batch, stream):
        raise DeviceError("simMemcpyBatchAsync", 1, "simErrorInvalidValue")

    runtime.batch_call = refuse
    mover = worker_backend.mover("direct")
    transfer = Transfer(True, pairs, IndexPair(host_idx, dev_idx), range(0, 1), P)
    mover.move(transfer)
    worker = next(iter(mover.workers.values()))
    worker.stop()  # let it finish the failed call
    assert ("write", 1) in [v[:2] for v in runtime.stream_values], "the caller's stream is released even so"
    with pytest.raises(RuntimeError, match="earlier direct transfer failed") as raised:
        mover.move(transfer)
    assert isinstance(raised.value.__cause__, DeviceError)
    mover.close()
    assert not workers_alive()


def test_a_dropped_mover_ends_its_worker(worker_backend):
    host, device, pairs = buffers(worker_backend, "page_first")
    host_idx, dev_idx = indices()
    mover = worker_backend.mover("direct")
    mover.move(Transfer(True, pairs, IndexPair(host_idx, dev_idx), range(0, 1), P))
    thread = next(iter(mover.workers.values())).thread
    del mover
    thread.join(10)
    assert not thread.is_alive()


def test_without_stream_memory_operations_the_caller_enqueues(monkeypatch):
    monkeypatch.setenv("PORTABLE_KV_DIRECT_ENQUEUE", "worker")
    backend = SimulatedGpuBackend()  # memops off: a device whose driver has none
    host, device, pairs = buffers(backend, "page_first")
    host_idx, dev_idx = indices()
    mover = backend.mover("direct")
    mover.move(Transfer(True, pairs, IndexPair(host_idx, dev_idx), range(0, 1), P))
    assert not mover.workers and not backend.runtime.stream_values
    assert torch.equal(bits(device[0][0][dev_idx[0]]), bits(host_row(host[0], "page_first", P, int(host_idx[0]), 0)))


def test_the_setting_names_itself_when_malformed(monkeypatch):
    monkeypatch.setenv("PORTABLE_KV_DIRECT_ENQUEUE", "later")
    with pytest.raises(config.ConfigError, match="PORTABLE_KV_DIRECT_ENQUEUE: expected caller or worker"):
        config.direct_enqueue()
