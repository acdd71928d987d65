#!/usr/bin/env bash
# One call on the GPU machine: build and install jaxflash, run the native CUDA
# self-tests, the pytest suite (CPU and GPU backends) and the benchmark; print
# a short table last. Logs go to $OUT (the device tool brings them back).
#
#   scripts/gpu_check.sh [quick|full]     (default: full)
# quick: no native self-tests (they rebuild every kernel serially), only the
# CUDA-backend tests, a short table. Builds for sm_90a only (H100/H200); CI
# compiles the default architectures.
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/jaxflash_out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
declare -A STATUS

step() {  # step NAME LOGFILE COMMAND...
  local name=$1 log=$2; shift 2
  local start=$SECONDS
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - start))s"
  echo "== $name: rc=$rc ($((SECONDS - start))s); last lines of $log:"
  tail -n 15 "$OUT/$log"
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"

cd "$REPO"
step build build.log env CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -v --no-build-isolation --no-deps \
  -C cmake.define.JAXFLASH_CUDA_ARCHITECTURES=90a . \
  || { echo "build failed"; exit 1; }
python3 -c "import jaxflash; print('backends', jaxflash.backends())" | tee -a "$OUT/device.txt"

# Native self-tests of the CUDA kernels against fp64 CPU references.
# Each links only its own direction's kernels, compiled 16 at a time.
selftest() {  # selftest fwd|bwd forward|backward
  local objs=/tmp/selftest_$1 nvcc_flags="-std=c++17 -O3 --use_fast_math -gencode=arch=compute_90a,code=sm_90a -I."
  mkdir -p "$objs"
  ls cuda/gpu/tests/$1_selftest.cu cuda/gpu/$2.cu cuda/gpu/instantiations/$1_*.cu |
    xargs -P 16 -I{} sh -c "nvcc $nvcc_flags -c {} -o $objs/\$(basename {}).o" &&
    nvcc $nvcc_flags "$objs"/*.o -o /tmp/$1_selftest && /tmp/$1_selftest
}
if [ "$MODE" = full ]; then
  step fwd_selftest fwd_selftest.log selftest fwd forward
  step bwd_selftest bwd_selftest.log selftest bwd backward
fi

# The test suite, from outside the source tree so the installed package is imported.
cd /tmp
# -rf names every failure in the summary, --tb=line keeps each to one line, and
# -v puts each result (with its test id) in the log as it happens, so a run cut
# short still says which cases failed.
PYTEST_ARGS=(-v -rf --tb=line -n 8 -p no:cacheprovider --durations=10 "$REPO/tests")
[ "$MODE" = quick ] && PYTEST_ARGS+=(-k cuda)
step pytest pytest.log python3 -m pytest "${PYTEST_ARGS[@]}"

if [ "$MODE" = full ] && python3 -c "import jaxflash.bench" 2>/dev/null; then
  step bench bench.log python3 -m jaxflash.bench --dtypes bfloat16 --head-dims 64,128 \
    --seqlens 1024,4096,16384 --longest-limit 131072 --out "$OUT/bench.md"
fi
SEQLENS=1024,4096,16384
[ "$MODE" = quick ] && SEQLENS=4096,16384
step main_job main_job.log python3 -m jaxflash --dtype bfloat16 --seqlens $SEQLENS --heads 16 --head-dim 128 --batch 1

echo
echo "==================== summary ===================="
cat "$OUT/device.txt"
for k in "${!STATUS[@]}"; do printf '%-14s %s\n' "$k" "${STATUS[$k]}"; done
grep -E "passed|failed" "$OUT/pytest.log" | tail -n 1
grep -E "PASS|FAIL" "$OUT"/*selftest.log 2>/dev/null | tail -n 20
[ -f "$OUT/bench.md" ] && tail -n 30 "$OUT/bench.md"
