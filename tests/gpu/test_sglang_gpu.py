"""SGLang 0.5.23's own HybridCacheController moving MiMo-V2-Flash's KV cache on a CUDA GPU through portable_kv host pools.

The stack is tests/sglang/mimokit.py's, built on "cuda" by SGLang's own functions: the hybrid
sliding-window device pools with their MTP draft pools, SGLang's UnifiedRadixCache with HiCache
attached, the host pool group (portable_kv's pools, drafts packed into the SWA pool) and SGLang's
HybridCacheController with its own load and write streams.  Each case runs on the cuda and the
triton backend, for every (io, layout) pair SGLang keeps and each portable_kv io path: SGLang's
`kernel` and `direct`, and `staged` and `auto` through PORTABLE_KV_SGLANG_IO.  Three cycles of
mimokit.run_cycle (insert with write-through, device eviction, load back, host eviction, each
through the tree's own entry points) go through one stack:

1. plain: kernels built, staging allocated, bit-exact from the first cycle on;
2. ordering: SGLang's own test hook (SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES) holds the load stream
   back before every layer while the forward pass runs ahead, a short matmul a layer on the
   model's stream; each layer's rows are read once before the pass waits for the layer (they
   must be stale: the load has not landed) and once after (bit-exact in every full, SWA and draft
   layer, no other device row touched);
3. overlap: no delay and a long matmul loop a layer, so the loads' copies and kernels run beside
   it, and the backup beside one too; bit-exact again, and the matmul's result intact.

Skipped, with the reason, without a CUDA GPU or SGLang.  SGLang's kernel package (`sgl_kernel`)
is stood in for where it is not installed (tests/gpu/standins): portable_kv moves every byte, so
a call into it fails the test.  tools/gpu_round.sh runs this file on its own
(`$OUT/sglang_gpu.txt`); `bash tools/fetch_gpu_wheels.sh --sglang` fetches what it needs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from portable_kv import backends
from portable_kv.io import staged

HERE = Path(__file__).resolve().parent
STANDINS = HERE / "standins"
# mimokit imports only torch at module level; SGLang is imported when a stack is built.
if str(HERE.parent / "sglang") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "sglang"))
from kernelkit import sgl_kernel_or_standin  # noqa: E402
from mimokit import FULL_LAYERS, LAYOUT_IO_CASES, SWA_LAYERS  # noqa: E402

CUDA = torch.cuda.is_available() and torch.version.cuda is not None
SGLANG = importlib.util.find_spec("sglang") is not None
GPU = [n for n in ("cuda", "triton") if backends.unavailable_reason(n) is None and backends.get(n).device.type == "cuda"]
needs_gpu_sglang = pytest.mark.skipif(
    not (CUDA and SGLANG and GPU),
    reason="needs an NVIDIA GPU with a GPU backend, and SGLang (bash tools/fetch_gpu_wheels.sh --sglang; tools/gpu_round.sh)"
    if CUDA and GPU
    else f"needs an NVIDIA GPU backend: {backends.unavailable_reason('cuda')}",
)

# What the tests import of SGLang, checked once before any stack is built.
SGLANG_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.runtime_context",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.swa_memory_pool",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.registry",
    "sglang.srt.managers.tp_worker",
)
# SGLang 0.5.23's wheel bundles its Rust radix-tree core built against the torch it pins (2.14);
# under another release the core misreads tensor dtypes (an int64 index tensor panics as an unknown
# kind), so there the tree takes SGLang's Python core, chosen by SGLang's own setting.
RUST_TREE_CORE_TORCH = (2, 14)

# (portable_kv io path, SGLang's --hicache-io-backend, host layout).  SGLang's own choices map to
# the path of the same name; PORTABLE_KV_SGLANG_IO=staged or auto maps both of them.
IO_CASES = [(io, io, layout) for io, layout in LAYOUT_IO_CASES] + [
    (path, io, layout) for path in ("staged", "auto") for io, layout in LAYOUT_IO_CASES
]

LAYER_DELAY_MS = 20.0  # the load stream's hold before each layer in the ordering cycle
ORDERING_COMPUTE_MS = 2.0  # the forward's matmul a layer there: well inside the hold
OVERLAP_COMPUTE_MS = 10.0  # the forward's matmul a layer in the overlap cycle


@pytest.fixture(scope="module")
def kit():
    """mimokit, once SGLang's modules import on this host (with the stand-in where needed)."""
    which = sgl_kernel_or_standin()
    try:
        for name in SGLANG_MODULES:
            importlib.import_module(name)
    except Exception as exc:
        pytest.skip(f"SGLang's HiCache modules do not import here (sgl_kernel: {which}): {type(exc).__name__}: {exc}")
    return sys.modules["mimokit"]


@pytest.fixture(autouse=True)
def tree_core(monkeypatch):
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) != RUST_TREE_CORE_TORCH:
        monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")


@pytest.fixture(params=GPU or ["none"])
def gpu(request):
    before = backends.current()
    yield backends.use(request.param)
    backends.use(before.name)


class Compute:
    """A bf16 matmul loop on the current stream: the model's forward, as far as the GPU sees it."""

    def __init__(self, n: int = 8192):
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=generator)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=generator)
        self.out = torch.empty_like(self.a)
        self.expected = self.a @ self.b
        self.calls = 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.matmul(self.a, self.b, out=self.out)
        start.record()
        for _ in range(5):
            torch.matmul(self.a, self.b, out=self.out)
        end.record()
        end.synchronize()
        self.ms_each = start.elapsed_time(end) / 5

    def run(self, ms: float) -> None:
        for _ in range(max(1, round(ms / self.ms_each))):
            torch.matmul(self.a, self.b, out=self.out)
        self.calls += 1

    def intact(self) -> bool:
        return torch.equal(self.out, self.expected)


@pytest.fixture(scope="module")
def compute(kit):
    return Compute()


@pytest.fixture(scope="module")
def cycles_per_ms(kit) -> float:
    """GPU clock cycles a millisecond, as torch.cuda._sleep (SGLang's delay hook) counts them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


@contextlib.contextmanager
def forward_pass(stack, compute: Compute, compute_ms: float):
    """Instrument one cycle as a model runner sees it, until the block ends.

    The forward's matmul runs on the test thread's (current) stream before each layer's wait
    (SWAKVPool.get_key_buffer, which waits for the layer's load event), and right after the
    controller issues the write-through backup; each layer's K buffer is copied once before its
    wait; the streams
    SGLang's transfer engine issues the host pools' loads and backups on, and the host time of
    start_loading, are recorded.
    """
    seen = SimpleNamespace(load_streams=set(), backup_streams=set(), before_wait={}, start_loading_s=[])
    buffers = stack.device_buffers()
    forward_thread = threading.get_ident()
    patched = []

    def patch(obj, name, make):
        setattr(obj, name, make(getattr(obj, name)))
        patched.append((obj, name))

    def get_key_buffer(original):
        def wrapped(layer_id, *args, **kwargs):
            if threading.get_ident() == forward_thread and layer_id not in seen.before_wait:
                compute.run(compute_ms)
                kind = "full" if layer_id in FULL_LAYERS else "swa"
                seen.before_wait[layer_id] = buffers[(kind, layer_id, "k")].clone()
            return original(layer_id, *args, **kwargs)

        return wrapped

    def write(original):
        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            compute.run(compute_ms)  # beside the backup on the controller's write stream
            return result

        return wrapped

    def start_loading(original):
        def wrapped(*args, **kwargs):
            began = time.perf_counter()
            result = original(*args, **kwargs)
            seen.start_loading_s.append(time.perf_counter() - began)
            return result

        return wrapped

    def on_stream(streams):
        def make(original):
            def wrapped(*args, **kwargs):
                streams.add(torch.cuda.current_stream().cuda_stream)
                return original(*args, **kwargs)

            return wrapped

        return make

    try:
        patch(stack.kvcache, "get_key_buffer", get_key_buffer)
        patch(stack.controller, "write", write)
        patch(stack.controller, "start_loading", start_loading)
        for pool in stack.host_pools().values():
            patch(pool, "load_to_device_per_layer_physical", on_stream(seen.load_streams))
            patch(pool, "backup_from_device_all_layer_physical", on_stream(seen.backup_streams))
        yield seen
    finally:
        for obj, name in reversed(patched):
            vars(obj).pop(name, None)  # mimokit may have taken its own wrapper off already


def _cycle(kit, stack, seed: int):
    report = kit.run_cycle(stack, seed=seed)  # ends with every device row and host slot given back
    torch.cuda.synchronize()
    return report


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _loaded_rows(report, layer: int) -> torch.Tensor:
    return report.loaded_full if layer in FULL_LAYERS else report.loaded_swa


@needs_gpu_sglang
def test_sglang_takes_its_cuda_paths(kit):
    """SGLang detects CUDA here, so its modules took their CUDA branches (the ones that bind sgl_kernel)."""
    from sglang.srt.utils import is_cuda

    assert is_cuda()
    assert "sgl_kernel" in sys.modules


@needs_gpu_sglang
@pytest.mark.parametrize(("path", "io", "layout"), IO_CASES, ids=[f"{p}-sglang_{io}-{layout}" for p, io, layout in IO_CASES])
def test_controller_streams_and_per_layer_waits_are_bit_exact(kit, gpu, compute, cycles_per_ms, path, io, layout, monkeypatch, tmp_path):
    from portable_kv.engines.sglang import SGLangHostPool

    if path in ("staged", "auto"):
        monkeypatch.setenv("PORTABLE_KV_SGLANG_IO", path)
    else:
        monkeypatch.delenv("PORTABLE_KV_SGLANG_IO", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES", raising=False)
    with kit.build_stack("cuda", layout, io, mtp=True, installed=True, workdir=tmp_path) as stack:
        assert (stack.io, stack.layout) == (io, layout), "SGLang's argument hooks kept the pair"
        pools = stack.host_pools()
        assert {type(pool) for pool in pools.values()} == {SGLangHostPool}
        assert {pool.backend.name for pool in pools.values()} == {gpu.name}
        assert torch.device(stack.kvcache.device).type == "cuda" and all(b.is_cuda for b in stack.device_buffers().values())
        if path == "staged":  # stage these small transfers too (the shipped rule sends them to the kernel path)
            for pool in pools.values():
                pool._mover("staged").rule = staged.EVERY_SCHEDULE
        engine = stack.controller.l2_transfer_engine
        model_stream = torch.cuda.current_stream().cuda_stream

        _cycle(kit, stack, seed=10)

        with forward_pass(stack, compute, ORDERING_COMPUTE_MS) as seen:
            monkeypatch.setenv("SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES", str(int(LAYER_DELAY_MS * cycles_per_ms)))
            report = _cycle(kit, stack, seed=11)
            monkeypatch.delenv("SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES")
        assert seen.load_streams == {engine.host_to_device_stream.cuda_stream} != {model_stream}
        assert seen.backup_streams == {engine.device_to_host_stream.cuda_stream} != {model_stream}
        buffers = stack.device_buffers()
        assert sorted(seen.before_wait) == sorted(FULL_LAYERS + SWA_LAYERS)
        # The staged path plans its copies on the host: SGLang's kernel io passes the device
        # indices on the GPU, and that plan reads them once per index pair, a wait for the load
        # stream (docs/API.md); its loads are still checked bit for bit after each wait.
        plans_on_gpu_indices = path == "staged" and io == "kernel"
        for layer, before in seen.before_wait.items():
            if plans_on_gpu_indices:
                continue
            rows = _loaded_rows(report, layer).to(before.device)
            kind = "full" if layer in FULL_LAYERS else "swa"
            assert not _same_bits(before[rows], buffers[(kind, layer, "k")][rows]), (
                f"layer {layer}: its rows had landed before the forward pass waited for them, with the load stream held "
                f"{LAYER_DELAY_MS:.0f} ms a layer (start_loading took {seen.start_loading_s} s on the host)"
            )

        with forward_pass(stack, compute, OVERLAP_COMPUTE_MS) as seen:
            calls = compute.calls
            report = _cycle(kit, stack, seed=12)
        assert compute.calls - calls == 1 + len(FULL_LAYERS + SWA_LAYERS)
        assert len(report.layer_calls) >= len(FULL_LAYERS + SWA_LAYERS)
        assert compute.intact(), "the matmul beside the transfers computed something else"
        if path == "staged":
            assert {pool._mover("staged").last_path for pool in pools.values()} == {"staged"}
        for pool in pools.values():
            assert path in pool._movers, f"{pool.pool_label}: no {path} transfer"


@needs_gpu_sglang
def test_hicache_file_tier_round_trip_on_the_gpu_is_bit_exact(kit, gpu, tmp_path, monkeypatch):
    """SGLang's HiCacheFile tier below the host pools: backup to files, host copy evicted and wiped,
    prefetch back, per-layer load into CUDA device pools, bit for bit (mimokit.run_file_cycle)."""
    monkeypatch.delenv("PORTABLE_KV_SGLANG_IO", raising=False)
    with kit.build_stack("cuda", "page_first", "kernel", mtp=True, installed=True, workdir=tmp_path, storage=True) as stack:
        assert stack.controller.storage_backend_type == "file"
        report = kit.run_file_cycle(stack)
        torch.cuda.synchronize()
        assert report.tokens == len(report.loaded_full)
        assert any((tmp_path / "hicache").iterdir()), "the pages went to files"


def test_standin_kernels_refuse_and_name_themselves():
    """Every function of the sgl_kernel stand-in raises, naming the kernel SGLang reached for."""
    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_standin_check", STANDINS / "sgl_kernel" / "__init__.py", submodule_search_locations=[str(STANDINS / "sgl_kernel")]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    try:
        spec.loader.exec_module(package)
        names = [(module, name) for module in (package, package.kvcacheio, package.quantization) for name in module._NAMES]
        assert {"moe_sum", "transfer_kv_per_layer", "transfer_kv_direct", "ggml_dequantize"} <= {name for _, name in names}
        for module, name in names:
            with pytest.raises(RuntimeError, match=f"SGLang's own kernel was called: {name}$"):
                getattr(module, name)(torch.empty(1), layer_id=0)
    finally:
        for name in [n for n in sys.modules if n == spec.name or n.startswith(spec.name + ".")]:
            del sys.modules[name]


# -- Mamba state and DSA indexer pools on CUDA tensors -------------------------------------------

STATE_IO = [(path, io, layout) for io, layout in (("direct", "page_first_direct"), ("kernel", "page_first")) for path in (io, "staged", "auto")]


def _random_bytes(buffer: torch.Tensor, generator: torch.Generator) -> None:
    view = buffer.view(torch.uint8)
    view.copy_(torch.randint(0, 256, view.shape, generator=generator, dtype=torch.uint8, device="cpu").to(view.device))


@needs_gpu_sglang
@pytest.mark.parametrize(("path", "io", "layout"), STATE_IO, ids=[f"{p}-sglang_{io}-{layout}" for p, io, layout in STATE_IO])
def test_state_pool_moves_qwen3_next_states_with_a_packed_draft_bit_exactly(kit, gpu, path, io, layout, monkeypatch):
    """Qwen3-Next's per-rank states (TP 2: float32 temporal 16 x 128 x 128, bf16 conv 4096 x 3) of 3 layers and a packed
    MTP draft layer: backup of 4 slots, per-layer loads into others on SGLang's load stream, nothing else touched."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo

    from portable_kv.engines.sglang.mamba import SGLangStateHostPool

    if path != io:
        monkeypatch.setenv("PORTABLE_KV_SGLANG_IO", path)
    generator = torch.Generator().manual_seed(4)

    def states(layers: int) -> MambaStateBufferInfo:
        temporal = torch.empty(layers, 9, 16, 128, 128, dtype=torch.float32, device="cuda")
        conv = torch.empty(layers, 9, 4096, 3, dtype=torch.bfloat16, device="cuda")
        for buffer in (temporal, conv):
            _random_bytes(buffer, generator)
        return MambaStateBufferInfo(temporal=temporal, conv=(conv,))

    target, draft = states(3), states(1)
    pool = SGLangStateHostPool(target, 2.0, 0, device_capacity=8, mtp_draft_buffer_infos=(draft,), layout=layout)
    host, device, to = torch.tensor([3, 9, 11, 2]), torch.tensor([1, 4, 5, 7], device="cuda"), torch.tensor([0, 2, 3, 8], device="cuda")
    layers = [*target.temporal.unbind(0), *target.conv[0].unbind(0), draft.temporal[0], draft.conv[0][0]]
    before = [layer.clone() for layer in layers]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pool.backup_from_device_all_layer(target, host, device, io)
        for layer in range(3):
            pool.load_to_device_per_layer(target, host, to, layer, io)
        pool.load_to_device_per_layer(draft, host, to, 3, io, is_draft=True)
    stream.synchronize()
    for index, (old, new) in enumerate(zip(before, layers)):
        expected = old.clone()
        expected[to] = old[device]
        assert _same_bits(new, expected), f"state layer {index}: loaded slots differ, or a slot outside the load changed"
    flat = pool.get_data_page(9)
    pool.set_from_flat_data_page(12, flat)
    assert _same_bits(pool.get_data_page(12), flat)
    pool.destroy()


@needs_gpu_sglang
@pytest.mark.parametrize(("io", "layout"), [("kernel", "layer_first"), ("kernel", "page_first"), ("direct", "page_first_direct")])
def test_dsa_indexer_pool_moves_fp8_index_keys_with_a_packed_draft_bit_exactly(kit, gpu, io, layout, monkeypatch):
    """DeepSeek-V3.2's DSA device pool on the GPU (fp8 latent rows, index keys with scales, one shared-top-k layer),
    its NextN draft packed: SGLang's DSA group builder makes the latent and indexer pools portable_kv's; backup and
    per-layer loads of two 64-token pages, bit-exact, nothing else touched."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_host_pool_group, prepare_host_pool_config
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    import portable_kv.engines.sglang as pk_sglang
    from portable_kv.engines.sglang.dsa import SGLangDSAIndexerHostPool

    page = 64
    reset_context()
    publish(ServerArgs(model_path="dummy", page_size=page, hicache_ratio=2.0, hicache_mem_layout=layout, hicache_io_backend=io),
            role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    generator = torch.Generator().manual_seed(8)

    def dsa_pool(layers: int, skip=None):
        dev = DSATokenToKVPool(512, page, 32, torch.float8_e4m3fn, 16, layers, "cuda", 128, False, 56, start_layer=0, end_layer=layers,
                               skip_topk_layers=skip)
        for buffer in (*dev.kv_buffer, *dev.index_k_with_scale_buffer):
            if buffer.numel():
                _random_bytes(buffer, generator)
        return dev

    dev, draft = dsa_pool(3, [False, True, False]), dsa_pool(1)
    pk_sglang.install()
    try:
        config = prepare_host_pool_config(decls=dev.host_pool_decls(), full_layer_mapping={i: i for i in range(3)}, transfer_layer_id_max=3,
                                          transfer_page_size=page, packed_draft_device_pools=(draft,))
        group = build_host_pool_group(config=config)
    finally:
        pk_sglang.uninstall()
        reset_context()
    indexer = group.get_pool(PoolName.INDEXER)
    assert type(indexer) is SGLangDSAIndexerHostPool and (indexer.target_layer_num, indexer.layer_num) == (2, 3)
    host = torch.arange(2 * page, 4 * page)
    device = torch.cat([torch.arange(5 * page, 6 * page), torch.arange(page)]).cuda()
    to = torch.arange(7 * page, 9 * page).cuda()
    buffers = [b for b in (*dev.index_k_with_scale_buffer, *draft.index_k_with_scale_buffer) if b.numel()]
    before = [b.clone() for b in buffers]
    indexer.backup_from_device_all_layer(dev, host, device, io)
    for layer in range(3):
        indexer.load_to_device_per_layer(dev, host, to, layer, io)
    indexer.load_to_device_per_layer(draft, host, to, 3, io, is_draft=True)
    torch.cuda.synchronize()
    for index, (old, new) in enumerate(zip(before, buffers)):
        expected = old.clone()
        expected[[7, 8]] = old[[5, 0]]
        assert _same_bits(new, expected), f"index layer {index}: loaded rows differ, or a row outside the load changed"
    group.get_pool(PoolName.KV).destroy()
    indexer.destroy()
