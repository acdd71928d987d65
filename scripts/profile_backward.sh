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
# RelWithDebInfo: -lineinfo, so that Nsight Compute maps the profile to source lines.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DJAXFLASH_CUDA=ON \
  -DJAXFLASH_CUDA_ARCHITECTURES=90a -DJAXFLASH_BUILD_SELFTESTS=ON -DCMAKE_CUDA_FLAGS="${EXTRA_FLAGS:-}" >/dev/null
cmake --build "$BUILD" -j 16 --target bwd_selftest
"$BUILD/bwd_selftest" bench-only "${@:1:3}"
if [ "${4:-}" = ncu ]; then
  ncu --set full -k regex:backward_kernel -c 1 -o "$OUT/backward_$1_$2_$3" -f \
    "$BUILD/bwd_selftest" bench-only "$1" "$2" "$3" > /dev/null
  ncu --import "$OUT/backward_$1_$2_$3.ncu-rep" --page details > "$OUT/backward_$1_$2_$3.txt"
fi
