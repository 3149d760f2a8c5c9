"""MooncakeStore when the cluster misbehaves: no master, a full store, pages too large, the master killed.

Every call must come back (per-page False or a clear error) within a bound; none may hang."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from storekit import changed_pages, make_host, needs_mooncake, page_bytes, page_tokens, pool_bytes, unique_keys

from portable_kv import storage
from portable_kv.storage import base
from portable_kv.storage.master import free_port

pytestmark = needs_mooncake

# The call that first finds the master gone is bounded by Mooncake's own RPC timeouts (at once when
# the port refuses, as after a kill; MC_RPC_TIMEOUT_MS, 30 s by default, when the master hangs).
CALL_BOUND_S = 15.0
# Every later call, until the master answers again, fails at once (mooncake.py's docstring).
FAST_S = 0.5
# A master restarted on the same address is used again within this (probes every 1 s; the client
# mounts its segment again on its own).
RECOVER_S = 5.0
# close() with the master gone waits out the client's own unmount retries: ~11 s idle, ~15 s on
# a loaded 2-core machine (docs/API.md); bounded, but not by our call bound.
CLOSE_BOUND_S = 30.0


def big_pages_host():
    """Pages of 320 KiB (K 192 KiB + V 128 KiB), 128 of them: a 16 MiB segment holds about 50."""
    return make_host("page_first_direct", layers=4, tokens=2048, page_size=32, k_heads=4, k_dim=192, v_heads=4, v_dim=128)[1]


def test_no_master_is_a_clear_error_within_30_s():
    _, host = make_host()
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"master: no Mooncake master answers at {address}"):
        storage.MooncakeStore(host, master=address)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("master", ["localhost", "127.0.0.1:0", "127.0.0.1:99999", 50051])
def test_a_malformed_master_address_is_refused(master):
    _, host = make_host()
    with pytest.raises(ValueError, match="master: expected 'host:port'"):
        storage.MooncakeStore(host, master=master)


def test_a_full_store_reports_the_pages_it_did_not_keep(own_master):
    host = big_pages_host()
    keys = unique_keys(64)
    tokens = page_tokens(torch.arange(64), host.page_size)
    with storage.MooncakeStore(host, master=own_master.address, segment_size_gb=16 / 1024) as store:
        stored = store.put(keys, tokens)
        assert True in stored and False in stored, "16 MiB cannot hold 64 pages of 320 KiB"
        kept = [k for k, ok in zip(keys, stored) if ok]
        expected = {k: page_bytes(host, p) for p, k in enumerate(keys)}
        targets = torch.arange(64, 64 + len(kept))
        before = pool_bytes(host)
        arrived = store.get(kept, page_tokens(targets, host.page_size))
    # The master may evict some kept pages to make room; what arrives is exact and nothing else changes.
    assert sum(arrived) > 0
    assert changed_pages(host, before) <= set(targets.tolist())
    for page, key, ok in zip(targets.tolist(), kept, arrived):
        if ok:
            assert all(torch.equal(a, b) for a, b in zip(page_bytes(host, page), expected[key]))


def test_a_page_larger_than_the_segment_is_refused(master):
    # K of one page: 64 layers x 64 tokens x 8 heads x 256 x 2 bytes = 16 MiB + ...
    _, host = make_host("page_first_direct", torch.float16, layers=65, tokens=64, page_size=64, k_heads=8, k_dim=256, v_heads=1, v_dim=8)
    with pytest.raises(ValueError, match="segment_size_gb: expected 0 or at least"):
        storage.MooncakeStore(host, master=master.address, segment_size_gb=16 / 1024)


def test_a_segment_below_mooncakes_minimum_is_refused(master):
    _, host = make_host()
    with pytest.raises(ValueError, match="segment_size_gb"):
        storage.MooncakeStore(host, master=master.address, segment_size_gb=0.001)
    with pytest.raises(ValueError, match="segment_size_gb"):
        storage.MooncakeStore(host, master=master.address, segment_size_gb=-1)


def test_master_killed_during_a_batch_and_between_calls(own_master):
    host = big_pages_host()
    P = host.page_size
    store = storage.MooncakeStore(host, master=own_master.address, segment_size_gb=0.25)
    keys = unique_keys(8)
    assert store.put(keys, page_tokens(torch.arange(8), P)) == [True] * 8

    # During: puts of fresh batches while the master is killed; each call must return in bounded time.
    killer = threading.Timer(0.2, own_master.kill)
    killer.start()
    slowest = 0.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and own_master.process.poll() is None:
        started = time.monotonic()
        store.put(unique_keys(16), page_tokens(torch.arange(8, 24), P))
        slowest = max(slowest, time.monotonic() - started)
    killer.join()
    assert own_master.process.poll() is not None, "the master was not killed"
    # Once the master is gone, a put stores nothing and says so page by page.
    started = time.monotonic()
    answer = store.put(unique_keys(16), page_tokens(torch.arange(8, 24), P))
    slowest = max(slowest, time.monotonic() - started)
    assert slowest < CALL_BOUND_S
    assert answer == [False] * 16

    # Between calls: misses and per-page False at once, the host pool untouched.
    before = pool_bytes(host)
    for call in (lambda: store.exists(keys), lambda: store.get(keys, page_tokens(torch.arange(30, 38), P)), lambda: store.put(unique_keys(2), page_tokens(torch.arange(2), P))):
        started = time.monotonic()
        answer = call()
        assert time.monotonic() - started < FAST_S
        assert answer in (0, [False] * 8, [False] * 2)
    assert changed_pages(host, before) == set()
    started = time.monotonic()
    store.close()
    assert time.monotonic() - started < CLOSE_BOUND_S


def test_with_the_master_gone_calls_fail_at_once_until_it_is_back(own_master, monkeypatch):
    """Measured with 0.3.13 on loopback, master SIGKILLed: before the store marked the master
    unreachable, each get or lookup after the first two waited ~4.4 s and each put ~8.8 s (a
    16-batch staged read 66-71 s).  Now the first failed call marks it, every later call returns
    per-page False at once (~1 ms measured, the first staged get 10-55 ms) and a master restarted
    on the same port is used again 0.6-2 s after it starts (`pytest -s` prints the figures)."""
    # One page per staging chunk: a staged call of 16 pages makes 16 calls into the client.
    monkeypatch.setattr(base, "STAGING_BYTES", 1)
    _, host = make_host("layer_first", tokens=128, page_size=8)
    P = host.page_size
    store = storage.MooncakeStore(host, master=own_master.address, segment_size_gb=0.0625)
    keys = unique_keys(16)
    assert store.put(keys, page_tokens(torch.arange(16), P)) == [True] * 16
    address = own_master.address
    own_master.kill()

    started = time.monotonic()
    assert store.exists(keys) == 0
    first = time.monotonic() - started
    assert first < CALL_BOUND_S
    assert store.master_unreachable

    before = pool_bytes(host)
    slowest = {"exists": 0.0, "get": 0.0, "put": 0.0}
    calls = {
        "exists": (lambda: store.exists(keys), 0),
        "get": (lambda: store.get(keys, page_tokens(torch.arange(16, 32), P)), [False] * 16),
        "put": (lambda: store.put(unique_keys(16), page_tokens(torch.arange(16), P)), [False] * 16),
    }
    for _ in range(5):
        for name, (call, expected) in calls.items():
            started = time.monotonic()
            answer = call()
            elapsed = time.monotonic() - started
            slowest[name] = max(slowest[name], elapsed)
            assert answer == expected, name
            assert elapsed < FAST_S, f"{name} took {elapsed:.2f} s with the master gone"
        time.sleep(0.2)  # probes run meanwhile: a probe never holds up a call
    assert changed_pages(host, before) == set()

    own_master.start()
    assert own_master.address == address
    restarted = time.monotonic()
    back = None
    while time.monotonic() - restarted < RECOVER_S:
        fresh = unique_keys(2)
        if store.put(fresh, page_tokens(torch.tensor([3, 4]), P)) == [True, True] and store.get(fresh, page_tokens(torch.tensor([20, 21]), P)) == [True, True]:
            back = time.monotonic() - restarted
            break
        time.sleep(0.1)
    print(f"first failed call {first:.3f} s; slowest later calls {', '.join(f'{k} {v * 1000:.1f} ms' for k, v in slowest.items())}; used again after {back} s")
    assert back is not None, f"the restarted master was not used again within {RECOVER_S:.0f} s"
    assert not store.master_unreachable
    # The restarted master starts empty: the pages stored before it went away are gone.
    assert store.exists(keys) == 0
    for source, target in ((3, 20), (4, 21)):
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(host, source), page_bytes(host, target)))
    prober = store._prober
    store.close()
    assert prober is None or not prober.is_alive(), "the probe thread outlived close()"
    host.close()
