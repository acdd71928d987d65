#!/usr/bin/env bash
# Builds here (nvcc only, no GPU) what a device call would otherwise spend ~150 s of its time
# building: jaxflash's wheel for the device's Python (3.12) and sm_90a, and the native
# self-tests, into DIR, which the device tool carries (`carry: [DIR]`) and
# `JAXFLASH_PREBUILT=DIR scripts/gpu_check.sh ...` installs and runs.
#
#   scripts/build_prebuilt.sh [DIR]            this checkout: wheel + the four self-tests
#   scripts/build_prebuilt.sh DIR SRC          another source tree (an A/B baseline, e.g.
#                                              `git archive main | tar -x -C SRC`): its fwd and
#                                              bwd self-tests only, for scripts/ab_kernels.sh DIR
# DIR defaults to .prebuilt (git-ignored). PYTHON: a Python 3.12 (default: pyenv's); its venv
# (build requirements: nanobind, scikit-build-core, the jaxlib of pyproject.toml) is made once
# under /tmp. ARCH: the CUDA architectures (default 90a). On 2 cores the whole build takes
# ~11 min, the baseline's self-tests ~5 (measured 2026-11-28, nothing else running).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=$(mkdir -p "${1:-$REPO/.prebuilt}" && cd "${1:-$REPO/.prebuilt}" && pwd)
SRC=$(cd "${2:-$REPO}" && pwd)
ARCH=${ARCH:-90a}
PYTHON=${PYTHON:-$(pyenv prefix 3.12 2>/dev/null)/bin/python3.12}
VENV=/tmp/jaxflash_prebuilt_venv
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  jaxlib=$(grep -oE '"jaxlib==[0-9.]+"' "$REPO/pyproject.toml" | tr -d '"')
  "$VENV/bin/pip" install -q nanobind scikit-build-core ninja cmake "$jaxlib"
fi
BUILD=${BUILD:-/tmp/jaxflash_prebuilt_$(echo "$SRC" | md5sum | cut -c1-8)}  # kept: later builds are incremental
export PATH="$VENV/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [ "$SRC" = "$REPO" ]; then
  rm -f "$DIR"/jaxflash-*.whl
  (cd "$SRC" && pip wheel --no-build-isolation --no-deps -w "$DIR" -Cbuild-dir="$BUILD" \
    -Ccmake.define.JAXFLASH_CUDA=ON -Ccmake.define.JAXFLASH_CUDA_ARCHITECTURES="$ARCH" \
    -Ccmake.define.JAXFLASH_BUILD_SELFTESTS=ON .)
  targets=(fwd_selftest fwd_mma_selftest bwd_selftest bwd_mma_selftest)
else
  cmake -S "$SRC" -B "$BUILD" -G Ninja -DJAXFLASH_CUDA=ON -DJAXFLASH_CUDA_ARCHITECTURES="$ARCH" \
    -DJAXFLASH_BUILD_SELFTESTS=ON -DPython_EXECUTABLE="$VENV/bin/python" >/dev/null
  targets=(fwd_selftest bwd_selftest)
fi
cmake --build "$BUILD" --target "${targets[@]}"
# The device tool carries 64 MiB: the self-tests go xz-compressed (~14 MB each where the
# binaries hold ~54 MB of kernels: scripts/prebuilt.py unpacks them on the device) and the
# wheel's extension LZMA-compressed inside the wheel (31 -> 22.6 MB; pip reads it as any wheel).
for t in "${targets[@]}"; do xz -9 -T0 -c "$BUILD/$t" >"$DIR/$t.xz"; done
[ "$SRC" != "$REPO" ] || python3 "$REPO/scripts/prebuilt.py" repack "$DIR"/jaxflash-*.whl
{ echo "prebuilt: $(cd "$SRC" && git rev-parse --short HEAD 2>/dev/null || echo "$SRC") for sm_$ARCH," \
    "nvcc $(nvcc --version | grep -oE 'release [0-9.]+'), $(date -u +%F)"
  (cd "$SRC" && git status --porcelain 2>/dev/null | grep -q . && echo "  (with uncommitted changes)") || true
} >"$DIR/build_info.txt"
cat "$DIR/build_info.txt"
ls -la "$DIR"
