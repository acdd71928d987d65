#!/usr/bin/env bash
# A/B timing of a CUDA kernel direction: builds fwd_selftest or bwd_selftest from another source
# tree (A, e.g. an earlier commit unpacked with `git archive REV | tar -x -C DIR`) and from this
# checkout (B), for the visible GPU, then alternates their benchmarks (FlashAttention's bf16
# shapes) ROUNDS times, so that clock and thermal drift hit both alike, and prints each cell's
# median TFLOP/s and B/A. Same process of measurement for both, one GPU: ratios, not absolute
# figures.
#
#   scripts/ab_kernels.sh A_DIR [ROUNDS] [fwd|bwd|bwd_mma ...]   (default: 3 rounds, fwd)
# (bwd_mma: the backward without its sm_90 kernel.) A side whose directory already holds the
# self-test binaries (A_DIR, or for B the JAXFLASH_PREBUILT folder: scripts/build_prebuilt.sh)
# runs those instead of building.
set -euo pipefail
A_SRC=$(cd "$1" && pwd)
ROUNDS=${2:-3}
DIRECTIONS=("${@:3}")
[ ${#DIRECTIONS[@]} -gt 0 ] || DIRECTIONS=(fwd)
B_SRC=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/jaxflash_out}
mkdir -p "$OUT"
targets=$(printf '%s_selftest ' "${DIRECTIONS[@]}")
for side in A B; do  # each side's self-test binaries into /tmp/ab_$side
  src=$([ $side = A ] && echo "$A_SRC" || echo "$B_SRC")
  prebuilt=$([ $side = A ] && echo "$A_SRC" || echo "${JAXFLASH_PREBUILT:+$(cd "$JAXFLASH_PREBUILT" && pwd)}")
  unpack=1
  for t in $targets; do [ -n "$prebuilt" ] && [ -f "$prebuilt/$t.xz" ] || unpack=0; done
  if [ $unpack = 1 ]; then
    python3 "$B_SRC/scripts/prebuilt.py" unpack "$prebuilt" "/tmp/ab_$side" >/dev/null
    continue
  fi
  cmake -S "$src" -B "/tmp/ab_$side" -G Ninja -DJAXFLASH_CUDA=ON -DJAXFLASH_BUILD_SELFTESTS=ON \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/ab_configure_$side.log"
  # shellcheck disable=SC2086
  cmake --build "/tmp/ab_$side" -j 16 --target $targets >"$OUT/ab_build_$side.log"
done
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    for dir in "${DIRECTIONS[@]}"; do
      # The forward's "bench" runs its correctness cases first (3 s): both sides must pass them.
      # The backward's take a minute, so it times only; gpu_check.sh runs them.
      mode=$([ "$dir" = fwd ] && echo bench || echo bench-only)
      "/tmp/ab_$side/${dir}_selftest" "$mode" | grep "TFLOP/s" | sed "s/^/$side $dir /" >>"$OUT/ab_kernels.txt"
    done
  done
done
python3 - "$OUT/ab_kernels.txt" <<'EOF'
import collections, re, statistics, sys
cells = collections.defaultdict(lambda: {"A": [], "B": []})
for line in open(sys.argv[1]):
  side, rest = line.split(" ", 1)
  shape = re.sub(r"\s+[\d.]+ ms.*", "", rest).strip()
  cells[shape][side].append(float(re.search(r"([\d.]+) TFLOP/s", rest)[1]))
print(f"{'cell':32} {'A TFLOP/s':>10} {'B TFLOP/s':>10} {'B/A':>6}")
for shape, runs in cells.items():
  if not runs["A"] or not runs["B"]:  # a shape only one side times (e.g. a head dim it lacks)
    only = "A" if runs["A"] else "B"
    print(f"{shape:32} {only} only: {statistics.median(runs[only]):.1f}")
    continue
  a, b = statistics.median(runs["A"]), statistics.median(runs["B"])
  print(f"{shape:32} {a:10.1f} {b:10.1f} {b / a:6.3f}")
EOF
