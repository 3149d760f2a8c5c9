"""What the CUDA and ROCm backends share: kernel arguments, launch geometry,
the kernel cache, batched DMA and the error flag.

A vendor backend (cuda.py, rocm.py) adds only its runtime calls: compile,
load, launch, and the batched memcpy entry point.  Both are written as
twins: the same methods, in the same order.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import threading
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..cache import IdentityCache
from ..plan import CopyBatch, TensorPair, Transfer, copy_batch
from .base import Backend, BackendUnavailable, BadIndexFlag

PACKAGE_DIR = Path(__file__).resolve().parent.parent
COMMON_KERNEL_DIR = PACKAGE_DIR / "kernels_common"
KERNEL_WIDTHS = (16, 8, 4, 2, 1)  # bytes per access; one entry point each (kv_copy.h)
BLOCK = 512  # threads per block: PKV_BLOCK in kv_copy.h
UNROLL = 4  # vectors in flight per thread: PKV_UNROLL in kv_copy.h
PREPARED_KEPT = 4  # prepared launches kept per thread (a load and a backup interleaved, and a spare)
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault = hipMemcpyDefault: direction from the addresses
REGISTER_FLAGS = 3  # Portable | Mapped, the same bits for cudaHostRegister and hipHostRegister


class TensorJob(ctypes.Structure):
    """Mirror of PkvTensorJob (kernels_common/kv_copy.h)."""

    _fields_ = [
        ("host_base", ctypes.c_uint64),
        ("device_layers", ctypes.c_uint64),
        ("host_page", ctypes.c_int64),
        ("host_token", ctypes.c_int64),
        ("host_layer", ctypes.c_int64),
        ("host_group", ctypes.c_int64),
        ("device_token", ctypes.c_int64),
        ("device_group", ctypes.c_int64),
        ("host_tokens", ctypes.c_int64),
        ("device_tokens", ctypes.c_int64),
        ("chunk_bytes", ctypes.c_int64),
        ("groups", ctypes.c_int64),
        ("vec_begin", ctypes.c_int64),
    ]


class CopyArgs(ctypes.Structure):
    """Mirror of PkvCopyArgs: the kernel's one by-value parameter."""

    _fields_ = [
        ("job", TensorJob * 2),
        ("host_indices", ctypes.c_uint64),
        ("device_indices", ctypes.c_uint64),
        ("error_flag", ctypes.c_uint64),
        ("tokens", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("layer_begin", ctypes.c_int64),
        ("layers", ctypes.c_int64),
        ("total_vecs", ctypes.c_int64),
        ("to_device", ctypes.c_int64),
    ]


def access_width(*values: int) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) that every address and size is aligned to."""
    common = math.gcd(*values) if values else 16
    return next(w for w in KERNEL_WIDTHS if common % w == 0)


def grid_size(total_vecs: int, block_quota: int) -> int:
    """A persistent grid: no more blocks than the quota, none without work."""
    return max(1, min(block_quota, -(-total_vecs // (BLOCK * UNROLL))))


class LayerTable:
    """Per-layer base addresses of an engine's device buffers, resident on the device."""

    def __init__(self, buffers: Sequence[torch.Tensor], device: torch.device) -> None:
        addresses = [t.data_ptr() for t in buffers]
        self.addresses = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.alignment = math.gcd(*addresses)


def kernel_sources(vendor_file: Path) -> list[Path]:
    return [vendor_file, COMMON_KERNEL_DIR / "kv_copy.h"]


def source_hash(vendor_file: Path) -> str:
    digest = hashlib.sha256()
    for path in kernel_sources(vendor_file):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where compiled kernels are kept: $PORTABLE_KV_CACHE, else the user's cache directory."""
    configured = os.environ.get("PORTABLE_KV_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "portable_kv"


def prebuilt_dirs() -> list[Path]:
    dirs = [PACKAGE_DIR / "prebuilt"]
    if os.environ.get("PORTABLE_KV_PREBUILT"):
        dirs.insert(0, Path(os.environ["PORTABLE_KV_PREBUILT"]))
    return dirs


def code_object_name(vendor_file: Path, arch: str, suffix: str) -> str:
    """File name of a compiled kernel: the source hash and arch decide its content."""
    return f"kv_copy-{source_hash(vendor_file)}.{arch}.{suffix}"


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class JobTemplate:
    """The kernel arguments that depend only on the host pool and the device buffers."""

    def __init__(self, pairs: tuple[TensorPair, TensorPair], tables: list[LayerTable]) -> None:
        self.tables = tables  # keeps the address tables alive while the template is in use
        self.width = access_width(*(_alignment_terms(pair, table) for pair, table in zip(pairs, tables)))
        self.jobs = []
        self.vecs_per_row = []  # vectors per (token, layer)
        for pair, table in zip(pairs, tables):
            s, c = pair.strides, pair.chunks
            self.jobs.append(dict(
                host_base=pair.host.data_ptr(), device_layers=table.addresses.data_ptr(),
                host_page=s.page, host_token=s.token, host_layer=s.layer, host_group=c.host_group,
                device_token=pair.device_token_bytes, device_group=c.device_group,
                host_tokens=s.tokens, device_tokens=pair.device[0].shape[0],
                chunk_bytes=c.chunk_bytes, groups=c.groups,
            ))
            self.vecs_per_row.append(c.groups * c.chunk_bytes // self.width)

    def write(self, args: CopyArgs) -> None:
        for job, fields in zip(args.job, self.jobs):
            for name, value in fields.items():
                setattr(job, name, value)
        args.job[0].vec_begin = 0


class PreparedLaunch:
    """A kernel launch ready to go but for its layer: the struct the kernel takes
    by value (cuLaunchKernel copies it at the call, so it may change after)."""

    def __init__(self, transfer: Transfer, template: JobTemplate, args: CopyArgs, width: int, grid: int, quota: int) -> None:
        self.pairs, self.indices = transfer.pairs, transfer.indices  # keeps the index copies on the device alive
        self.to_device, self.layers, self.quota = transfer.to_device, len(transfer.layers), quota
        self.template, self.args, self.width, self.grid = template, args, width, grid  # template: keeps the layer tables alive
        self._param_array = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.params = ctypes.addressof(self._param_array)
        self.kernel: object = None

    def matches(self, transfer: Transfer, quota: int) -> bool:
        return (self.pairs is transfer.pairs and self.indices is transfer.indices and self.to_device == transfer.to_device
                and self.layers == len(transfer.layers) and self.quota == quota)


class RuntimeLibrary:
    """A vendor runtime library (libcudart, libamdhip64) called through ctypes.

    The batched memcpy takes arrays of thousands of pointers, which the
    vendors' Python wrappers convert element by element (or, hip-python,
    cannot take at all); ctypes passes numpy's buffers.  Everything here is
    the same for both vendors but the prefix of the names; the batch call's
    signature differs and lives in each subclass.
    """

    prefix: str  # "cuda" | "hip"
    batch_min_version: int

    def __init__(self, lib) -> None:
        self.lib = lib
        version = ctypes.c_int()
        self._fn("RuntimeGetVersion")(ctypes.byref(version))
        self.version = version.value
        self.has_batch = self.version >= self.batch_min_version and hasattr(lib, f"{self.prefix}MemcpyBatchAsync")
        self.fail_index = ctypes.c_size_t(0)

    def _fn(self, name: str):
        return getattr(self.lib, self.prefix + name)

    def memcpy_batch(self, batch: CopyBatch, stream: int) -> None:
        if self.has_batch:
            self.check(self.batch_call(batch, stream), f"{self.prefix}MemcpyBatchAsync")
            return
        copy = self._fn("MemcpyAsync")
        for dst, src, size in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
            self.check(copy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(size), MEMCPY_DEFAULT, ctypes.c_void_p(stream)), f"{self.prefix}MemcpyAsync")

    def batch_call(self, batch: CopyBatch, stream: int) -> int:
        """One batched memcpy call; returns the runtime's error code."""
        raise NotImplementedError

    def register_host(self, address: int, nbytes: int) -> int:
        """Page-lock and map [address, address + nbytes); returns the device address of it."""
        self.check(self._fn("HostRegister")(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), REGISTER_FLAGS), f"{self.prefix}HostRegister")
        device = ctypes.c_void_p()
        self.check(self._fn("HostGetDevicePointer")(ctypes.byref(device), ctypes.c_void_p(address), 0), f"{self.prefix}HostGetDevicePointer")
        return device.value or 0

    def unregister_host(self, address: int) -> None:
        self.check(self._fn("HostUnregister")(ctypes.c_void_p(address)), f"{self.prefix}HostUnregister")

    def check(self, err: int, what: str) -> None:
        if err:
            name = self._fn("GetErrorName")
            name.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {name(err).decode()} ({err})")


class GpuBackend(Backend):
    """The transfer logic of a GPU vendor backend; subclasses provide the runtime calls."""

    default_block_quota: int
    vendor_kernel: Path  # the vendor's kv_copy source
    code_suffix: str  # "cubin" | "hsaco"
    max_batch: int | None = None  # descriptors per batched memcpy call

    def __init__(self) -> None:
        super().__init__()
        self.block_quota = int(os.environ.get("PORTABLE_KV_BLOCKS", self.default_block_quota))
        # Extra preprocessor definitions ("PKV_UNROLL=8"), for measuring kernel variants (scripts/kernel_variants.py).
        # Streams one batched DMA transfer is spread over: each can drive its own copy
        # engine. H200, page 64: 41.5 GB/s on 1 stream, 45.4 on 2, 55.5 on 4 (NOTES.md).
        self.dma_streams = int(os.environ.get("PORTABLE_KV_DMA_STREAMS", 4))
        self.defines = tuple(d for d in os.environ.get("PORTABLE_KV_DEFINES", "").split(",") if d)
        self._kernels: dict[int, object] | None = None
        self._load_lock = threading.Lock()
        self._local = threading.local()
        self._tables = IdentityCache(64)
        self._templates: dict[int, tuple] = {}
        self.bad_index = BadIndexFlag(self.device)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    # -- vendor hooks (cuda.py / rocm.py) -----------------------------------------

    @abstractmethod
    def arch(self) -> str:
        """The device's code-object target: "sm_90", "gfx942", ..."""

    @abstractmethod
    def compiler_version(self) -> str: ...

    @abstractmethod
    def compile(self, arch: str) -> bytes:
        """Compile the vendor kernel source at run time (NVRTC / hiprtc)."""

    @abstractmethod
    def load(self, image: bytes) -> dict[int, object]:
        """Load a code object; return the entry point of each access width."""

    @abstractmethod
    def launch(self, kernel: object, grid: int, block: int, params: int, stream: int) -> None:
        """Launch with `params` the address of the kernel's void* argument array."""

    def memcpy_batch(self, batch: CopyBatch, stream: int) -> None:
        """Enqueue every chunk of `batch` on `stream` (never the legacy default stream)."""
        for piece in split_batch(batch, self.max_batch):
            self.runtime.memcpy_batch(piece, stream)

    def bind_thread(self) -> None:
        """Make the device's context current on this thread, where the runtime needs it."""

    def register_host(self, address: int, nbytes: int) -> int:
        return self.runtime.register_host(address, nbytes)

    def unregister_host(self, address: int) -> None:
        self.runtime.unregister_host(address)

    def stream(self) -> int:
        """The handle of the current torch stream: transfers are ordered on it."""
        return _raw_stream(self.device.index)

    # -- code objects ---------------------------------------------------------------

    def code_object(self) -> bytes:
        """Ahead-of-time build if one matches the source and arch, else a cached run-time compile."""
        arch = self.arch()
        name = code_object_name(self.vendor_kernel, arch, self.code_suffix)
        for directory in prebuilt_dirs() if not self.defines else []:
            if (directory / name).is_file():
                return (directory / name).read_bytes()
        cached = cache_dir() / f"{Path(name).stem}-{_short(self.compiler_version() + repr(self.defines))}.{self.code_suffix}"
        if cached.is_file():
            return cached.read_bytes()
        image = self.compile(arch)
        write_atomic(cached, image)
        return image

    def kernels(self) -> dict[int, object]:
        if self._kernels is None:
            with self._load_lock:
                if self._kernels is None:
                    self._kernels = self.load(self.code_object())
        return self._kernels

    # -- transfers ---------------------------------------------------------------------

    def transfer(self, transfer: Transfer, io_backend: str) -> None:
        self.check_errors()
        if io_backend == "kernel":
            self._kernel_transfer(transfer)
        else:
            self._direct_transfer(transfer)

    def check_errors(self) -> None:
        """Raise if a kernel met an index outside its pool since the last check."""
        self.bad_index.check()

    def _layer_table(self, buffers: Sequence[torch.Tensor]) -> LayerTable:
        return self._tables.get(buffers, lambda: LayerTable(buffers, self.device))

    def _template(self, pairs: tuple[TensorPair, TensorPair]) -> JobTemplate:
        entry = self._templates.get(id(pairs))
        if entry is None or entry[0] is not pairs:
            if len(self._templates) >= 16:
                self._templates.clear()
            entry = self._templates[id(pairs)] = (pairs, JobTemplate(pairs, [self._layer_table(p.device) for p in pairs]))
        return entry[1]

    def kernel_args(self, transfer: Transfer, host_indices: torch.Tensor, device_indices: torch.Tensor) -> PreparedLaunch:
        """The kernel's argument struct for a call, with its parameter array and access width."""
        template = self._template(transfer.pairs)
        args = CopyArgs()
        template.write(args)
        args.error_flag = self.bad_index.tensor.data_ptr()
        rows = transfer.tokens * len(transfer.layers)
        args.job[1].vec_begin = rows * template.vecs_per_row[0]
        args.total_vecs = rows * (template.vecs_per_row[0] + template.vecs_per_row[1])
        args.host_indices, args.device_indices = host_indices.data_ptr(), device_indices.data_ptr()
        args.tokens, args.layer_begin, args.layers = transfer.tokens, transfer.layers.start, len(transfer.layers)
        args.page_size = transfer.page_size
        args.to_device = transfer.to_device
        return PreparedLaunch(transfer, template, args, template.width, grid_size(args.total_vecs, self.block_quota), self.block_quota)

    def _kernel_transfer(self, transfer: Transfer) -> None:
        # An engine loads layer after layer with the same pools and indices, and
        # interleaves backups of other pages: a prepared launch per (pools,
        # indices, direction, layer count) is kept, and a call sets its layer.
        local = self._local
        prepared = getattr(local, "prepared", None)
        if prepared is None:
            self.bind_thread()
            prepared = local.prepared = []
        for launch in prepared:
            if launch.matches(transfer, self.block_quota):
                break
        else:
            host_indices, device_indices = transfer.indices.on(self.device)  # kept alive by the IndexPair
            launch = self.kernel_args(transfer, host_indices, device_indices)
            launch.kernel = self.kernels()[launch.width]
            prepared.insert(0, launch)
            del prepared[PREPARED_KEPT:]
        launch.args.layer_begin = transfer.layers.start
        self.launch(launch.kernel, launch.grid, BLOCK, launch.params, self.stream())

    def _direct_transfer(self, transfer: Transfer) -> None:
        batch = copy_batch(transfer)
        current = torch.cuda.current_stream(self.device)
        pieces = split_even(batch, self.dma_streams)
        if current.cuda_stream != 0 and len(pieces) == 1:
            self.memcpy_batch(batch, current.cuda_stream)
            return
        # Several streams let several copy engines work at once; and the batch
        # APIs reject the legacy default stream.  Side streams are ordered
        # after, and before, everything on the current stream.
        streams = ([current] if current.cuda_stream != 0 else []) + self._side_streams(current)
        for stream in streams[1:] if current.cuda_stream != 0 else streams:
            stream.wait_stream(current)
        for piece, stream in zip(pieces, streams):
            self.memcpy_batch(piece, stream.cuda_stream)
        for stream in streams:
            if stream is not current:
                current.wait_stream(stream)

    def _side_streams(self, current: torch.cuda.Stream) -> list[torch.cuda.Stream]:
        # Side streams of their own for each stream the engine uses: shared ones
        # would serialise a load and a backup that the engine put on two streams.
        local = self._local
        if not hasattr(local, "side_streams"):
            local.side_streams = {}
        streams = local.side_streams.setdefault(current.cuda_stream, [])
        while len(streams) < self.dma_streams:
            streams.append(torch.cuda.Stream(self.device))
        return streams[: self.dma_streams]

    def describe(self) -> dict[str, str]:
        facts = {"arch": self.arch(), "compiler": self.compiler_version(), "block_quota": str(self.block_quota)}
        try:
            self.kernels()
            facts["kernels"] = "loaded"
        except BackendUnavailable as exc:
            facts["kernels"] = f"unavailable: {exc}"
        return facts


def _alignment_terms(pair: TensorPair, table: LayerTable) -> int:
    s, c = pair.strides, pair.chunks
    return math.gcd(pair.host.data_ptr(), table.alignment, s.page, s.token, s.layer, c.host_group,
                    pair.device_token_bytes, c.device_group, c.chunk_bytes)


def _raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # ~0.3 us where the public call takes a few
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def split_even(batch: CopyBatch, parts: int) -> list[CopyBatch]:
    """`parts` pieces of about equal bytes (fewer for a small batch)."""
    if parts <= 1 or len(batch) < 2 * parts:
        return [batch]
    cuts = np.searchsorted(np.cumsum(batch.sizes), [batch.sizes.sum() * i // parts for i in range(1, parts)])
    bounds = [0, *cuts.tolist(), len(batch)]
    return [CopyBatch(batch.dst[a:b], batch.src[a:b], batch.sizes[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def split_batch(batch: CopyBatch, limit: int | None) -> list[CopyBatch]:
    """Pieces of at most `limit` descriptors (ROCm faults above 8192 on some parts)."""
    if limit is None or len(batch) <= limit:
        return [batch]
    return [
        CopyBatch(batch.dst[i : i + limit], batch.src[i : i + limit], batch.sizes[i : i + limit])
        for i in range(0, len(batch), limit)
    ]


def find_loaded_library(stem: str) -> str | None:
    """The path of an already-loaded shared library (torch's own runtime), by file-name stem."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if Path(path).name.startswith(stem + ".so"):
                    return path
    except OSError:
        return None
    return None


def as_pointer_array(values: np.ndarray) -> int:
    """The address of a contiguous uint64 array, for ctypes calls taking void** / size_t*."""
    assert values.dtype == np.uint64 and values.flags.c_contiguous
    return values.ctypes.data
