"""`auto` on ROCm, on the fake HIP runtime: what it sends where.

A transfer off the caller's critical path goes to the copy engines (SDMA on AMD), as on
NVIDIA; up to ROCm 7.2 hipMemcpyBatchAsync runs its descriptors as single copies inside
the runtime, so direct's host time there is a copy a merged run, not measured on MI300.
Other transfers take the paths of auto's rule, where a small one is one kernel launch."""

from __future__ import annotations

import torch

import portable_kv as pk

P = 64


def page_tokens(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * P + torch.arange(P)).reshape(-1)


def test_background_transfers_go_to_the_sdma_engines_and_others_by_the_rule(fake_rocm_bound):
    backend, lib = fake_rocm_bound
    dev = pk.DeviceKVPool(2, 16 * P, P, 8, 128, 128, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="auto")
    host_idx, dev_idx = page_tokens([3, 7, 1]), page_tokens([2, 9, 5])
    background = host.prepare(dev, host_idx, dev_idx, background=True)
    background.load(0)
    background.backup()
    paths = host.stats()["paths"]["auto"]
    assert set(paths) == {"direct"} and "critical path" in paths["direct"]["reason"] and paths["direct"]["calls"] == 2
    names = [name for name, _ in lib.calls]
    assert "hipModuleLaunchKernel" not in names
    # Three pages of K and V, 128 KiB each in one layer; the backup's two layers: every
    # merged run one descriptor of the runtime's batched call.
    copies = [name for name in names if name.startswith("hipMemcpy")]
    assert copies and set(copies) <= {"hipMemcpyBatchAsync", "hipMemcpyAsync"}
    lib.calls.clear()
    host.prepare(dev, host_idx, dev_idx).load(1)  # 1.5 MB on the critical path: one kernel launch
    assert [name for name, _ in lib.calls if name.startswith(("hipModule", "hipMemcpy"))] == ["hipModuleLaunchKernel"]
    assert host.stats()["paths"]["auto"]["kernel"]["calls"] == 1
    host.close()
