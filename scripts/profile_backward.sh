#!/usr/bin/env bash
# Build the CUDA backward self-test for sm_90a and time the bf16 backward at
# FlashAttention's benchmark shapes; with a shape, time only that one, and with
# `ncu` also profile one launch of it (full section set, report in $OUT).
#
#   scripts/profile_backward.sh                    every benchmark shape
#   scripts/profile_backward.sh 128 4096 full      one shape (D, N, causal|full)
#   scripts/profile_backward.sh 128 4096 full ncu  ... and its Nsight Compute profile
set -euo pipefail
OUT=${OUT:-/tmp/jaxflash_out}
BUILD=${BUILD:-/tmp/bwd_profile}  # EXTRA_FLAGS: more nvcc flags, e.g. -DJAXFLASH_BWD_NO_BULK
mkdir -p "$OUT" "$BUILD"
cd "$(dirname "$0")/.."
flags="-std=c++17 -O3 --use_fast_math -gencode=arch=compute_90a,code=sm_90a -I. ${EXTRA_FLAGS:-}"
ls cuda/gpu/tests/bwd_selftest.cu cuda/gpu/backward.cu cuda/gpu/instantiations/bwd_*.cu |
  xargs -P 16 -I{} sh -c "nvcc $flags -c {} -o $BUILD/\$(basename {}).o"
nvcc $flags "$BUILD"/*.o -o "$BUILD/bwd_selftest"
"$BUILD/bwd_selftest" bench-only "${@:1:3}"
if [ "${4:-}" = ncu ]; then
  ncu --set full -k regex:backward_kernel -c 1 -o "$OUT/backward_$1_$2_$3" -f \
    "$BUILD/bwd_selftest" bench-only "$1" "$2" "$3" > /dev/null
  ncu --import "$OUT/backward_$1_$2_$3.ncu-rep" --page details > "$OUT/backward_$1_$2_$3.txt"
fi
