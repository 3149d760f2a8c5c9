#!/usr/bin/env bash
# Wheels for a GPU host without network (`tox -e cuda` there, and the extras the round
# tools/gpu_round.sh puts on the tests' path), into .whl/.
# That host has Python 3.12 with torch, triton, cuda-bindings, pytest, hypothesis and
# numpy but not tox; these are tox's whole dependency closure (tox runs in its own
# folder there, so the host's older packaging or filelock do not matter), plus
# setuptools, the build backend pip needs for the editable install in its isolated
# build environment. All are pure Python: a few MiB in all.
#   usage: bash tools/fetch_gpu_wheels.sh [--sglang | --vllm] [NAME==VERSION ...]
# Extra requirements (e.g. Mooncake's wheel for the storage tests) go to .whl/extra/
# without their dependencies; gpu_round.sh puts them on the tests' path.
# --sglang: SGLang 0.5.23 and the wheels its HiCache path imports beyond the GPU host's
# image, into .whl/extra/ (SGLANG_SET below). What travels to the GPU host (the tree and
# the carried folders) is limited to 64 MiB: the SGLang set is ~36 MiB and Mooncake's
# CUDA wheel ~47 MiB, so the two go in separate rounds (`rm -r .whl/extra` between).
# --vllm: vLLM 0.33.0 cut to its Python files and the wheels its KV offloading path imports
# beyond the GPU host's image, into .whl/extra/ (VLLM_SET below), for tests/gpu/test_vllm_gpu.py:
# ~35 MiB (vLLM's Python files 12 MiB), so it goes in a round of its own, as the SGLang set does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON_VERSION:-3.12}
TOX_CLOSURE=(
  tox==4.67.15 virtualenv==21.15.11 pyproject-api==1.12.1 python-discovery==1.9.6
  cachetools==8.0.2 colorama==0.4.6 filelock==4.3.1 packaging==26.4 platformdirs==4.14.9
  pluggy==1.6.0 distlib==0.4.4 tomli-w==1.2.0 typing-extensions==4.15.0
  setuptools==84.2.1
)
# Found by importing, on the host's packages alone plus sglang without its dependencies,
# SGLang's host-pool assembler, HiCache controllers, device and host pools, radix caches,
# KV-cache configurator and builder, storage tiers (HiCacheFile), scheduler and model worker
# (what tests/sglang/mimokit.py builds the MiMo-V2-Flash stack from), with CUDA detected and
# tests/gpu/standins in place of sgl_kernel, and adding what failed one at a time.
# Versions as tox.ini's [testenv:sglang] pins them (those it leaves to pip, as pip resolves
# them there); openai as sglang 0.5.23 pins it (the newest openai needs httpx2).
SGLANG_SET=(
  sglang==0.5.23
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  msgspec==0.23.0 orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 apache-tvm-ffi==0.1.11
  gguf==0.19.0 compressed-tensors==0.18.0 loguru==0.7.3 starlette==1.10.0 dill==0.4.1
  ipython==9.18.1 traitlets==5.16.1 setproctitle==1.3.8
  openai==2.8.0 distro==1.9.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7
  fastapi==0.165.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
  # SGLang's JIT kernels (the bench's SGLang peers) compile on first use with the host's
  # nvcc through ninja (its binary: /tmp/pkv-extra/bin, gpu_round.sh puts it on PATH) and
  # link apache-tvm-ffi above; their sources stay in the slimmed wheel (sglang/kernels/jit).
  ninja==1.13.2
  # SGLang's config package registers image processors with transformers, which wants
  # torchvision for that. It must be the build for the host's torch (0.26.0 is torch
  # 2.11.0's, CUDA 13.0 on PyPI); gpu_round.sh keeps the host's own where it has one.
  "torchvision==${PKV_TORCHVISION:-0.26.0}"
)
# Found by importing vLLM's offloading connector, CPU spec and worker and its connector worker
# with vllm installed without its dependencies (tox.ini's [testenv:vllm] pins the same
# versions), less what the SGLang set found in the host's image (transformers, tokenizers,
# safetensors, requests, psutil, tqdm, PyYAML, aiohttp, pillow). Its openai wants httpx2.
VLLM_SET=(
  vllm==0.33.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 cloudpickle==3.1.3 uvloop==0.23.0
  py-cpuinfo==9.0.0 prometheus_client==0.26.0 cachetools==8.0.2 regex==2026.11.19
  openai==3.60.0 openai-harmony==0.0.8 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0
  anyio==4.16.0 sniffio==1.3.1
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.0
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7
)
download() {
  local dest=$1; shift
  # sglang's wheels are manylinux_2_34 only; older tags first, so that a package with
  # both takes the one that loads on older C libraries.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 --platform any -d "$dest" "$@"
}
# SGLang's wheel less its Rust extension modules (the HTTP/gRPC server, multimodal
# processors and benchmark: 17 MiB of its 37), which nothing on the HiCache path loads,
# so that the set travels within the limit beside the tox wheels. RECORD loses their
# lines; SGLANG_FULL_WHEEL=1 keeps the wheel as published.
slim_sglang() {
  [ -n "${SGLANG_FULL_WHEEL:-}" ] && return 0
  local wheel
  for wheel in .whl/extra/sglang-*.whl; do
    python3 - "$wheel" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
dropped = lambda name: name.startswith("sglang/srt/rust_extensions/") and ".so" in name.rsplit("/", 1)[-1]
with zipfile.ZipFile(path) as src:
    names = [i.filename for i in src.infolist()]
    if not any(dropped(n) for n in names):
        sys.exit(0)
    with zipfile.ZipFile(path + ".part", "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True) if not dropped(line.split(b",")[0].decode()))
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(path + ".part", path)
print(f"{os.path.basename(path)}: Rust extension modules left out")
EOF
  done
}
# vLLM's wheel cut to its Python files (336 MiB as published, nearly all of it CUDA kernels,
# FlashAttention and FlashMLA, which the offloading path does not load: portable_kv moves
# the bytes); RECORD loses the other lines.
slim_vllm() {
  local wheel
  for wheel in .whl/extra/vllm-*.whl; do
    python3 - "$wheel" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
kept = lambda name: name.endswith(".py") or ".dist-info/" in name
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".part", "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if not kept(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if kept(line.split(b",")[0].decode()))
        dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(path + ".part", path)
print(f"{os.path.basename(path)}: Python files only")
EOF
  done
}
SGLANG=""
VLLM=""
if [ "${1:-}" = "--sglang" ]; then SGLANG=1; shift; fi
if [ "${1:-}" = "--vllm" ]; then VLLM=1; shift; fi
mkdir -p .whl
download .whl "${TOX_CLOSURE[@]}"
if [ -n "$SGLANG" ]; then
  mkdir -p .whl/extra
  download .whl/extra "${SGLANG_SET[@]}"
  slim_sglang
fi
if [ -n "$VLLM" ]; then
  mkdir -p .whl/extra
  download .whl/extra --platform manylinux_2_31_x86_64 "${VLLM_SET[@]}"  # llguidance is manylinux_2_31
  slim_vllm
fi
if [ $# -gt 0 ]; then
  mkdir -p .whl/extra
  download .whl/extra "$@"
fi
if [ -d .whl/extra ]; then du -b .whl/extra/* | sort -n | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2}'; fi
du -sh .whl .whl/extra 2>/dev/null || true
# The limit counts everything that travels: the tracked tree and the carried folders.
echo "tracked tree: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes; carry \`.whl\` (or \`.whl/extra\` alone for the round) within 64 MiB with it"
