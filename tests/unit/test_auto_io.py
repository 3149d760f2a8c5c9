"""The auto io path's rule on the cpu backend, where every path it picks runs (the staged path
as a model that stages whatever staging carries): which path a transfer takes and why, as
host.stats() records it, and that what it moved is right.  The GPUs' staging rule is
configured on the pool's auto mover where a test needs it: the CPU has no link to scale it to."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kvspec import bits, host_row, page_tokens, randomize

import portable_kv as pk
from portable_kv.backends import cpu
from portable_kv.io import auto
from portable_kv.io.staging_schedule import LINK_RULE, StagingRule
from portable_kv.io.streams import InlineStreams
from portable_kv.transfer import BadIndexFlag, Transfer, tensor_pair
from portable_kv.validation import IndexValidator

P = 4
# What the cpu backend's auto records for each path it hands a transfer to: its kernel path is torch indexing.
RECORDED = {"kernel": "indexing", "bulk": "bulk", "direct": "direct", "staged": "staged"}


@pytest.fixture
def without_bulk(monkeypatch):
    """The cpu backend as one without the bulk path (NVIDIA before sm_90)."""
    monkeypatch.setattr(cpu.CpuBackend, "offers_bulk", property(lambda self: False))


def taken(host, call, *args, **kwargs) -> dict[str, str]:
    """The paths auto took during `call(*args, **kwargs)`, each with its latest reason."""
    before = host.stats()["paths"].get("auto", {})
    call(*args, **kwargs)
    after = host.stats()["paths"].get("auto", {})
    return {path: entry["reason"] for path, entry in after.items() if entry["calls"] > before.get(path, {"calls": 0})["calls"]}


def scaled_rule(host, **fields) -> None:
    """The link rule scaled to this pool's 192-byte K rows (4 pages a copy): a GPU-only rule on the CPU."""
    host._io_context.mover("auto").rule = replace(LINK_RULE, min_row_bytes=128, min_copy_bytes=4 * P * 2 * 24 * 2, **fields)


# The last column: where the backend offers the bulk path, which takes every transfer that
# direct's few long copies do not.
@pytest.mark.parametrize("layout,host_pages,device_pages,chosen,beside_bulk", [
    ("layer_first", range(0, 32), range(0, 32), "direct", "direct"),  # runs on both sides: straight copy engines
    ("page_first_direct", range(0, 32), range(0, 32), "staged", "bulk"),  # its pages are apart on the host: direct copies one each
    ("page_first_direct", range(0, 32), list(range(31, -1, -1)), "staged", "bulk"),  # a run on the host, scattered on the device
    ("page_first_direct", list(range(0, 64, 2)), range(0, 32), "kernel", "bulk"),  # single pages on the host: short copies
])
@pytest.mark.parametrize("bulk", [False, True])
def test_auto_picks_by_the_plan(cpu_backend, monkeypatch, layout, host_pages, device_pages, chosen, beside_bulk, bulk):
    if bulk:
        chosen = beside_bulk
    else:
        monkeypatch.setattr(cpu.CpuBackend, "offers_bulk", property(lambda self: False))
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout=layout, io_backend="auto")
    gen = torch.Generator().manual_seed(2)
    for t in dev.k_buffer + dev.v_buffer:
        randomize(t, gen)
    scaled_rule(host)
    monkeypatch.setattr(auto, "DIRECT_MIN_COPY_BYTES", 4 * P * 2 * 24 * 2)
    host_idx, dev_idx = page_tokens(torch.tensor(list(host_pages)), P), page_tokens(torch.tensor(list(device_pages)), P)
    assert list(taken(host, host.backup_from_device_all_layer, dev, host_idx, dev_idx)) == [RECORDED[chosen]]
    for layer in range(2):
        for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
            assert torch.equal(bits(host_row(host.k_buffer, layout, P, h, layer)), bits(dev.k_buffer[layer][d]))
            assert torch.equal(bits(host_row(host.v_buffer, layout, P, h, layer)), bits(dev.v_buffer[layer][d]))
    assert host.stats()["backup"]["auto"]["calls"] == 1
    host.close()


def test_auto_stages_only_the_transfers_its_rule_allows(cpu_backend, without_bulk, monkeypatch):
    """The GPUs' rule stages backups, and loads only where their copies are batched
    (measured: staged loads as 2-D copies did not beat the kernel path; batched ones and
    staged backups did)."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    assert LINK_RULE.auto_stages(False, False) and LINK_RULE.auto_stages(True, True) and not LINK_RULE.auto_stages(True, False)
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    # Rows of 192 bytes (a page_first_direct page of one layer): 2-D copies.  A layer_first
    # host's per-layer run is one row of 32 pages: batched, at rows of 1 KiB scaled down.
    for layout, loads in (("page_first_direct", "kernel"), ("layer_first", "staged")):
        host = pk.AsymmetricHostPool(dev, layout=layout, io_backend="auto")
        scaled_rule(host, batch_row_bytes=1024)
        assert list(taken(host, host.backup_from_device_all_layer, dev, idx, idx)) == ["staged"]
        load = taken(host, host.load_to_device_per_layer, dev, idx, idx, 1)
        assert list(load) == [RECORDED[loads]], layout
        if loads == "kernel":
            assert "short runs" in load["indexing"]
        host.close()


def test_auto_takes_bulk_where_offered_and_its_plan_carries_the_transfer(cpu_backend, monkeypatch):
    """Beside the model the bulk path costs a few blocks and one launch a call: auto prefers it to
    staging and to the kernel path, and says why; rows not 16-byte aligned go to the kernel path."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    for v_dim, chosen, why in ((16, "bulk", "few blocks"), (3, "indexing", "short runs")):
        dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, v_dim, dtype=torch.bfloat16)
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="auto")
        paths = taken(host, host.backup_from_device_all_layer, dev, page_tokens(torch.arange(32), P), page_tokens(torch.randperm(32), P))
        assert list(paths) == [chosen] and why in paths[chosen], v_dim
        host.close()


class HeldEvents(InlineStreams):
    """A GPU's events, whose completion the test decides."""

    running = False

    def event(self, timing: bool = False) -> object:
        return object()

    @staticmethod
    def record(event: object, stream: None) -> None:
        return None

    def done(self, event: object) -> bool:
        return not self.running


@pytest.mark.parametrize("backup_io", ["auto", "staged"])
def test_auto_loads_through_the_kernel_path_while_a_staged_backup_runs(cpu_backend, without_bulk, monkeypatch, backup_io):
    """A load that auto would stage takes the kernel path while the pool's latest staged
    backup has not completed (its event not done), and stages again once it has; a backup
    the caller staged through io_backend='staged' counts as auto's own (one staged path a pool)."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="auto")
    scaled_rule(host, batch_row_bytes=1024)
    # The CPU's calls complete before they return: the staged mover is given events that do not.
    streams = host._io_context.mover("staged").streams = HeldEvents(lambda: 0)
    assert list(taken(host, host.load_to_device_per_layer, dev, idx, idx, 1)) == ["staged"], "no backup yet"
    streams.running = True
    host.backup_from_device_all_layer(dev, idx, idx, io_backend=backup_io)
    paths = taken(host, host.load_to_device_per_layer, dev, idx, idx, 1)
    assert list(paths) == ["kernel"] and "staged backup" in paths["kernel"], "the backup still runs"
    streams.running = False
    assert list(taken(host, host.load_to_device_per_layer, dev, idx, idx, 1)) == ["staged"], "the backup is done"
    assert torch.equal(bits(dev.k_buffer[1][idx]), bits(host.k_buffer[1][idx]))
    host.close()


def test_a_pool_has_one_bad_index_flag_whichever_path_met_the_bad_index(cpu_backend):
    """validate=False: a token outside the pools skipped on one io path makes the pool's next
    call raise on any other; the call after goes through."""
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="auto", validate=False)
    host.backup_from_device_per_layer(dev, torch.tensor([3, 10_000]), torch.tensor([1, 2]), 0, io_backend="direct")
    with pytest.raises(RuntimeError, match="outside the pools"):
        host.load_to_device_per_layer(dev, torch.tensor([3]), torch.tensor([1]), 0, io_backend="kernel")
    host.load_to_device_per_layer(dev, torch.tensor([3]), torch.tensor([1]), 0, io_backend="staged")
    assert host.stats()["last_error"].startswith("RuntimeError: portable_kv: an earlier transfer met token indices outside the pools")
    host.close()


def test_indices_the_pool_may_not_read_stay_unread_and_auto_takes_the_kernel_path(monkeypatch):
    """A pool that must not read GPU-resident indices on the host (SGLang's kernel io passes
    both on the GPU, its load stream held behind the model's) validates what is on the CPU,
    reads nothing else, and `auto` then takes the kernel path, the one that plans nothing
    from their values.  Meta tensors stand in for GPU-resident ones: reading one fails."""
    validator = IndexValidator(host_tokens=64, page_size=4, layout="layer_first", validate=True)
    on_gpu = torch.arange(8, device="meta")
    with pytest.raises(NotImplementedError):
        validator.pair(on_gpu, on_gpu, 64)  # read on the host: what the pool asked not to do
    validator.read_gpu_indices = False
    for host_idx, dev_idx in ((on_gpu, on_gpu), (torch.arange(8), on_gpu), (on_gpu, torch.arange(8))):
        pair = validator.pair(host_idx, dev_idx, 64)
        assert pair.host_readable is False
        validator.check_direction(pair, True)
        validator.check_direction(pair, False)
    with pytest.raises(ValueError, match="host_indices"):
        validator.pair(torch.arange(60, 68), on_gpu, 64)  # CPU-resident ones are still checked
    with pytest.raises(ValueError, match="device_indices"):
        validator.pair(on_gpu, torch.arange(60, 68), 64)
    with pytest.raises(ValueError, match="device_indices: expected distinct"):
        validator.check_direction(validator.pair(on_gpu, torch.zeros(8, dtype=torch.int64), 64), True)
    assert validator.pair(torch.arange(8), torch.arange(8), 64).host_readable is True

    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    host = torch.empty(2, 64, 2, 24, dtype=torch.bfloat16)
    device = [torch.empty(64, 2, 24, dtype=torch.bfloat16) for _ in range(2)]
    transfer = Transfer(True, (tensor_pair(host, device, "layer_first", 4),), validator.pair(on_gpu, on_gpu, 64), range(1), 4,
                        BadIndexFlag(torch.device("cpu")))
    rule = auto.AutoMover({}, StagingRule(0, 0))  # no path to plan with: the rule must answer from the pair alone
    assert rule.choice(transfer) == ("kernel", "indices the pool does not read on the host")
