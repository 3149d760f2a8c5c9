#!/usr/bin/env bash
# The whole GPU round in one call on an NVIDIA host without network: info, ahead-of-time
# build, check, the test suite on every GPU backend (cuda, triton, cpu, the simulated GPU),
# compute-sanitizer memcheck over the CUDA conformance and GPU tests, host cost per call, the benchmark. Logs and JSON go to
# $OUT (default ./out).
#   before, where pip reaches an index:  bash tools/fetch_gpu_wheels.sh   (extra wheels into .whl/extra/)
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
# Nothing is downloaded: pip reads .whl only.
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$ROOT/.whl

# This environment's site-packages, and the extra wheels, for the steps below and for a
# `tox -e cuda` run after the round (tox.ini, HOST_SITE_PACKAGES).
HOST_SITE_PACKAGES=$(python3 -c 'import site, sys; print(":".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
# Debian packages the extra wheels load (Mooncake: libibverbs), unpacked beside the tree and
# found through LD_LIBRARY_PATH: `dpkg -x` into / would replace /lib's symlink on a merged-/usr
# system, and the linker (Triton builds its launchers with gcc) would then miss libc.
if compgen -G ".whl/debs/*.deb" >/dev/null; then
  for deb in .whl/debs/*.deb; do dpkg -x "$deb" /tmp/pkv-debs; done
  export LD_LIBRARY_PATH=/tmp/pkv-debs/usr/lib/x86_64-linux-gnu:/tmp/pkv-debs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if compgen -G ".whl/extra/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --no-compile --no-warn-conflicts --upgrade --target /tmp/pkv-extra .whl/extra/*.whl 2>&1 | grep -v "^WARNING: Running pip as" | tee -a "$LOG"
  HOST_SITE_PACKAGES=/tmp/pkv-extra${HOST_SITE_PACKAGES:+:$HOST_SITE_PACKAGES}
fi
export HOST_SITE_PACKAGES
# Every step imports the package from this tree.
export PYTHONPATH=$ROOT${HOST_SITE_PACKAGES:+:$HOST_SITE_PACKAGES}${PYTHONPATH:+:$PYTHONPATH}

BENCH=--quick; [ "${1:-}" = "--full" ] && BENCH=""
step info;  python3 -m portable_kv info 2>&1 | tee -a "$LOG"
step build; python3 -m portable_kv build --vendor cuda --arch sm_90 --out /tmp/pkv_prebuilt 2>&1 | tee -a "$LOG"
step check; python3 -m portable_kv check 2>&1 | tee -a "$LOG"
if [ -z "${SKIP_TESTS:-}" ]; then
  # The whole suite in this interpreter, on every backend the machine has (cuda, triton, cpu,
  # the simulated GPU), spread over the host's cores: 277 s with 16 workers on the H200.
  # `tox -e cuda` runs the same in an environment of its own where time allows.
  step tests
  if python3 -c "import xdist" 2>/dev/null; then WORKERS="-n ${PKV_WORKERS:-16}"; else WORKERS=""; fi
  timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider -rfE $WORKERS --junitxml "$OUT/junit.xml" tests > "$OUT/tests.txt" 2>&1
  echo "pytest exit status $?" | tee -a "$LOG"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -n 30 | tee -a "$LOG"
fi
if command -v compute-sanitizer >/dev/null && [ -z "${SKIP_SANITIZER:-}" ]; then
  step memcheck
  # --show-backtrace no: with backtraces on, the sanitizer keeps the Python frames of every
  # kernel launch (and the host pools they reference) alive, and the lifetime tests fail for it.
  # The 4 GiB wide-offset pools are left out for time.
  for part in tests/gpu tests/conformance; do
    timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck --report-api-errors no --show-backtrace no --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider "$part" -k "cuda and not triton and not wide" > "$OUT/memcheck_$(basename $part).txt" 2>&1
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_$(basename $part).txt" | tee -a "$LOG"
  done
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
