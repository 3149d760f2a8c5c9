"""What a new user trips on: pools built under inference mode, pages that require grad,
pages without data, device pools the constructor would refuse, and a device that cannot hold
the pool or does not exist; each refused (or served) as docs/API.md says."""

from __future__ import annotations

import pytest
import torch

import portable_kv as pk
from portable_kv import storage
from portable_kv.testing import page_tokens, randomize

LAYERS, TOKENS, PAGE = 2, 64, 16


def small_device_pool(kind: str = "MHA") -> pk.DeviceKVPool | pk.MLADevicePool:
    if kind == "MLA":
        return pk.MLADevicePool(LAYERS, TOKENS, PAGE, 24, dtype=torch.float32)
    return pk.DeviceKVPool(LAYERS, TOKENS, PAGE, 2, 8, 4, dtype=torch.float32)


def host_pool(dev, layout: str) -> pk.AsymmetricHostPool | pk.MLAHostPool:
    cls = pk.MLAHostPool if dev.kind.name == "MLA" else pk.AsymmetricHostPool
    return cls(dev, layout=layout, io_backend="kernel")


POOL_LAYOUTS = [("MHA", layout) for layout in pk.LAYOUTS] + [("MLA", layout) for layout in pk.MLAHostPool.layouts]


@pytest.mark.parametrize("kind, layout", POOL_LAYOUTS)
def test_a_pool_built_in_inference_mode_takes_pages_outside_it(kind, layout):
    with torch.inference_mode():
        dev = small_device_pool(kind)
        host = host_pool(dev, layout)
    with host:
        device_buffers = [t for name in dev.kind.buffers for t in getattr(dev, name)]
        assert not any(t.is_inference() for t in (*host.buffers, *device_buffers))
        page = randomize(host.get_dummy_flat_data_page(), torch.Generator().manual_seed(0))
        host.set_from_flat_data_page(PAGE, page)
        assert torch.equal(host.get_data_page(PAGE).view(torch.int32), page.view(torch.int32))
        for buffer in device_buffers:
            buffer.add_(1)  # an engine's own in-place write, outside inference mode


@pytest.mark.parametrize("layout", pk.LAYOUTS)
def test_a_local_store_over_a_pool_built_in_inference_mode_gets_pages_outside_it(tmp_path, layout):
    with torch.inference_mode():
        host = host_pool(small_device_pool(), layout)
        store = storage.LocalStore(host, tmp_path)
    with host, store:
        for buffer in host.buffers:
            randomize(buffer, torch.Generator().manual_seed(1))
        before = host.get_data_page(0)
        assert store.put(["page"], page_tokens(torch.tensor([0]), PAGE)) == [True]
        assert store.get(["page"], page_tokens(torch.tensor([2]), PAGE)) == [True]
        assert torch.equal(host.get_data_page(2 * PAGE).view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_a_page_that_requires_grad_leaves_no_autograd_history_in_the_pool(kind):
    with host_pool(small_device_pool(kind), "page_first_direct") as host:
        page = torch.randn(host.flat_page_numel, requires_grad=True)
        host.set_from_flat_data_page(0, page)
        assert all(b.grad_fn is None and not b.requires_grad for b in host.buffers)
        read = host.get_data_page(0)
        assert not read.requires_grad and torch.equal(read, page.detach())


@pytest.mark.parametrize("make, words", [
    (lambda n: torch.empty(n, device="meta"), "meta device"),
    (lambda n: torch.zeros(n).to_sparse(), r"dense \(strided\)"),
])
def test_a_flat_page_without_dense_data_is_a_type_error_naming_it(make, words):
    with host_pool(small_device_pool(), "page_first") as host:
        with pytest.raises(TypeError, match=rf"^data_page: .*{words}"):
            host.set_from_flat_data_page(0, make(host.flat_page_numel))


def test_a_meta_page_index_is_a_type_error_naming_it():
    with host_pool(small_device_pool(), "page_first") as host, pytest.raises(TypeError, match="^index: .*meta"):
        host.get_data_page(torch.tensor(0, device="meta"))


def test_the_dummy_page_of_a_closed_pool_raises_like_every_page_call():
    host = host_pool(small_device_pool(), "page_first_direct")
    host.close()
    with pytest.raises(ValueError, match="the pool is closed"):
        host.get_data_page(0)
    with pytest.raises(ValueError, match="the pool is closed"):
        host.get_dummy_flat_data_page()


def test_from_buffers_refuses_a_page_size_the_constructor_refuses():
    with pytest.raises(ValueError, match="^num_tokens: expected a multiple of page_size=24"):
        pk.DeviceKVPool(1, 256, 24, 2, 8, 8, dtype=torch.float16)
    k, v = [torch.zeros(256, 2, 8, dtype=torch.float16)], [torch.zeros(256, 2, 8, dtype=torch.float16)]
    with pytest.raises(ValueError, match="^page_size: expected a divisor of the buffers' 256 tokens"):
        pk.DeviceKVPool.from_buffers(k, v, 24)
    with pytest.raises(ValueError, match="^page_size: expected a divisor"):
        pk.MLADevicePool.from_buffers([torch.zeros(256, 1, 8)], 24)
    assert pk.DeviceKVPool.from_buffers(k, v, 16).page_size == 16


def test_from_buffers_of_2d_tensors_names_the_real_fault():
    flat = [torch.zeros(256, 384, dtype=torch.float16)]
    with pytest.raises(ValueError, match=r"^device_pool.k_buffer\[0\]: expected a 3-D \(tokens, heads, head_dim\) tensor, got 2-D"):
        pk.DeviceKVPool.from_buffers(flat, flat, 16)


def test_a_dtype_that_differs_between_layers_is_a_type_error():
    k = [torch.zeros(32, 1, 8, dtype=torch.float16), torch.zeros(32, 1, 8, dtype=torch.bfloat16)]
    v = [torch.zeros(32, 1, 8, dtype=torch.float16)] * 2
    with pytest.raises(TypeError, match=r"^device_pool.k_buffer\[1\]: expected dtype torch.float16 like layer 0, got torch.bfloat16"):
        pk.DeviceKVPool.from_buffers(k, v, 16)
    with pytest.raises(TypeError, match="^device_pool: k_buffer and v_buffer must agree in dtype"):
        pk.DeviceKVPool.from_buffers(v, [torch.zeros(32, 1, 8, dtype=torch.bfloat16)] * 2, 16)


def test_a_device_pool_larger_than_the_device_is_refused_before_torch_allocates():
    with pytest.raises(ValueError, match=r"^num_tokens: 4 layers of 1099511627776 tokens need .* GB of cpu memory, more than"):
        pk.DeviceKVPool(4, 2**40, 64, 4, 192, 128, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="^num_tokens: .*more than"):
        pk.MLADevicePool(61, 2**40, 64, 576, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: 'cuda' is a device of this machine")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", torch.device("cuda", 0)])
def test_a_device_this_machine_lacks_is_named_with_what_there_is(device):
    with pytest.raises(ValueError, match=r"^device: 'cuda(:\d)?' is not a device of this machine; available: cpu$"):
        pk.DeviceKVPool(1, 32, 16, 1, 8, 8, device=device)
    with pytest.raises(ValueError, match="^device: "):
        pk.MLADevicePool(1, 32, 16, 8, device=device)


def test_a_device_string_torch_cannot_parse_is_named():
    with pytest.raises(ValueError, match="^device: expected a torch.device or a device string"):
        pk.DeviceKVPool(1, 32, 16, 1, 8, 8, device="gpu0")


@pytest.mark.parametrize("fault", [
    lambda: pk.DeviceKVPool(1, 256, 24, 2, 8, 8, dtype=torch.float16),
    lambda: pk.DeviceKVPool.from_buffers([torch.zeros(256, 2, 8)], [torch.zeros(256, 2, 8)], 24),
    lambda: pk.DeviceKVPool.from_buffers([torch.zeros(256, 384)], [torch.zeros(256, 384)], 16),
    lambda: pk.DeviceKVPool.from_buffers([torch.zeros(32, 1, 8, dtype=torch.float16), torch.zeros(32, 1, 8, dtype=torch.bfloat16)],
                                         [torch.zeros(32, 1, 8, dtype=torch.float16)] * 2, 16),
    lambda: pk.DeviceKVPool(1, 32, 16, 1, 8, 8, device="gpu0"),
    lambda: pk.DeviceKVPool(4, 2**40, 64, 4, 192, 128, device="cpu"),
    lambda: host_pool(small_device_pool(), "page_first").set_from_flat_data_page(0, torch.zeros(1).to_sparse()),
], ids=["page size", "from_buffers page size", "2-D", "layer dtype", "device string", "too large", "sparse page"])
def test_the_api_docs_bad_input_table_quotes_each_message(fault):
    """Each row of docs/API.md's table of bad inputs starts as the error it names does."""
    from pathlib import Path

    api = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()
    with pytest.raises((ValueError, TypeError)) as raised:
        fault()
    opening = str(raised.value).split(" need ")[0][:60]  # the bytes a machine holds differ: quoted up to them
    assert f"`{opening}" in api, f"docs/API.md's bad-input table lacks {opening!r}"
