#!/usr/bin/env bash
# The whole GPU round in one call on an NVIDIA host without network: info, ahead-of-time
# build, check, the test suite on every GPU backend (cuda, triton, cpu, the simulated GPU),
# SGLang's HiCache controller on the GPU (where SGLang was carried), compute-sanitizer memcheck
# over the CUDA conformance and GPU tests, host cost per call, the benchmark. Logs and JSON go to
# $OUT (default ./out).
#   before, where pip reaches an index:  bash tools/fetch_gpu_wheels.sh [--sglang]  (extra wheels into .whl/extra/)
#   on the GPU host:                     bash tools/gpu_round.sh [--full]  (--full: the long benchmark)
# SKIP_TESTS, SKIP_SGLANG, SKIP_SANITIZER, SKIP_BENCH=1 leave a step out (to split the round over
# several calls; SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_BENCH=1 runs the SGLang step alone after check).
# BENCH_SECTIONS picks the benchmark's sections, in order (default: host-cost staged engine decode all);
# STAGED_PAGES the staged section's page sizes (default 64), DRAWS the draws of rows beside compute.
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
  EXTRA=(.whl/extra/*.whl)
  # torchvision is built against one torch release: where the host has its own, that one
  # matches the host's torch, and a carried one (or one left from an earlier round) would not.
  if compgen -G ".whl/extra/torchvision-*.whl" >/dev/null && python3 -c "import torchvision" 2>/dev/null; then
    EXTRA=(); for wheel in .whl/extra/*.whl; do [[ $(basename "$wheel") == torchvision-* ]] || EXTRA+=("$wheel"); done
    rm -rf /tmp/pkv-extra/torchvision /tmp/pkv-extra/torchvision-*.dist-info /tmp/pkv-extra/torchvision.libs
    echo "torchvision: the host's own" | tee -a "$LOG"
  fi
  pip_extra() {
    python3 -m pip install -q --no-deps --no-compile --no-warn-conflicts --upgrade --target /tmp/pkv-extra "$@" 2>&1 \
      | { grep -v "^WARNING: Running pip as" || true; } | tee -a "$LOG"
    return "${PIPESTATUS[0]}"
  }
  # One wheel this host refuses (sglang's are manylinux_2_34 only: glibc 2.34 or later) fails
  # the whole call; then each goes on its own, so that the others are still installed.
  pip_extra "${EXTRA[@]}" || for wheel in "${EXTRA[@]}"; do pip_extra "$wheel"; done
  HOST_SITE_PACKAGES=/tmp/pkv-extra${HOST_SITE_PACKAGES:+:$HOST_SITE_PACKAGES}
  # Programs of the extra wheels (ninja, which SGLang's JIT kernels build with).
  [ -d /tmp/pkv-extra/bin ] && export PATH=/tmp/pkv-extra/bin:$PATH
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
  # tests/gpu/test_sglang_gpu.py runs in a step of its own below: one process, no workers.
  # SIGINT at the limit: pytest stops its workers and still prints which tests failed.
  timeout -s INT -k 30 "${TEST_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider -rfE $WORKERS --junitxml "$OUT/junit.xml" \
    --ignore tests/gpu/test_sglang_gpu.py tests > "$OUT/tests.txt" 2>&1
  echo "pytest exit status $?" | tee -a "$LOG"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -n 30 | tee -a "$LOG"
fi
if [ -z "${SKIP_SGLANG:-}" ] && python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"; then
  # SGLang 0.5.23 installed without its dependencies over the host's torch (fetch_gpu_wheels.sh
  # --sglang): the versions met here, and whether SGLang's HiCache modules import with CUDA
  # detected (sgl_kernel stood in for where it is missing, as the test does), one line each.
  step sglang
  python3 - <<'EOF' 2>&1 | grep -v "Warning\|warnings.warn" | tee -a "$LOG"
import importlib, sys, traceback
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("sglang", "torchvision", "transformers", "triton", "pydantic", "fastapi"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} ({module.__file__})")
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
try:
    import sgl_kernel  # noqa: F401
    print("sgl_kernel: SGLang's own")
except Exception as exc:
    print(f"sgl_kernel: the stand-in (tests/gpu/standins; {type(exc).__name__}: {exc})")
    sys.modules.pop("sgl_kernel", None)
    sys.path.insert(0, "tests/gpu/standins")
for name in ("sglang.srt.server_args", "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.swa_memory_pool",
             "sglang.srt.managers.cache_controller", "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
             "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "sglang.srt.mem_cache.unified_radix_cache",
             "sglang.srt.mem_cache.kv_cache_configurator", "sglang.srt.mem_cache.hicache_storage", "sglang.srt.managers.scheduler"):
    try:
        importlib.import_module(name)
        print(f"import {name}: ok")
    except Exception as exc:
        where = [f for f in traceback.extract_tb(exc.__traceback__) if "sglang" in f.filename][-1:]
        print(f"import {name}: {type(exc).__name__}: {exc}" + (f" ({where[0].filename}:{where[0].lineno})" if where else ""))
from sglang.srt.utils import is_cuda
print(f"SGLang detects CUDA: {is_cuda()}")
EOF
  timeout "${SGLANG_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -rfEs --junitxml "$OUT/junit_sglang_gpu.xml" \
    tests/gpu/test_sglang_gpu.py > "$OUT/sglang_gpu.txt" 2>&1
  echo "sglang_gpu: pytest exit status $?: $(tail -n 1 "$OUT/sglang_gpu.txt")" | tee -a "$LOG"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/sglang_gpu.txt" | head -n 20 | tee -a "$LOG"
fi
if command -v compute-sanitizer >/dev/null && [ -z "${SKIP_SANITIZER:-}" ]; then
  step memcheck
  # --show-backtrace no: with backtraces on, the sanitizer keeps the Python frames of every
  # kernel launch (and the host pools they reference) alive, and the lifetime tests fail for it.
  # The 4 GiB wide-offset pools are left out for time, and so is SGLang's stack (its own step).
  for part in tests/gpu tests/conformance; do
    timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck --report-api-errors no --show-backtrace no --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider --ignore tests/gpu/test_sglang_gpu.py "$part" -k "cuda and not triton and not wide" \
      > "$OUT/memcheck_$(basename $part).txt" 2>&1
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_$(basename $part).txt" | tee -a "$LOG"
  done
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  # SGLang's JIT kernels are the staged and engine sections' peers where SGLang imports; its
  # utilities import sgl_kernel, for which the tests' stand-in serves where SGLang's own is missing.
  BENCH_PATH=$PYTHONPATH
  python3 -c "import sgl_kernel" 2>/dev/null || BENCH_PATH=$PYTHONPATH:$ROOT/tests/gpu/standins
  bench() { PYTHONPATH=$BENCH_PATH timeout "$1" python3 -m portable_kv bench --draws "${DRAWS:-5}" "${@:2}"; }
  for section in ${BENCH_SECTIONS:-host-cost staged engine decode all}; do
    started=$SECONDS
    case $section in
      host-cost) step host_cost; bench "${HOST_COST_TIMEOUT:-150}" --section host-cost --json "$OUT/host_cost.json" > "$OUT/host_cost.txt" 2>&1; status=$?
                 grep -E "^host_cost|^ceiling" "$OUT/host_cost.txt" | tee -a "$LOG" ;;
      staged) step staged; bench "${STAGED_TIMEOUT:-360}" --section staged $BENCH --page-size "${STAGED_PAGES:-64}" --json "$OUT/staged.json" \
                > "$OUT/staged.txt" 2>&1; status=$?
              grep -E "^staged|^ceiling" "$OUT/staged.txt" | tee -a "$LOG" ;;
      engine) step engine; bench "${ENGINE_TIMEOUT:-240}" --section engine $BENCH --json "$OUT/engine.json" --markdown "$OUT/engine.md" \
                > "$OUT/engine.txt" 2>&1; status=$?
              grep -vE "^\[bench\]" "$OUT/engine.txt" | tee -a "$LOG" ;;
      decode) step decode; bench "${DECODE_TIMEOUT:-480}" --section decode $BENCH --json "$OUT/decode.json" --markdown "$OUT/decode.md" \
                > "$OUT/decode.txt" 2>&1; status=$?
              grep -vE "^\[bench\]" "$OUT/decode.txt" | tee -a "$LOG" ;;
      all) step bench; bench "${BENCH_TIMEOUT:-420}" $BENCH --json "$OUT/bench.json" --plot "$OUT/bench.png" --markdown "$OUT/bench.md" \
             > "$OUT/bench.txt" 2>&1; status=$?
           tail -n 40 "$OUT/bench.txt" | tee -a "$LOG" ;;
      *) step "$section"; bench "${SECTION_TIMEOUT:-240}" --section "$section" $BENCH --json "$OUT/$section.json" > "$OUT/$section.txt" 2>&1; status=$?
         grep -vE "^\[bench\]" "$OUT/$section.txt" | tail -n 40 | tee -a "$LOG" ;;
    esac
    echo "bench $section: exit status $status, $((SECONDS - started)) s" | tee -a "$LOG"
  done
fi
echo "=== done" | tee -a "$LOG"
