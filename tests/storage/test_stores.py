"""Both stores against the contract (docs/API.md, "Storage tier (L3)"): every pool kind x layout x dtype,
bit-exact, SGLang's object names and page bytes (MHA: K and V objects; MLA: one), per-page results,
and bad input refused before any byte moves."""

from __future__ import annotations

import pytest
import torch
from kvspec import DTYPES, bits, pool_layouts
from storekit import MOONCAKE_MISSING, changed_pages, make_host, open_store, page_bytes, page_tokens, pool_bytes, unique_keys

from portable_kv import storage

POOLS = ("MHA", "MLA")


def same_pages(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> bool:
    return len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pool, layout", pool_layouts())
def test_roundtrip_is_bit_exact(kind, opened, pool, layout, dtype):
    host, store = opened(kind, layout, dtype, pool)
    sources, targets = [1, 5, 2], [7, 0, 3]
    expected = [page_bytes(host, p) for p in sources]
    keys = unique_keys(3)
    assert store.put(keys, page_tokens(torch.tensor(sources), host.page_size)) == [True] * 3
    assert store.exists(keys) == 3
    before = pool_bytes(host)
    assert store.get(keys, page_tokens(torch.tensor(targets), host.page_size)) == [True] * 3
    for page, want in zip(targets, expected):
        assert same_pages(page_bytes(host, page), want), f"page {page}"
    assert changed_pages(host, before) <= set(targets)


@pytest.mark.parametrize("pool", POOLS)
def test_missing_key_in_a_batch(kind, opened, pool):
    host, store = opened(kind, pool=pool)
    keys = unique_keys(4)
    stored = [keys[0], keys[2]]
    assert store.put(stored, page_tokens(torch.tensor([1, 2]), host.page_size)) == [True, True]
    assert store.exists(keys) == 1
    assert store.exists(keys[2:3]) == 1
    expected = [page_bytes(host, 1), page_bytes(host, 2)]
    before = pool_bytes(host)
    assert store.get(keys[:3], page_tokens(torch.tensor([10, 11, 12]), host.page_size)) == [True, False, True]
    assert changed_pages(host, before) == {10, 12}
    for page, want in zip((10, 12), expected):
        assert same_pages(page_bytes(host, page), want)


@pytest.mark.parametrize("pool", POOLS)
def test_a_stored_key_is_not_written_again(kind, opened, pool):
    host, store = opened(kind, pool=pool)
    keys = unique_keys(2)
    assert store.put(keys[:1], page_tokens(torch.tensor([1]), host.page_size)) == [True]
    first = page_bytes(host, 1)
    assert store.put(keys, page_tokens(torch.tensor([4, 5]), host.page_size)) == [True, True]
    assert store.get(keys[:1], page_tokens(torch.tensor([9]), host.page_size)) == [True]
    assert all(torch.equal(a, b) for a, b in zip(page_bytes(host, 9), first))


def test_object_names_are_sglangs(tmp_path):
    """MHA: `{prefix}_{key}_{tp}[_{pp}]`, then `_k` and `_v`.  MLA: `{prefix}_{key}_[{pp}]`, then one `_k`
    (SGLang's `{key}__k`): every tensor-parallel rank holds the same latent, so its rank is not named."""
    _, host = make_host()
    assert storage.LocalStore(host, tmp_path).object_names(["abc"]) == ["abc_0"]
    assert storage.LocalStore(host, tmp_path, model_name="org/sub/model", tp_rank=3).object_names(["abc"]) == ["org-sub-model_abc_3"]
    assert storage.LocalStore(host, tmp_path, model_name="m", tp_rank=1, pp_rank=2, backend_tag="tag").object_names(["abc"]) == ["tag_m_abc_1_2"]
    assert storage.LocalStore(host, tmp_path).objects == ("k", "v")
    _, latent = make_host(pool="MLA")
    assert storage.LocalStore(latent, tmp_path).object_names(["abc"]) == ["abc_"]
    assert storage.LocalStore(latent, tmp_path, model_name="org/sub/model", tp_rank=3).object_names(["abc"]) == ["org-sub-model_abc_"]
    assert storage.LocalStore(latent, tmp_path, model_name="m", tp_rank=1, pp_rank=2, backend_tag="tag").object_names(["abc"]) == ["tag_m_abc_2"]
    assert storage.LocalStore(latent, tmp_path).objects == ("k",)


@pytest.mark.parametrize("pool", POOLS)
def test_model_and_rank_are_part_of_the_key(kind, store_master, tmp_path, pool):
    """A page of another model or pipeline stage is another page; of another tensor-parallel rank, only in an MHA pool."""
    _, host = make_host(pool=pool)
    keys = unique_keys(2)
    # The writer stays open: a Mooncake client's segment, and the pages in it, go when it closes.
    with open_store(kind, host, tmp_path, store_master, model_name="org/a", tp_rank=0) as store:
        assert store.put(keys, page_tokens(torch.tensor([1, 2]), host.page_size)) == [True, True]
        assert store.exists(keys) == 2
        for other in ({"model_name": "org/b", "tp_rank": 0}, {"model_name": "org/a", "tp_rank": 1}, {"model_name": "org/a", "tp_rank": 0, "pp_rank": 0}):
            with open_store(kind, host, tmp_path, store_master, segment_size_gb=0, **other) as reader:
                shared = pool == "MLA" and other == {"model_name": "org/a", "tp_rank": 1}
                assert reader.exists(keys) == (2 if shared else 0), other


@pytest.mark.parametrize("pool, layout", pool_layouts())
def test_stored_bytes_are_the_flat_page(kind, opened, pool, layout):
    """What a store holds for a page is SGLang's flat page of this layout: K block then V block (MLA: the latent block)."""
    host, store = opened(kind, layout, pool=pool)
    key = unique_keys(1)
    assert store.put(key, page_tokens(torch.tensor([3]), host.page_size)) == [True]
    name = store.object_names(key)[0]
    flat = bits(host.get_data_page(3 * host.page_size, flat=True))
    if kind == "local":
        stored = (store.path / f"{name}.bin").read_bytes()
    else:
        stored = _raw_objects(store.master, [f"{name}_{part}" for part in store.objects], list(store.object_bytes))
    assert stored == flat.numpy().tobytes()


def _raw_objects(master: str, objects: list[str], sizes: list[int]) -> bytes:
    """Objects read by a bare Mooncake client, as SGLang's backend reads them."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8)
    assert client.register_buffer(buffer.data_ptr(), buffer.numel()) == 0
    offsets = [sum(sizes[:n]) for n in range(len(sizes))]
    try:
        assert client.batch_get_into(objects, [buffer.data_ptr() + o for o in offsets], sizes) == sizes
    finally:
        client.unregister_buffer(buffer.data_ptr())
        client.close()
    return buffer.numpy().tobytes()


BAD_CALLS = [
    ("keys", lambda P: ("abc", page_tokens(torch.tensor([1]), P)), TypeError),
    ("keys", lambda P: (["a", ""], page_tokens(torch.tensor([1, 2]), P)), TypeError),
    ("keys", lambda P: (["a", 7], page_tokens(torch.tensor([1, 2]), P)), TypeError),
    ("host_indices", lambda P: (["a", "b"], page_tokens(torch.tensor([1]), P)), ValueError),
    ("host_indices", lambda P: (["a"], torch.tensor([1])), ValueError),
    ("host_indices", lambda P: (["a"], page_tokens(torch.tensor([1]), P) + 1), ValueError),
    ("host_indices", lambda P: (["a"], page_tokens(torch.tensor([1]), P).flip(0)), ValueError),
    ("host_indices", lambda P: (["a"], page_tokens(torch.tensor([16]), P)), ValueError),
    ("host_indices", lambda P: (["a"], page_tokens(torch.tensor([-1]), P)), ValueError),
    ("host_indices", lambda P: (["a"], page_tokens(torch.tensor([1]), P).float()), TypeError),
    ("host_indices", lambda P: (["a"], page_tokens(torch.tensor([1]), P).view(1, -1)), TypeError),
    ("host_indices", lambda P: (["a"], "0-8"), TypeError),
]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("name,call,error", BAD_CALLS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_CALLS)])
def test_bad_input_is_refused_before_any_byte_moves(kind, opened, op, name, call, error, pool):
    host, store = opened(kind, pool=pool)
    keys, indices = call(host.page_size)
    if isinstance(keys, list) and all(isinstance(k, str) and k for k in keys):
        keys = [f"{k}-{op}-{name}-{pool}-{hash(str(indices))}" for k in keys]
    before = pool_bytes(host)
    with pytest.raises(error, match=name):
        getattr(store, op)(keys, indices)
    assert changed_pages(host, before) == set()
    if isinstance(keys, list) and all(isinstance(k, str) and k for k in keys):
        assert store.exists(keys) == 0


def test_a_get_names_each_destination_once(kind, opened):
    host, store = opened(kind)
    keys = unique_keys(2)
    assert store.put(keys, page_tokens(torch.tensor([1, 2]), host.page_size)) == [True, True]
    before = pool_bytes(host)
    with pytest.raises(ValueError, match="host_indices: a page is named twice"):
        store.get(keys, page_tokens(torch.tensor([5, 5]), host.page_size))
    assert changed_pages(host, before) == set()


def test_empty_batches_and_closing(kind, store_master, tmp_path):
    _, host = make_host()
    store = open_store(kind, host, tmp_path, store_master)
    assert store.exists([]) == 0
    assert store.put([], torch.empty(0, dtype=torch.int64)) == []
    assert store.get([], []) == []
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.put(["a"], page_tokens(torch.tensor([1]), host.page_size))


def test_a_store_refuses_a_closed_host_pool(kind, store_master, tmp_path):
    _, host = make_host()
    with open_store(kind, host, tmp_path, store_master) as store:
        host.close()
        with pytest.raises(ValueError, match="host pool was closed"):
            store.get(["a"], page_tokens(torch.tensor([1]), 8))
    with pytest.raises(ValueError, match="host: the pool is closed"):
        open_store(kind, host, tmp_path, store_master)


def test_constructor_arguments_are_checked(tmp_path):
    _, host = make_host()
    with pytest.raises(TypeError, match="host: expected an AsymmetricHostPool or MLAHostPool"):
        storage.LocalStore(object(), tmp_path)
    with pytest.raises(ValueError, match="tp_rank"):
        storage.LocalStore(host, tmp_path, tp_rank=-1)
    with pytest.raises(TypeError, match="model_name"):
        storage.LocalStore(host, tmp_path, model_name=None)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="path: expected a directory"):
        storage.LocalStore(host, tmp_path / "file")
    # Refused before any connection (Mooncake need not be installed): a misspelt transport
    # would otherwise be retried for ~20 s and reported as "error -1".
    with pytest.raises(ValueError, match="protocol: expected one of Mooncake's transports"):
        storage.MooncakeStore(host, master="127.0.0.1:1", protocol="tpc")
    for size in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="segment_size_gb: expected a finite number"):
            storage.MooncakeStore(host, master="127.0.0.1:1", segment_size_gb=size)


@pytest.mark.parametrize("key", ["../outside", "a/b", "..", "nul\x00byte", "sp ace%"])
def test_any_key_is_one_file_inside_the_local_store(tmp_path, key):
    """A key is any string: LocalStore keeps each one as a single file in its own directory
    (a '/', '..' or NUL byte never reaches the file system as a path), and reads it back."""
    _, host = make_host()
    store = storage.LocalStore(host, tmp_path / "store")
    expected = page_bytes(host, 1)
    assert store.put([key], page_tokens(torch.tensor([1]), host.page_size)) == [True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"], "a file was written outside the store directory"
    assert len(list((tmp_path / "store").iterdir())) == 1
    assert store.exists([key]) == 1
    assert store.get([key], page_tokens(torch.tensor([4]), host.page_size)) == [True]
    assert same_pages(page_bytes(host, 4), expected)
    store.close()
    host.close()


def test_an_interrupted_local_write_leaves_no_partial_file(tmp_path, monkeypatch):
    from portable_kv.storage import local

    _, host = make_host()
    store = storage.LocalStore(host, tmp_path)
    real = local._memory
    calls = []

    def interrupted(ptr, nbytes):
        calls.append(ptr)
        if len(calls) == 2:  # K written, then Ctrl-C before V
            raise KeyboardInterrupt
        return real(ptr, nbytes)

    monkeypatch.setattr(local, "_memory", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put(["page"], page_tokens(torch.tensor([0]), host.page_size))
    assert list(tmp_path.iterdir()) == [], "a partial file outlived the interrupted write"
    store.close()
    host.close()


@pytest.mark.skipif(MOONCAKE_MISSING, reason="Mooncake is not installed")
def test_closing_a_mooncake_store_takes_the_pages_in_its_segment_away(master, tmp_path):
    """A segment is its client's memory: once that client closes, no other client reads the pages in it."""
    _, written = make_host(seed=1)
    _, read = make_host(seed=2)
    keys = unique_keys(2)
    expected = page_bytes(written, 1)
    writer = open_store("mooncake", written, tmp_path, master)
    with open_store("mooncake", read, tmp_path, master, segment_size_gb=0) as reader:
        assert writer.put(keys, page_tokens(torch.tensor([1, 2]), written.page_size)) == [True, True]
        assert reader.exists(keys) == 2
        assert reader.get(keys[:1], page_tokens(torch.tensor([3]), read.page_size)) == [True]
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(read, 3), expected))
        writer.close()
        before = pool_bytes(read)
        assert reader.exists(keys) == 0
        assert reader.get(keys, page_tokens(torch.tensor([4, 5]), read.page_size)) == [False, False]
        assert changed_pages(read, before) == set()
    written.close()
    read.close()
