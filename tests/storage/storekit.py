"""What the storage tests share: pools filled with random bytes, page bytes, unique keys, the Mooncake skip."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
import torch
from kvspec import LATENT_DIM, bits, device_buffers, device_pool, every_tensor, host_buffers, host_pool, page_tokens, randomize

from portable_kv import storage
from portable_kv.layout import canonical_view
from portable_kv.storage.master import master_binary

MOONCAKE_MISSING = importlib.util.find_spec("mooncake") is None or master_binary() is None
needs_mooncake = pytest.mark.skipif(MOONCAKE_MISSING, reason="Mooncake is not installed (pip install 'portable-kv[mooncake]'; its binaries need libibverbs1)")


def make_host(layout: str = "page_first_direct", dtype: torch.dtype = torch.bfloat16, *, pool: str = "MHA", layers: int = 3, tokens: int = 64,
              page_size: int = 8, k_heads: int = 2, k_dim: int = 24, v_heads: int = 2, v_dim: int = 16, latent_dim: int = LATENT_DIM, seed: int = 0,
              io: str = "direct", device: str | None = None):
    """A device pool of kind `pool` (MHA or MLA) and a host pool twice its size, both filled with random bytes (NaNs included)."""
    dev = device_pool(pool, layers, tokens, page_size, dtype, k_heads=k_heads, k_dim=k_dim, v_heads=v_heads, v_dim=v_dim,
                      latent_dim=latent_dim, device=device)
    host = host_pool(dev, host_to_device_ratio=2.0, layout=layout, io_backend=io)
    gen = torch.Generator().manual_seed(seed)
    for t in every_tensor(dev, host):
        randomize(t, gen)
    return dev, host


def page_bytes(host, page: int) -> tuple[torch.Tensor, ...]:
    """The bytes of one host page, each buffer (K and V, or the latent), in the canonical (token, layer, head, dim) order."""
    return tuple(bits(canonical_view(b, host.layout, host.page_size)[page]) for b in host_buffers(host))


def unique_keys(n: int) -> list[str]:
    """Fresh keys: objects outlive a test (Mooncake keeps them, and leases them ~10 s after a get)."""
    return [uuid.uuid4().hex for _ in range(n)]


def open_store(kind: str, host, tmp_path, master=None, **namespace):
    """A LocalStore under tmp_path, or a MooncakeStore on the given master contributing a small segment."""
    segment_size_gb = namespace.pop("segment_size_gb", 0.0625)
    if kind == "local":
        return storage.LocalStore(host, tmp_path / "pages", **namespace)
    return storage.MooncakeStore(host, master=master.address, segment_size_gb=segment_size_gb, **namespace)


def pool_bytes(host) -> list[torch.Tensor]:
    return [bits(buffer).clone() for buffer in host_buffers(host)]


def changed_pages(host, before: list[torch.Tensor]) -> set[int]:
    """Host pages whose bytes differ from `before` (pool_bytes taken earlier) in any buffer."""
    changed = set()
    for buffer, old in zip(host_buffers(host), before):
        now, was = (canonical_view(b, host.layout, host.page_size) for b in (bits(buffer), old))
        diff = (now != was).reshape(now.shape[0], -1).any(dim=1)
        changed |= set(torch.nonzero(diff).flatten().tolist())
    return changed


def device_tokens(dev, tokens: torch.Tensor) -> list[bytes]:
    """The bytes of the given device tokens, all layers, each buffer (K then V, or the latent)."""
    return [bits(torch.stack([layer[tokens.to(layer.device)] for layer in side])).numpy().tobytes() for side in device_buffers(dev)]


# Two processes, each with its own device and host pool: the writer backs device pages up and puts
# them, the reader gets them into its host pool and loads them to its device.  Spawned, so they run
# at module level and start together; each answers on its queue, and every wait is bounded.


def writer(backend: str, io: str, layout: str, master: str, keys: list[str], answer, stored, done) -> None:
    from portable_kv import backends

    backends.use(backend)
    dev, host = make_host(layout, io=io, seed=1, tokens=128, page_size=16, k_heads=4, k_dim=192, v_heads=4, v_dim=128)
    dev_pages, host_pages = torch.tensor([5, 1, 6, 2]), torch.tensor([9, 3, 12, 0])
    host.backup_from_device_all_layer(dev, page_tokens(host_pages, 16), page_tokens(dev_pages, 16))
    backends.current().synchronize()
    source = device_tokens(dev, page_tokens(dev_pages, 16))
    with storage.MooncakeStore(host, master=master, segment_size_gb=0.0625, model_name="org/model") as store:
        answer.put((store.put(keys, page_tokens(host_pages, 16)), source))
        stored.set()
        # The pages live in this process's segment: stay until the reader has them.
        done.wait(timeout=120)
    host.close()


def reader(backend: str, io: str, layout: str, master: str, keys: list[str], answer, stored) -> None:
    from portable_kv import backends

    backends.use(backend)
    dev, host = make_host(layout, io=io, seed=2, tokens=128, page_size=16, k_heads=4, k_dim=192, v_heads=4, v_dim=128)
    host_pages, dev_pages = torch.tensor([2, 14, 7, 4]), torch.tensor([0, 7, 3, 4])
    with storage.MooncakeStore(host, master=master, segment_size_gb=0, model_name="org/model") as store:
        stored.wait(timeout=120)
        hits = store.exists(keys)
        arrived = store.get(keys, page_tokens(host_pages, 16))
    host.load_to_device_all_layer(dev, page_tokens(host_pages, 16), page_tokens(dev_pages, 16))
    backends.current().synchronize()
    loaded = device_tokens(dev, page_tokens(dev_pages, 16))
    host.close()
    answer.put((hits, arrived, loaded))
