"""The staged and auto io paths against the CPU oracle: every backend that offers them x
pool kind x layout x page size x placement of the host pages x staging size, each way,
one layer and all layers, bit for bit.  A small staging size cuts a transfer into many chunks
(both slots in turn); a tiny one leaves a slot too small for a page (the kernel path
then moves it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kvspec import DTYPES, TOKEN_LAYOUTS, bits, device_buffers, device_pool, every_tensor, host_buffers, host_pool, pool_layouts, randomize
from test_oracle import run

from portable_kv.allocator import PageRunAllocator
from portable_kv.io import staged
from portable_kv.layout import LAYOUTS

STAGED_IOS = ("staged", "auto")
PAGES = 16  # device pages; the host pool holds twice as many
OPS = ("load_layer", "load_all", "backup_layer", "backup_all")
STAGING = {"default": None, "small": 8 << 10, "tiny": 512}


def placement(kind: str, layout: str, page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(host indices, device indices): host pages in runs, at random, placed by the allocator
    after churn, or (token layouts) single tokens at random around a run that crosses pages."""
    host_pages, offsets = 2 * PAGES, torch.arange(page_size)
    device_pages = torch.randperm(PAGES, generator=gen)[:10]
    if kind == "runs":
        pages = torch.tensor([1, 2, 3, 4, 5, 6, 20, 21, 9, 30])
    elif kind == "random":
        pages = torch.randperm(host_pages, generator=gen)[:10]
    elif kind == "allocator":
        allocator = PageRunAllocator(host_pages * page_size, page_size)
        held = [allocator.alloc(page_size * n) for n in (3, 1, 4, 2, 5, 1, 3)]
        for slots in held[::2]:
            allocator.free(slots)
        return allocator.alloc(10 * page_size), (device_pages[:, None] * page_size + offsets).reshape(-1)
    else:
        if layout not in TOKEN_LAYOUTS:
            pytest.skip(f"{layout} moves whole pages")
        run_tokens = torch.arange(3, 3 + 2 * page_size + 3)
        others = torch.randperm(host_pages * page_size, generator=gen)
        others = others[(others < run_tokens[0]) | (others > run_tokens[-1])][:7]
        host = torch.cat((others[:3], run_tokens, others[3:]))
        return host, torch.randperm(PAGES * page_size, generator=gen)[: host.numel()]
    return (pages[:, None] * page_size + offsets).reshape(-1), (device_pages[:, None] * page_size + offsets).reshape(-1)


def shape(page_size: int, dtype: torch.dtype = torch.bfloat16, pool: str = "MHA", **geometry: int) -> dict:
    """kvspec.device_pool's arguments: 3 layers of PAGES pages, K 2x24 and V 2x16 (or the latent) unless given."""
    return dict(kind=pool, layers=3, tokens=PAGES * page_size, page_size=page_size, dtype=dtype, **geometry)


def check_against_oracle(backend, io: str, case_shape: dict, layout: str, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
    if io not in backend.io_backends:
        pytest.skip(f"backend {backend.name} has no {io} io backend")
    for n, op in enumerate(OPS):
        layer = n % case_shape["layers"]
        expected = run("cpu", "kernel", case_shape, layout, host_idx, dev_idx, op, layer, n)
        got = run(backend.name, io, case_shape, layout, host_idx, dev_idx, op, layer, n)
        for buffer, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), f"{backend.name}/{io} {op}: buffer {buffer} differs from the oracle"


@pytest.mark.parametrize("staging", tuple(STAGING))
@pytest.mark.parametrize("kind", ("runs", "random", "allocator", "tokens"))
@pytest.mark.parametrize("page_size", (1, 4, 16))
@pytest.mark.parametrize("io", STAGED_IOS)
@pytest.mark.parametrize("pool, layout", pool_layouts())
def test_staged_matches_oracle(backend, pool, layout, io, page_size, kind, staging, monkeypatch, gen):
    if STAGING[staging] is not None:
        monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(STAGING[staging]))
    host_idx, dev_idx = placement(kind, layout, page_size, gen)
    check_against_oracle(backend, io, shape(page_size, pool=pool), layout, host_idx, dev_idx)


@pytest.mark.parametrize("staging", ("default", "small"))
@pytest.mark.parametrize("kind", ("runs", "allocator"))
@pytest.mark.parametrize("page_size", (1, 4, 16))
@pytest.mark.parametrize("pool, layout", pool_layouts())
def test_batched_copies_match_oracle(backend, pool, layout, page_size, kind, staging, monkeypatch, gen):
    """The host-side copies as their rows in one batched call a chunk (where a GPU's rule
    sees rows of 1 MiB on average; here every plan), bit for bit."""
    if backend.device.type != "cpu":
        pytest.skip("the GPUs' rule batches only large rows; tests/gpu batches these on a GPU")
    monkeypatch.setattr(staged, "EVERY_SCHEDULE", replace(staged.EVERY_SCHEDULE, batch_row_bytes=0))
    if STAGING[staging] is not None:
        monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(STAGING[staging]))
    host_idx, dev_idx = placement(kind, layout, page_size, gen)
    check_against_oracle(backend, "staged", shape(page_size, pool=pool), layout, host_idx, dev_idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("io", STAGED_IOS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_dtypes_and_head_counts(backend, layout, io, dtype, gen):
    """Every element width; 8 K heads and 1 V head of odd width (the copy widths differ)."""
    host_idx, dev_idx = placement("runs", layout, 4, gen)
    check_against_oracle(backend, io, shape(4, dtype, k_heads=8, k_dim=16, v_heads=1, v_dim=3), layout, host_idx, dev_idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("io", STAGED_IOS)
@pytest.mark.parametrize("pool, layout", pool_layouts(kinds=("MLA",)))
def test_staged_latent_widths(backend, pool, layout, io, dtype, gen):
    """MLA rows of every element width: DeepSeek-V3's 576 elements, and an odd 3 (the copy widths differ)."""
    host_idx, dev_idx = placement("runs", layout, 4, gen)
    for latent_dim in (576, 3):
        check_against_oracle(backend, io, shape(4, dtype, pool, latent_dim=latent_dim), layout, host_idx, dev_idx)


@pytest.mark.parametrize("io", STAGED_IOS)
@pytest.mark.parametrize("pool", ("MHA", "MLA"))
def test_indices_as_engines_pass_them(backend, pool, io, gen):
    """int32, strided views, and device indices on the backend's device."""
    if io not in backend.io_backends:
        pytest.skip(f"backend {backend.name} has no {io} io backend")
    P = 4
    dev = device_pool(pool, 3, PAGES * P, P)
    host = host_pool(dev, layout="page_first_direct", io_backend=io)
    for t in every_tensor(dev, host):
        randomize(t, gen)
    first = device_buffers(dev)[0]
    host_idx = torch.arange(8 * P, 14 * P).to(torch.int32)
    dev_idx = torch.stack((torch.arange(0, 6 * P), torch.zeros(6 * P, dtype=torch.int64)), 1)[:, 0].to(dev.device)
    expected = [bits(first[l][dev_idx]) for l in range(3)]
    host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    for b in first:
        b.zero_()
    for layer in range(3):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)
    host.backend.synchronize()
    for layer in range(3):
        assert torch.equal(bits(first[layer][dev_idx]), expected[layer])
    host.close()


@pytest.mark.parametrize("pool", ("MHA", "MLA"))
def test_unvalidated_bad_index_is_skipped_and_flagged(backend, pool, gen):
    """validate=False: a token outside a pool is left out (the kernel path moves the call), and the next call raises."""
    if "staged" not in backend.io_backends:
        pytest.skip(f"backend {backend.name} has no staged io backend")
    P = 4
    dev = device_pool(pool, 2, PAGES * P, P)
    host = host_pool(dev, layout="page_first_direct", io_backend="staged", validate=False)
    first, host_first = device_buffers(dev)[0], host_buffers(host)[0]
    randomize(first[0], gen)
    host_first.zero_()
    host_idx = torch.arange(2 * P)
    dev_idx = torch.cat((torch.arange(P), torch.arange(P) + 10**6)).to(dev.device)
    host.backup_from_device_per_layer(dev, host_idx, dev_idx, 0)
    host.backend.synchronize()
    assert torch.equal(bits(host_first[0, 0]), bits(first[0][:P].cpu()))
    assert not bits(host_first[1]).any()
    with pytest.raises(RuntimeError, match="outside the pools"):
        host.backup_from_device_per_layer(dev, host_idx[:P], dev_idx[:P], 0)
    host.backup_from_device_per_layer(dev, host_idx[:P], dev_idx[:P], 0)
    host.close()
