"""Bad input is refused before any byte moves: the right error, naming the argument, both pools unchanged."""

from __future__ import annotations

import pytest
import torch
from kvspec import (
    BUFFERS,
    assert_same,
    bits,
    device_pool,
    every_tensor,
    host_buffers,
    host_pool,
    host_row,
    kind_of,
    page_tokens,
    pool_layout_pairs,
    randomize,
    sglang_host_pool,
    snapshot,
)

import portable_kv as pk

P = 4
GEOMETRY = dict(k_heads=2, k_dim=8, v_heads=1, v_dim=4, latent_dim=12)


@pytest.fixture(params=pool_layout_pairs())
def pools(request, backend, gen):
    kind, layout = request.param
    dev = device_pool(kind, 2, 32, P, torch.float16, **GEOMETRY)
    host = sglang_host_pool(dev, layout=layout, io_backend=backend.io_backends[0])  # alloc() hands out slots
    for t in every_tensor(dev, host):
        randomize(t, gen)
    return dev, host


def ok_indices():
    return page_tokens(torch.tensor([1, 3]), P), page_tokens(torch.tensor([0, 2]), P)


def rejected(dev, host, error, match, call):
    before = snapshot(dev, host)
    with pytest.raises(error, match=match):
        call()
    host.backend.synchronize()
    assert_same(before, snapshot(dev, host))


CASES = {
    "length": (ValueError, "device_indices.*length", lambda h, d: (h, d[:-P])),
    "dtype": (TypeError, "host_indices.*int64 or int32", lambda h, d: (h.float(), d)),
    "not a tensor": (TypeError, "host_indices.*torch.Tensor", lambda h, d: (h.tolist(), d)),
    "2-D": (ValueError, "device_indices.*1-D", lambda h, d: (h, d.view(2, -1))),
    "host range": (ValueError, "host_indices.*< 64", lambda h, d: (h + 60, d)),
    "device range": (ValueError, "device_indices.*< 32", lambda h, d: (h, d + 28)),
    "negative": (ValueError, "host_indices.*>= 0", lambda h, d: (h - 5, d)),
    "duplicate destination": (ValueError, "device_indices.*distinct", lambda h, d: (torch.cat((h, h + 16)), torch.cat((d, d)))),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_indices_rejected_on_load(pools, case):
    dev, host = pools
    error, match, mangle = CASES[case]
    h, d = mangle(*ok_indices())
    rejected(dev, host, error, match, lambda: host.load_to_device_per_layer(dev, h, d, 0))


def test_duplicate_host_slots_rejected_on_backup(pools):
    dev, host = pools
    h, d = ok_indices()
    rejected(dev, host, ValueError, "host_indices.*distinct", lambda: host.backup_from_device_all_layer(dev, torch.cat((h, h)), torch.cat((d, d + 16))))


@pytest.mark.parametrize("layer_id,error", [(2, ValueError), (-1, ValueError), (True, TypeError), (1.0, TypeError)])
def test_bad_layer_id(pools, layer_id, error):
    dev, host = pools
    rejected(dev, host, error, "layer_id", lambda: host.backup_from_device_per_layer(dev, *ok_indices(), layer_id))


def test_page_layouts_need_whole_pages(pools):
    dev, host = pools
    h, d = ok_indices()
    if host.layout not in ("page_first_direct", "page_head"):
        host.load_to_device_per_layer(dev, h[1:], d[1:], 0)  # token layouts accept partial pages
        return
    rejected(dev, host, ValueError, "host_indices.*divisible by page_size", lambda: host.load_to_device_per_layer(dev, h[1:], d[1:], 0))
    rejected(dev, host, ValueError, "host_indices.*start at a multiple", lambda: host.load_to_device_per_layer(dev, h + 1, d, 0))
    shuffled = d.clone()
    shuffled[[1, 2]] = shuffled[[2, 1]]  # right start, wrong order inside the page
    rejected(dev, host, ValueError, "device_indices.*consecutive", lambda: host.load_to_device_per_layer(dev, h, shuffled, 0))


def test_mismatched_device_pool(pools):
    dev, host = pools
    kind = kind_of(dev)
    other = device_pool(kind, 2, 32, P, torch.float16, **{**GEOMETRY, "v_dim": 8, "latent_dim": 16})
    rejected(dev, host, ValueError, "device_pool.*V 1x4" if kind == "MHA" else "device_pool.*latent 1x12", lambda: host.load_to_device_all_layer(other, *ok_indices()))
    wrong_dtype = device_pool(kind, 2, 32, P, torch.bfloat16, **GEOMETRY)
    rejected(dev, host, TypeError, "device_pool.*float16", lambda: host.load_to_device_all_layer(wrong_dtype, *ok_indices()))
    rejected(dev, host, TypeError, f"device_pool.*{BUFFERS[kind][0]}", lambda: host.load_to_device_all_layer(object(), *ok_indices()))
    other_kind = device_pool("MLA" if kind == "MHA" else "MHA", 2, 32, P, torch.float16, **GEOMETRY)
    rejected(dev, host, TypeError, f"device_pool.*{BUFFERS[kind][0]}", lambda: host.load_to_device_all_layer(other_kind, *ok_indices()))


def test_unknown_names(pools, backend):
    dev, host = pools
    rejected(dev, host, ValueError, "io_backend.*kernel, direct", lambda: host.load_to_device_all_layer(dev, *ok_indices(), io_backend="dma"))
    with pytest.raises(ValueError, match="layout.*page_first_direct"):
        host_pool(dev, layout="page_last")
    with pytest.raises(ValueError, match="backend"):
        pk.backends.use("tpu")


def test_flat_page_checks(pools):
    dev, host = pools
    flat = host.get_data_page(0)
    rejected(dev, host, ValueError, "data_page.*1-D tensor of", lambda: host.set_from_flat_data_page(0, flat[:-1]))
    rejected(dev, host, TypeError, "data_page.*float16", lambda: host.set_from_flat_data_page(0, flat.float()))
    rejected(dev, host, ValueError, "index.*first token of a page", lambda: host.set_from_flat_data_page(1, flat))
    rejected(dev, host, ValueError, "index.*first token of a page", lambda: host.get_data_page(host.size))


def test_closed_pool(pools):
    dev, host = pools
    with host:
        pass
    with pytest.raises(ValueError, match="closed"):
        host.load_to_device_all_layer(dev, *ok_indices())
    with pytest.raises(ValueError, match="closed"):
        host.get_data_page(0)


def test_size_rounds_up_to_pages(backend):
    dev = pk.DeviceKVPool(1, 32, P, 1, 8, 8, dtype=torch.float16)
    host = pk.AsymmetricHostPool(dev, host_to_device_ratio=1.1, layout="page_first_direct", io_backend=backend.io_backends[0])
    assert host.size == 36 and host.page_num == 9
    assert tuple(host.k_buffer.shape) == (9, 1, P, 1, 8)
    sized = pk.AsymmetricHostPool(dev, host_size_gb=1e-6, layout="layer_first", io_backend=backend.io_backends[0])
    assert sized.size == 32 and sized.size * (8 + 8) * 2 <= 1000 + P * 32  # 1 kB of K+V, rounded up to a page


def test_too_large_pool_refused_before_allocation(backend):
    dev = pk.DeviceKVPool(1, 32, P, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(MemoryError, match="requested.*available"):
        pk.AsymmetricHostPool(dev, host_size_gb=10**6, io_backend=backend.io_backends[0])


def test_swapped_layer_buffer_is_checked_and_used_when_that_layer_moves(pools, backend):
    """Engines may swap a per-layer buffer in their list; the host pool's cached binding must follow."""
    dev, host = pools
    h, d = ok_indices()
    d = d.to(dev.device)
    host.load_to_device_per_layer(dev, h, d, 0)
    name = BUFFERS[kind_of(dev)][0]
    engine_list = getattr(dev, name)
    old = engine_list[1]
    engine_list[1] = torch.zeros(old.shape[0], old.shape[1], old.shape[2] + 1, dtype=old.dtype, device=old.device)
    host.load_to_device_per_layer(dev, h, d, 0)  # layer 1 does not move: no check needed, none made
    rejected(dev, host, ValueError, rf"device_pool\.{name}\[1\]", lambda: host.load_to_device_per_layer(dev, h, d, 1))
    rejected(dev, host, ValueError, rf"device_pool\.{name}\[1\]", lambda: host.load_to_device_all_layer(dev, h, d))
    fresh = torch.zeros_like(old)
    engine_list[1] = fresh
    old_bits = bits(old)
    host.load_to_device_per_layer(dev, h, d, 1)
    backend.synchronize()
    expected = torch.stack([host_row(host_buffers(host)[0], host.layout, P, t, 1) for t in h.tolist()])
    assert torch.equal(bits(fresh[d]), bits(expected)), "the load did not land in the swapped-in buffer"
    assert torch.equal(bits(old), old_bits), "the load wrote into the buffer that was swapped out"


def test_indices_changed_in_place_are_checked_again(pools):
    dev, host = pools
    h, d = ok_indices()
    host.load_to_device_per_layer(dev, h, d, 0)
    h += 60  # the same tensor object, now out of range
    rejected(dev, host, ValueError, "host_indices.*< 64", lambda: host.load_to_device_per_layer(dev, h, d, 1))


def validations(monkeypatch) -> list:
    """Every index pair the pools validate from now on."""
    from portable_kv.validation import IndexValidator

    made, pair = [], IndexValidator.pair
    monkeypatch.setattr(IndexValidator, "pair", lambda self, *args: made.append(args) or pair(self, *args))
    return made


def test_interleaved_index_sets_are_validated_once(pools, monkeypatch):
    """A load of one page set interleaved with a backup of another: each set is checked once, not per call."""
    dev, host = pools
    load, backup = ok_indices(), (page_tokens(torch.tensor([5, 6]), P), page_tokens(torch.tensor([4, 5]), P))
    made = validations(monkeypatch)
    for layer in (0, 1, 0, 1):
        host.load_to_device_per_layer(dev, *load, layer)
        host.backup_from_device_per_layer(dev, *backup, layer)
    assert len(made) == 2  # each of the two sets, once
    backup[0][0] = 70  # changed in place: checked again, and refused
    rejected(dev, host, ValueError, "host_indices.*< 64", lambda: host.backup_from_device_per_layer(dev, *backup, 0))


def test_indices_made_under_inference_mode_move_and_are_checked_again(pools, backend):
    """vLLM's model runner (and SGLang with SGLANG_ENABLE_TORCH_INFERENCE_MODE=1) make index tensors
    under torch.inference_mode(): they have no version counter, and are still valid indices."""
    dev, host = pools
    with torch.inference_mode():
        h, d = ok_indices()
        slots = host.alloc(2 * P)
    host.backup_from_device_all_layer(dev, slots, d.to(dev.device))
    host.load_to_device_per_layer(dev, h, d, 0)
    host.load_to_device_per_layer(dev, h, d, 1)
    backend.synchronize()
    name = BUFFERS[kind_of(dev)][0]
    for layer in (0, 1):
        expected = torch.stack([host_row(host_buffers(host)[0], host.layout, P, t, layer) for t in h.tolist()])
        assert torch.equal(bits(getattr(dev, name)[layer][d]), bits(expected))
    with torch.inference_mode():
        h += 60  # in place, no version counter moves: the snapshot notices
    rejected(dev, host, ValueError, "host_indices.*< 64", lambda: host.load_to_device_per_layer(dev, h, d, 1))


def test_sparse_indices_refused_by_name(pools):
    dev, host = pools
    h, d = ok_indices()
    rejected(dev, host, TypeError, "host_indices.*dense", lambda: host.load_to_device_per_layer(dev, h.to_sparse(), d, 0))


def test_a_submissions_indices_are_the_pools_copies_validated_once(pools, backend, monkeypatch):
    """SGLang's transfer engine calls prepare_transfer_indices once per submission and passes what
    it returns to every call of it: the pool's own copies, validated once, found again with no
    comparison of values (in inference mode too), unmoved by later writes to the caller's tensors."""
    dev, host = pools
    with torch.inference_mode():
        h, d = ok_indices()
    made = validations(monkeypatch)
    sub_h, sub_d = host.prepare_transfer_indices(h, d.to(dev.device), "kernel")
    assert sub_h is not h and sub_h.dtype == torch.int64 and torch.equal(sub_h, h)
    with torch.inference_mode():
        h += 60  # the caller's tensor, after the hook: not what the submission moves
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer_physical(dev, sub_h, sub_d, layer, host.io_backend)
    backend.synchronize()
    assert len(made) == 1
    name = BUFFERS[kind_of(dev)][0]
    for layer in range(dev.layer_num):
        expected = torch.stack([host_row(host_buffers(host)[0], host.layout, P, t, layer) for t in sub_h.tolist()])
        assert torch.equal(bits(getattr(dev, name)[layer][sub_d.cpu()]), bits(expected))


def test_a_submissions_bad_indices_are_refused_by_name(pools):
    dev, host = pools
    h, d = ok_indices()
    with pytest.raises(TypeError, match="host_indices"):
        host.prepare_transfer_indices(h.float(), d, "kernel")
    sub_h, sub_d = host.prepare_transfer_indices(h + 60, d, "kernel")
    rejected(dev, host, ValueError, "host_indices.*< 64", lambda: host.load_to_device_per_layer_physical(dev, sub_h, sub_d, 0, "kernel"))
