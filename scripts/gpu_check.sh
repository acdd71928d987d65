#!/usr/bin/env bash
# The GPU check: build and install jaxflash, then run the native CUDA
# self-tests, the GPU test suite, compute-sanitizer and the benchmark; print a
# short table last. Logs go to $OUT (the device tool brings them back).
#
#   scripts/gpu_check.sh tests   build, native self-tests, the GPU test suite
#   scripts/gpu_check.sh bench   build, compute-sanitizer, the benchmark protocol
#   scripts/gpu_check.sh cli     build, `python -m jaxflash --plot`, the dropout, score-modifier
#                                and Flax mask-path benchmarks
#   scripts/gpu_check.sh multi   build, the sharding tests on the GPUs, the multi-GPU
#                                benchmark (on a machine of several GPUs: nvidia-h200-x2)
#   scripts/gpu_check.sh full    all of it (about 18 minutes on an H100)
#   scripts/gpu_check.sh quick   build and the GPU test suite only
#   scripts/gpu_check.sh quick multi   modes combine: one build, each mode's steps
#
# JAXFLASH_PREBUILT=DIR (a folder in the checkout, carried to the device): install DIR's wheel
# and run DIR's self-test binaries instead of building here, saving the device the ~150 s build
# (scripts/build_prebuilt.sh makes DIR on a machine without a GPU).
#
# The halves fit the device tool's 10-minute calls. Builds for the visible GPU
# only (sm_90a on an H100/H200); CI compiles sm_80 and sm_90a. The CPU backend's
# tests run in CI (.ci/run), so here pytest selects the CUDA ones (-k cuda).
set -uo pipefail
MODES=("${@:-full}")
MODE="${MODES[*]}"
for m in "${MODES[@]}"; do
  case "$m" in tests|bench|cli|multi|full|quick) ;; *) echo "usage: $0 [tests|bench|cli|multi|full|quick]..."; exit 2 ;; esac
done
want() {  # whether any chosen mode is one of the arguments
  local m
  for m in "${MODES[@]}"; do [ "$m" = full ] || [[ " $* " == *" $m "* ]] && return 0; done
  return 1
}
OUT=${OUT:-/tmp/jaxflash_out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# NVLink multicast stays off on the shared multi-GPU hosts (the device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0
declare -A STATUS
FAILED=0

step() {  # step NAME LOGFILE TIMEOUT_S COMMAND...
  local name=$1 log=$2 limit=$3; shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "(timed out after ${limit}s)" >>"$OUT/$log"
  STATUS[$name]="rc=$rc $((SECONDS - start))s"
  [ $rc = 0 ] || FAILED=1
  echo "== $name: rc=$rc ($((SECONDS - start))s); last lines of $log:"
  tail -n 8 "$OUT/$log"
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"

cd "$REPO"
# The README's install: with JAXFLASH_CUDA=auto it builds CUDA for the visible GPU only
# (sm_90a on an H100/H200); the build log's "-- jaxflash:" lines say what was built.
BUILD_DIR=/tmp/jaxflash_build  # kept, so that the self-tests reuse the kernels' objects
PREBUILT=${JAXFLASH_PREBUILT:+$(cd "$JAXFLASH_PREBUILT" && pwd)}
if [ -n "$PREBUILT" ]; then
  step install build.log 120 python3 -m pip install -v --no-deps --force-reinstall "$PREBUILT"/jaxflash-*.whl \
    || { echo "install of the prebuilt wheel failed"; exit 1; }
  cat "$PREBUILT/build_info.txt" | tee -a "$OUT/device.txt"
  SELFTEST_DIR=/tmp/jaxflash_prebuilt
  python3 scripts/prebuilt.py unpack "$PREBUILT" "$SELFTEST_DIR" >/dev/null
else
  step build build.log 420 env CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -v --no-build-isolation --no-deps \
    -Cbuild-dir=$BUILD_DIR . || { echo "build failed"; exit 1; }
  grep -E "^ *-- jaxflash" "$OUT/build.log" | tee -a "$OUT/device.txt"
  SELFTEST_DIR=$BUILD_DIR
fi
(cd /tmp && python3 -c "import jaxflash, jaxflash.kernels as k, os
print('backends', jaxflash.backends(), 'built for', k._native.cuda_architectures,
      'extension %.1f MB' % (os.path.getsize(k._native.__file__) / 2**20))") | tee -a "$OUT/device.txt"

# Native self-tests of the CUDA kernels against fp64 CPU references (cmake/cuda.cmake's
# JAXFLASH_BUILD_SELFTESTS), in the extension's build tree: only the *_mma_selftest kernels
# are new objects.
if want tests; then
  [ -n "$PREBUILT" ] || step selftest_build selftest_build.log 300 bash -c "cmake -S . -B $BUILD_DIR -DJAXFLASH_BUILD_SELFTESTS=ON && \
    cmake --build $BUILD_DIR -j 16 --target fwd_selftest fwd_mma_selftest bwd_selftest bwd_mma_selftest"
  # On a Hopper GPU the 16-bit D = 64 / 128 cases run the sm_90 kernels; the *_mma
  # self-tests build without them, so the mma.sync kernels that other GPUs run stay
  # verified here too.
  # They run side by side (each is mostly its fp64 CPU reference; ~70 s together instead of
  # ~140 s in a row), which keeps the tests mode inside the device tool's 10-minute call.
  for name in fwd_selftest fwd_mma_selftest bwd_selftest bwd_mma_selftest; do
    step "$name" "$name.log" 200 "$SELFTEST_DIR/$name" >"$OUT/$name.step" &
  done
  wait
  for name in fwd_selftest fwd_mma_selftest bwd_selftest bwd_mma_selftest; do
    cat "$OUT/$name.step" && rm "$OUT/$name.step"
    # (step ran in a subshell: its status comes back through the log's summary line)
    if grep -qE "^[0-9]+ passed, 0 failed" "$OUT/$name.log"; then STATUS[$name]="passed"
    else STATUS[$name]="FAILED"; FAILED=1; fi
  done
fi

# From outside the source tree, so that the installed package is imported.
cd /tmp
if want tests quick; then
  # -rfxX names every failure and known failure (and those that passed) in the
  # summary, --tb=line keeps each to one line, and -v puts each result (with its
  # test id) in the log as it happens, so a run cut short still says which cases failed.
  step pytest pytest.log 420 python3 -m pytest -v -rfxX --tb=line -n 12 -p no:cacheprovider --durations=15 \
    -k cuda -m "not big_memory" "$REPO/tests"
  # The tests of tens of GiB each, one at a time, with the GPU to themselves.
  step pytest_big pytest_big.log 240 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m pytest -v -rfsxX --tb=short -p no:cacheprovider --durations=5 \
    -k cuda -m big_memory "$REPO/tests"
fi

if want bench; then
  # memcheck, racecheck and synccheck on jaxflash's own kernels (kns: kernel-name substring),
  # each buffer its own allocation so that an overrun is not hidden in XLA's pool.
  for tool in memcheck racecheck synccheck; do
    step "$tool" "$tool.log" 100 env XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool "$tool" \
      --kernel-name kns=jaxflash --error-exitcode 1 python3 "$REPO/scripts/sanitize_cases.py"
  done
  step bench bench.log 300 python3 -m jaxflash.bench --dtypes bfloat16 --head-dims 64,128 \
    --seqlens 1024,4096,16384 --longest-limit 131072 --out "$OUT/bench.md"
fi
if want multi; then
  if ! want tests quick; then  # (else the GPU test suite has run them)
    step sharding sharding.log 300 python3 -m pytest -v -rf --tb=short -p no:cacheprovider -k cuda \
      "$REPO/tests/test_sharding.py"
  fi
  step multi_bench multi_bench.log 400 python3 "$REPO/benchmarks/multi_device.py"
fi
if want cli; then
  # The command line at its defaults (sized for about a minute), with its plots.
  step main_job main_job.log 200 python3 -m jaxflash --plot "$OUT/plots"
  step dropout dropout.log 240 python3 "$REPO/benchmarks/dropout_overhead.py"
  step modifiers modifiers.log 240 python3 "$REPO/benchmarks/score_modifiers.py"
  step flax_mask flax_mask.log 120 python3 "$REPO/benchmarks/flax_mask_path.py"
fi

echo
echo "==================== summary ($MODE) ===================="
cat "$OUT/device.txt"
for k in "${!STATUS[@]}"; do printf '%-14s %s\n' "$k" "${STATUS[$k]}"; done
for f in pytest pytest_big; do [ -f "$OUT/$f.log" ] && grep -E "passed|failed" "$OUT/$f.log" | tail -n 1; done
[ -f "$OUT/sharding.log" ] && grep -E "passed|failed" "$OUT/sharding.log" | tail -n 1
for f in "$OUT"/*selftest.log; do [ -f "$f" ] && printf '%-18s %s\n' "$(basename "$f" .log)" "$(grep -E "passed, .* failed" "$f")"; done
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/memcheck.log "$OUT"/racecheck.log "$OUT"/synccheck.log 2>/dev/null
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
[ -f "$OUT/dropout.log" ] && cat "$OUT/dropout.log"
[ -f "$OUT/modifiers.log" ] && cat "$OUT/modifiers.log"
[ -f "$OUT/flax_mask.log" ] && cat "$OUT/flax_mask.log"
[ -f "$OUT/multi_bench.log" ] && cat "$OUT/multi_bench.log"
exit $FAILED
