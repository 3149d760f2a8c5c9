"""Every kernel source compiles for sm_90 and gfx942 without a GPU, and the code
objects hold what the fast path needs. CI installs the toolchains and sets
PORTABLE_KV_REQUIRE_TOOLCHAINS=1, turning a missing tool into a failure."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from portable_kv.backends import cuda, rocm
from portable_kv.backends.base import BackendUnavailable

NAMES = [f"pkv_copy_{w}" for w in (16, 8, 4, 2, 1)] + ["pkv_bulk"]


def need(condition: bool, reason: str) -> None:
    if condition:
        return
    if os.environ.get("PORTABLE_KV_REQUIRE_TOOLCHAINS"):
        pytest.fail(f"toolchain required in CI: {reason}")
    pytest.skip(reason)


def cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(bundled) if bundled.exists() else None
    except ImportError:
        return None


def sass_of(cubin: Path, kernel: str) -> str:
    tool = cuobjdump()
    need(tool is not None, "cuobjdump not found (it comes with the CUDA toolkit or the triton wheel)")
    text = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return text.split(f"Function : {kernel}")[1].split("Function :")[0]


def test_nvcc_builds_sm90(tmp_path):
    need(shutil.which("nvcc") is not None, "nvcc not found")
    (cubin,) = cuda.nvcc_build(tmp_path, ("sm_90",))
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF" and all(n.encode() in data for n in NAMES)
    sass = sass_of(cubin, "pkv_copy_16")
    assert re.search(r"LDG\.E\.EF\.128", sass), "the 16-byte path must use 128-bit evict-first loads"
    assert re.search(r"STG\.E\.EF\.128", sass), "the 16-byte path must use 128-bit evict-first host stores"
    bulk = sass_of(cubin, "pkv_bulk")
    assert re.search(r"UBLKCP\.S\.G", bulk) and re.search(r"UBLKCP\.G\.S", bulk), "sm_90's bulk kernel moves stages by bulk copies"
    assert re.search(r"SYNCS", bulk), "each stage waits on its mbarrier"
    tool = cuobjdump()
    everything = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    # The pipelined kernel holds two iterations' addresses in registers; a spill
    # to local memory would put a device round trip back into every iteration.
    assert not re.search(r"\b(LDL|STL)\b", everything), "a copy kernel uses local memory (register spills)"


def test_nvrtc_builds_sm90_cubin(tmp_path):
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        need(False, "cuda-python not installed")
    try:
        data = cuda.nvrtc_compile(nvrtc, "sm_90")
    except RuntimeError as exc:
        need(False, f"NVRTC library not loadable: {exc}")
    assert data[:4] == b"\x7fELF" and all(n.encode() in data for n in NAMES)
    (tmp_path / "k.cubin").write_bytes(data)
    assert re.search(r"LDG\.E\.EF\.128", sass_of(tmp_path / "k.cubin", "pkv_copy_16"))


def test_hip_builds_gfx942_wave64(tmp_path):
    try:
        (obj,) = [p for p in rocm.clang_build(tmp_path, ("gfx942",))]
    except BackendUnavailable as exc:
        need(False, str(exc))
    readelf = shutil.which("llvm-readelf-19") or shutil.which("llvm-readelf")
    objdump = shutil.which("llvm-objdump-19") or shutil.which("llvm-objdump")
    need(readelf is not None and objdump is not None, "llvm-readelf / llvm-objdump not found")
    notes = subprocess.run([readelf, "--notes", str(obj)], capture_output=True, text=True, check=True).stdout
    kernels = re.findall(r"\.name:\s+(pkv_copy_\d+|pkv_bulk)\n", notes)
    assert sorted(kernels) == sorted(NAMES)
    assert notes.count(".wavefront_size: 64") == len(NAMES), "MI300 kernels must be wave64"
    assert notes.count(".private_segment_fixed_size: 0") == len(NAMES), "a copy kernel uses scratch memory"
    assert notes.count(".vgpr_spill_count: 0") == len(NAMES) and notes.count(".sgpr_spill_count: 0") == len(NAMES), "register spills"
    asm = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, check=True).stdout
    fast = asm.split("<pkv_copy_16>:")[1].split(">:")[0]
    assert "global_load_dwordx4" in fast and " nt" in fast, "16-byte non-temporal global loads on the fast path"
    bulk = asm.split("<pkv_bulk>:")[1].split(">:")[0]
    assert "global_load_dwordx4" in bulk and " nt" in bulk, "the bulk kernel's vector walker: 16-byte non-temporal loads"


def test_hip_build_skips_unknown_archs(tmp_path):
    try:
        built = rocm.clang_build(tmp_path, ("gfx942", "gfx9999"))
    except BackendUnavailable as exc:
        need(False, str(exc))
    assert [p.name.split(".")[1] for p in built] == ["gfx942"]


@pytest.mark.parametrize("target", [("cuda", 90, 32), ("hip", "gfx942", 64)], ids=["sm_90", "gfx942"])
@pytest.mark.parametrize("to_device", [True, False], ids=["load", "backup"])
def test_triton_kernel_compiles_ahead(target, to_device):
    pytest.importorskip("triton", reason="triton not installed")
    from triton.backends.compiler import GPUTarget

    from portable_kv.backends.triton import compile_ahead

    asm = compile_ahead(GPUTarget(*target), to_device)
    binary = asm["cubin" if target[0] == "cuda" else "hsaco"]
    assert isinstance(binary, bytes) and binary[:4] == b"\x7fELF" and len(binary) > 1000
