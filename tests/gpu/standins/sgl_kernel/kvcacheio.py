"""The KV-cache copy ops SGLang's own host pools bind at import where CUDA is present.

SGLang's MHA, MLA, DSA, Mamba and unified host-pool modules import these by name; with
portable_kv's pools installed none of them is called.
"""

from __future__ import annotations

from . import _standin

_NAMES = (
    "transfer_embedding_ranges_direct",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)
globals().update({name: _standin(name) for name in _NAMES})
__all__ = list(_NAMES)
