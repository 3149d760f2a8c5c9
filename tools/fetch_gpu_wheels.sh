#!/usr/bin/env bash
# Wheels for a GPU host without network (`tox -e cuda` there, and the extras the round
# tools/gpu_round.sh puts on the tests' path), into .whl/.
# That host has Python 3.12 with torch, triton, cuda-bindings, pytest, hypothesis and
# numpy but not tox; these are tox's whole dependency closure (tox runs in its own
# folder there, so the host's older packaging or filelock do not matter), plus
# setuptools, the build backend pip needs for the editable install in its isolated
# build environment. All are pure Python: a few MiB in all.
#   usage: bash tools/fetch_gpu_wheels.sh [NAME==VERSION ...]
# Extra requirements (e.g. SGLang or Mooncake wheels for the storage tests) go to
# .whl/extra/ without their dependencies; gpu_round.sh puts them on the tests' path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON_VERSION:-3.12}
TOX_CLOSURE=(
  tox==4.67.15 virtualenv==21.15.11 pyproject-api==1.12.1 python-discovery==1.9.6
  cachetools==8.0.2 colorama==0.4.6 filelock==4.3.1 packaging==26.4 platformdirs==4.14.9
  pluggy==1.6.0 distlib==0.4.4 tomli-w==1.2.0 typing-extensions==4.15.0
  setuptools==84.2.1
)
download() {
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dest" "$@"
}
mkdir -p .whl
download .whl "${TOX_CLOSURE[@]}"
if [ $# -gt 0 ]; then
  mkdir -p .whl/extra
  download .whl/extra "$@"
fi
du -sh .whl
