#!/usr/bin/env bash
# The whole GPU round in one call on the GPU machine: info, ahead-of-time build,
# check, the full test suite on every backend available there, a sanitizer
# pass, the benchmark. Logs and JSON go to $OUT (default ./out).
#   usage: bash scripts/gpu_round.sh [--full]     (--full: the long benchmark)
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
step() { echo "=== $1"; }
step info;  python3 -m portable_kv info 2>&1 | tee "$OUT/info.txt"
step build; python3 -m portable_kv build --vendor cuda --arch sm_90 --out /tmp/pkv_prebuilt 2>&1 | tee "$OUT/build.txt"
step check; python3 -m portable_kv check 2>&1 | tee "$OUT/check.txt"
step tests; timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests 2>&1 | tail -n 40 | tee "$OUT/tests.txt"
if command -v compute-sanitizer >/dev/null && [ -z "${SKIP_SANITIZER:-}" ]; then
  step memcheck
  timeout 240 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -x -p no:cacheprovider \
    tests/conformance/test_transfers.py -k "cuda and (roundtrip or token_granular) and bfloat16 or cuda and token_granular" 2>&1 | tail -n 15 | tee "$OUT/memcheck.txt"
fi
step bench; timeout ${BENCH_TIMEOUT:-420} python3 -m portable_kv bench $BENCH --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>"$OUT/bench.log" | tee "$OUT/bench.txt"
echo "=== done"
