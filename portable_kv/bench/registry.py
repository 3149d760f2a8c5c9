"""The benchmark's sections: the one place a section is registered.

A section is a name, a line for `--help`, the function that measures it and, where the
default table does not fit its rows, the functions that render them.  Functions are
named "module:function" within this package and imported only when a run needs them,
so that `portable-kv --help` imports no torch.  A section's function takes a
`context.Context` and returns its rows (`rows.Row`); the ceiling's rows come first in
every run, measured by run.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    about: str  # one line for --help
    measure: str  # "module:function": Context -> list[Row]
    table: str = ""  # "module:function": (rows, meta) -> str, the terminal table; "" the default
    markdown: str = ""  # "module:function": (rows, meta) -> str, the --markdown summary; "" the default


SECTIONS: dict[str, Section] = {
    "all": Section("the ceiling, the peers, every backend x layout x io backend, the MLA rows, and on a GPU the setting sweeps, "
                   "both ways and interference", "run:every_path"),
    "host-cost": Section("the caller's time in one per-layer load per io backend, small and large: per call, SGLang's hook, prepared, eight "
                         "index sets in turn, beside SGLang's JIT kernel and a one-element torch op", "host_cost:measure"),
    "both-ways": Section("a load and a backup at once, each direction timed over its own span, for bulk copies and the package's "
                         "paths (GPU)", "run:both_ways"),
    "staged": Section("every io path beside kernel, direct and the peers (SGLang's JIT kernels where SGLang is installed), host "
                      "pages placed by the allocator after churn and at random; the MLA rows too", "staged:measure"),
    "engine": Section("a cache-hit prefill of MiMo-V2-Flash as SGLang runs it (per-layer loads beside the forward's matmuls) per "
                      "io path, against the forward alone, the loads alone, recomputing and its bound; MiMo's own geometry and "
                      "the first --page-size", "engine:measure", table="engine_report:table", markdown="engine_report:markdown"),
    "state": Section("a Qwen3-Next request's recurrent state (36 Gated DeltaNet layers, 75 MiB a request) loaded per layer and "
                     "backed up through the state pools SGLang's Mamba host tier gets, per io path, beside SGLang's JIT Mamba kernels",
                     "state:measure"),
    "vllm": Section("stores and loads of vLLM 0.33.0's KV blocks (Llama-3-8B, DeepSeek-V3; per-layer and cross-layer tensors; 1 and 16 "
                    "blocks a chunk) through the vLLM spec's host tier per io path, beside vLLM's batched memcpy and Triton swap kernel",
                    "vllm:measure"),
    "decode": Section("a memory-bound bf16 decode step (Llama-3-8B's shape, batch 64 x 4K and 16 x 2K context) with the host tier's "
                      "loads and backups of other pages issued beside it on a side stream, per io path and beside torch's copy_ per page "
                      "and SGLang's JIT kernel: the step's p50 and p99 against the step alone, the host tier's GB/s",
                      "decode:measure", table="decode:table", markdown="decode:markdown"),
    "vllm-prefill": Section("a vLLM 0.33.0 cache-hit prefill (Llama-3-8B, DeepSeek-V3's TP8 share; 4K-32K hit + 512 new tokens): the whole "
                            "hit loaded then the forward (OffloadingConnector) against layer-wise loads beside it "
                            "(PortableKVLayerwiseConnector), per io path, as ms and x of max(forward, loads at the ceiling)",
                            "vllm_prefill:measure"),
}
