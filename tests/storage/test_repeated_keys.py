"""A key named more than once in one batch: a get fills every destination it names, a put keeps
the last page named for the key.  Both stores, a writer and a separate reader with its own pool
(for Mooncake: a client with no segment of its own, so the pages cross the transfer engine)."""

from __future__ import annotations

import pytest
import torch
from storekit import changed_pages, make_host, open_store, page_bytes, page_tokens, pool_bytes, unique_keys

from portable_kv.layout import LAYOUTS


def same_page(host, page: int, expected) -> bool:
    return all(torch.equal(a, b) for a, b in zip(page_bytes(host, page), expected))


def reader_of(kind, host, tmp_path, master):
    """A second client over the writer's pages: same directory, or a Mooncake client contributing no segment."""
    return open_store(kind, host, tmp_path, master, **({"segment_size_gb": 0} if kind == "mooncake" else {}))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_key_named_twice_in_a_get_fills_every_destination(kind, store_master, tmp_path, layout):
    _, written = make_host(layout, seed=1)
    _, read = make_host(layout, seed=2)
    read.k_buffer.zero_()
    read.v_buffer.zero_()
    P = written.page_size
    k0, k1 = unique_keys(2)
    expected = {k0: page_bytes(written, 0), k1: page_bytes(written, 1)}
    with open_store(kind, written, tmp_path, store_master) as writer, reader_of(kind, read, tmp_path, store_master) as reader:
        assert writer.put([k0, k1], page_tokens(torch.tensor([0, 1]), P)) == [True, True]
        before = pool_bytes(read)
        assert reader.get([k0, k1, k0], page_tokens(torch.tensor([10, 11, 12]), P)) == [True, True, True]
        for page, key in ((10, k0), (11, k1), (12, k0)):
            assert same_page(read, page, expected[key]), f"destination page {page} ({'k0' if key == k0 else 'k1'}) does not hold the stored page"
        assert changed_pages(read, before) == {10, 11, 12}
        # A missing key named twice: False at both positions, neither destination touched.
        missing = unique_keys(1)[0]
        before = pool_bytes(read)
        assert reader.get([missing, k1, missing], page_tokens(torch.tensor([3, 4, 5]), P)) == [False, True, False]
        assert changed_pages(read, before) == {4}
    written.close()
    read.close()


def test_a_key_named_twice_in_a_put_keeps_the_last_page(kind, store_master, tmp_path):
    _, host = make_host()
    P = host.page_size
    k0, k1 = unique_keys(2)
    last = page_bytes(host, 3)
    with open_store(kind, host, tmp_path, store_master) as store:
        assert store.put([k0, k1, k0], page_tokens(torch.tensor([1, 2, 3]), P)) == [True, True, True]
        assert store.exists([k0, k1]) == 2
        assert store.get([k0], page_tokens(torch.tensor([9]), P)) == [True]
        assert same_page(host, 9, last), "a key put twice in one batch holds another page than the last one named"
    host.close()
