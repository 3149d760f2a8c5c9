"""Property: every backend moves exactly the bytes the CPU oracle moves, on drawn pool kinds, shapes and indices."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from kvspec import KIND_LAYOUTS, bits, device_pool, every_tensor, host_pool, randomize

from portable_kv import backends
from portable_kv.layout import PAGE_LAYOUTS


@st.composite
def transfers(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    pages = draw(st.integers(2, 6))
    kind = draw(st.sampled_from(("MHA", "MLA")))
    shape = dict(kind=kind, layers=draw(st.integers(1, 3)), tokens=pages * page_size, page_size=page_size,
                 dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])))
    if kind == "MLA":
        shape.update(latent_dim=draw(st.sampled_from([1, 3, 40, 576])))
    else:
        shape.update(k_heads=draw(st.integers(1, 4)), k_dim=draw(st.sampled_from([1, 3, 8, 24])),
                     v_heads=draw(st.integers(1, 4)), v_dim=draw(st.sampled_from([1, 2, 8, 16])))
    layout = draw(st.sampled_from(KIND_LAYOUTS[kind]))
    host_pages = pages * 2
    n_pages = draw(st.integers(1, pages))
    if layout in PAGE_LAYOUTS:
        dev_pages = draw(st.permutations(range(pages)))[:n_pages]
        h_pages = draw(st.permutations(range(host_pages)))[:n_pages]
        offsets = torch.arange(page_size)
        dev_idx = (torch.tensor(dev_pages)[:, None] * page_size + offsets).reshape(-1)
        host_idx = (torch.tensor(h_pages)[:, None] * page_size + offsets).reshape(-1)
    else:
        n = draw(st.integers(1, pages * page_size))
        dev_idx = torch.tensor(draw(st.permutations(range(pages * page_size)))[:n])
        host_idx = torch.tensor(draw(st.permutations(range(host_pages * page_size)))[:n])
    op = draw(st.sampled_from(["load_layer", "load_all", "backup_layer", "backup_all"]))
    layer = draw(st.integers(0, shape["layers"] - 1))
    return shape, layout, host_idx, dev_idx, op, layer, draw(st.integers(0, 2**31))


def run(backend_name, io, shape, layout, host_idx, dev_idx, op, layer, seed):
    before = backends.current().name
    backends.use(backend_name)
    try:
        gen = torch.Generator().manual_seed(seed)
        dev = device_pool(**shape)
        host = host_pool(dev, host_to_device_ratio=2.0, layout=layout, io_backend=io)
        for t in every_tensor(dev, host):
            randomize(t, gen)
        dev_idx = dev_idx.to(dev.device)
        if op == "load_layer":
            host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)
        elif op == "load_all":
            host.load_to_device_all_layer(dev, host_idx, dev_idx)
        elif op == "backup_layer":
            host.backup_from_device_per_layer(dev, host_idx, dev_idx, layer)
        else:
            host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        host.backend.synchronize()
        return [bits(t) for t in every_tensor(dev, host)]
    finally:
        backends.use(before)


@given(transfers())
def test_every_backend_matches_cpu_oracle(case):
    expected = run("cpu", "kernel", *case)
    for name in backends.available():
        for io in backends.get(name).io_backends:
            if (name, io) == ("cpu", "kernel"):
                continue
            got = run(name, io, *case)
            for n, (a, b) in enumerate(zip(got, expected)):
                assert torch.equal(a, b), f"backend {name}/{io} differs from the oracle in buffer {n}"
