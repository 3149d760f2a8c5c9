#!/usr/bin/env bash
# The whole GPU round in one call on the GPU machine: info, ahead-of-time build,
# check, the full test suite on every backend available there, a memcheck pass,
# kernel variants, the benchmark. Logs and JSON go to $OUT (default ./out).
#   usage: bash scripts/gpu_round.sh [--full]     (--full: the long benchmark)
#   SKIP_TESTS, SKIP_SANITIZER, SKIP_VARIANTS, SKIP_BENCH=1 leave a step out (to split the round over two calls).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PORTABLE_KV_CACHE=${PORTABLE_KV_CACHE:-/tmp/portable_kv_cache}
# Wheels carried in .whl (the GPU machine has no network), if any.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
BENCH=--quick; [ "${1:-}" = "--full" ] && BENCH=""
LOG="$OUT/round.txt"
step() { echo "=== $1" | tee -a "$LOG"; }
step info;  python3 -m portable_kv info 2>&1 | tee -a "$LOG"
step build; python3 -m portable_kv build --vendor cuda --arch sm_90 --out /tmp/pkv_prebuilt 2>&1 | tee -a "$LOG"
step check; python3 -m portable_kv check 2>&1 | tee -a "$LOG"
if [ -z "${SKIP_TESTS:-}" ]; then
  step tests; timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -n 30 | tee -a "$LOG"
fi
if command -v compute-sanitizer >/dev/null && [ -z "${SKIP_SANITIZER:-}" ]; then
  step memcheck
  timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 -m pytest -q -x -p no:cacheprovider \
    tests/conformance/test_transfers.py tests/gpu -k "cuda and not triton" > "$OUT/memcheck.txt" 2>&1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.txt" | tee -a "$LOG"
fi
if [ -z "${SKIP_VARIANTS:-}" ]; then
  step variants; timeout 200 python3 scripts/kernel_variants.py 2>&1 | tee -a "$LOG"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  step host_cost; timeout 60 python3 scripts/host_cost.py 2>&1 | head -n 7 | tee -a "$LOG"
  step bench; timeout "${BENCH_TIMEOUT:-420}" python3 -m portable_kv bench $BENCH --json "$OUT/bench.json" --plot "$OUT/bench.png" \
    --markdown "$OUT/bench.md" 2>"$OUT/bench.log" | tee "$OUT/bench.txt"
fi
echo "=== done"
