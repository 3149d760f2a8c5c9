"""The README's first example: device KV buffers with K and V of different head_dim,
backed up to a page-locked host pool and loaded back into other slots, bit-exact.

Runs on a GPU or, with the cpu backend, on any machine: python3 examples/quickstart.py
"""

import torch

import portable_kv as pk

PAGE = 64
dev = pk.DeviceKVPool(num_layers=4, num_tokens=4096, page_size=PAGE,
                      k_heads=4, k_head_dim=192, v_head_dim=128, dtype=torch.bfloat16)
# or wrap an engine's own buffers: pk.DeviceKVPool.from_buffers(k_buffer, v_buffer, page_size)
host = pk.AsymmetricHostPool(dev, host_to_device_ratio=2.0,
                             layout="page_first_direct", io_backend="kernel")


def token_slots(pages: list[int]) -> torch.Tensor:
    """Every token of whole pages: page_first_direct moves whole pages."""
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


for buffer in dev.k_buffer + dev.v_buffer:   # random bit patterns (some are NaN: compare bits)
    buffer.view(torch.int16).copy_(torch.randint(-2**15, 2**15, buffer.shape, dtype=torch.int16))

device_indices = token_slots([3, 17, 5, 40])
host_indices = token_slots([0, 1, 2, 7])
host.backup_from_device_all_layer(dev, host_indices, device_indices)      # D2H, all layers

other_slots = token_slots([60, 61, 62, 63])
for layer in range(dev.layer_num):
    host.load_to_device_per_layer(dev, host_indices, other_slots, layer)   # H2D, one layer
flat = host.get_data_page(int(host_indices[0]))                           # one page for an L3 tier

# Transfers are asynchronous on the current stream; these reads are ordered after them.
for buffer in dev.k_buffer + dev.v_buffer:
    assert torch.equal(buffer[other_slots].view(torch.int16), buffer[device_indices].view(torch.int16))
moved = 2 * sum(buffer[device_indices].nbytes for buffer in dev.k_buffer + dev.v_buffer)
print(f"backup + load moved {moved} bytes of K and V, bit-exact; a flat page is {flat.nbytes} bytes")
host.close()
