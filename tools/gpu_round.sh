#!/usr/bin/env bash
# The whole GPU round in one call on an NVIDIA host without network: info, ahead-of-time
# build, check, the test suite on every GPU backend through `tox -e cuda` (cuda, triton,
# cpu; then a pass with triton bound at import), compute-sanitizer memcheck over the
# conformance and GPU tests, host cost per call, the benchmark. Logs and JSON go to
# $OUT (default ./out).
#   before, where pip reaches an index:  bash tools/fetch_gpu_wheels.sh   (tox and setuptools into .whl/)
#   on the GPU host:                     bash tools/gpu_round.sh [--full]  (--full: the long benchmark)
# SKIP_TESTS, SKIP_SANITIZER, SKIP_BENCH=1 leave a step out (to split the round over two calls).
# Wheels in .whl/extra/ (e.g. SGLang, Mooncake) are put on the tests' path as they are.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG="$OUT/round.txt"
step() { echo "=== $1" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1 PORTABLE_KV_CACHE=${PORTABLE_KV_CACHE:-/tmp/portable_kv_cache}
# Nothing is downloaded: pip (also inside tox and its isolated build) reads .whl only.
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$ROOT/.whl

# tox in a folder of its own, so its newer packaging and filelock never shadow the host's.
TOX_SITE=/tmp/pkv-tox
if compgen -G ".whl/tox-*.whl" >/dev/null; then
  python3 -m pip install -q --no-compile --no-warn-conflicts --upgrade --target "$TOX_SITE" tox 2>&1 | grep -v "^WARNING: Running pip as" | tee -a "$LOG"
fi
# Where python3 is itself a virtual environment, a tox environment made from it inherits
# only the base interpreter's packages: hand it this environment's (tox.ini, HOST_SITE_PACKAGES).
HOST_SITE_PACKAGES=$(python3 -c 'import site, sys; print(":".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
if compgen -G ".whl/extra/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --no-compile --no-warn-conflicts --upgrade --target /tmp/pkv-extra .whl/extra/*.whl 2>&1 | grep -v "^WARNING: Running pip as" | tee -a "$LOG"
  HOST_SITE_PACKAGES=/tmp/pkv-extra${HOST_SITE_PACKAGES:+:$HOST_SITE_PACKAGES}
fi
export HOST_SITE_PACKAGES
# The steps outside tox import the package from this tree.
export PYTHONPATH=$ROOT${HOST_SITE_PACKAGES:+:$HOST_SITE_PACKAGES}${PYTHONPATH:+:$PYTHONPATH}

BENCH=--quick; [ "${1:-}" = "--full" ] && BENCH=""
step info;  python3 -m portable_kv info 2>&1 | tee -a "$LOG"
step build; python3 -m portable_kv build --vendor cuda --arch sm_90 --out /tmp/pkv_prebuilt 2>&1 | tee -a "$LOG"
step check; python3 -m portable_kv check 2>&1 | tee -a "$LOG"
if [ -z "${SKIP_TESTS:-}" ]; then
  step "tox -e cuda"
  if PYTHONPATH=$TOX_SITE python3 -c "import tox" 2>/dev/null; then
    PYTHONPATH=$TOX_SITE timeout "${TEST_TIMEOUT:-480}" python3 -m tox -e cuda --workdir /tmp/pkv-tox-work > "$OUT/tox.txt" 2>&1
    echo "tox exit status $?" | tee -a "$LOG"
    grep -E "passed|failed|error|commands\[|cuda: (OK|FAIL)" "$OUT/tox.txt" | tail -n 30 | tee -a "$LOG"
  else
    echo "no tox: run bash tools/fetch_gpu_wheels.sh where pip reaches an index, and carry .whl" | tee -a "$LOG"
  fi
fi
if command -v compute-sanitizer >/dev/null && [ -z "${SKIP_SANITIZER:-}" ]; then
  step memcheck
  # --show-backtrace no: with backtraces on, the sanitizer keeps the Python frames of every
  # kernel launch (and the host pools they reference) alive, and the leak tests fail for it.
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck --report-api-errors no --show-backtrace no --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/conformance tests/gpu -k "cuda and not triton" > "$OUT/memcheck.txt" 2>&1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.txt" | tee -a "$LOG"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  step host_cost; timeout 120 python3 -m portable_kv bench --section host-cost 2>&1 | tee -a "$LOG"
  step staged; timeout "${STAGED_TIMEOUT:-600}" python3 -m portable_kv bench --section staged $BENCH --json "$OUT/staged.json" > "$OUT/staged.txt" 2>&1
  grep -E "^staged|^ceiling" "$OUT/staged.txt" | tee -a "$LOG"
  step bench; timeout "${BENCH_TIMEOUT:-420}" python3 -m portable_kv bench $BENCH --json "$OUT/bench.json" --plot "$OUT/bench.png" \
    --markdown "$OUT/bench.md" > "$OUT/bench.txt" 2>&1
  tail -n 40 "$OUT/bench.txt" | tee -a "$LOG"
fi
echo "=== done" | tee -a "$LOG"
