#!/usr/bin/env bash
# A/B timing of the CUDA forward kernel: builds fwd_selftest from another source tree (A, e.g.
# an earlier commit unpacked with `git archive REV | tar -x -C DIR`) and from this checkout (B),
# for the visible GPU, then alternates their benchmarks (FlashAttention's bf16 shapes) ROUNDS
# times, so that clock and thermal drift hit both alike, and prints each cell's median TFLOP/s
# and B/A. Same process of measurement for both, one GPU: ratios, not absolute figures.
#
#   scripts/ab_forward.sh A_DIR [ROUNDS]
set -euo pipefail
A_SRC=$(cd "$1" && pwd)
ROUNDS=${2:-3}
B_SRC=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/jaxflash_out}
mkdir -p "$OUT"
for side in A B; do
  src=$([ $side = A ] && echo "$A_SRC" || echo "$B_SRC")
  cmake -S "$src" -B "/tmp/ab_$side" -G Ninja -DJAXFLASH_CUDA=ON -DJAXFLASH_BUILD_SELFTESTS=ON \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/ab_configure_$side.log"
  cmake --build "/tmp/ab_$side" -j 16 --target fwd_selftest >"$OUT/ab_build_$side.log"
done
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    # "bench" also runs the correctness cases first: both sides must still pass them.
    "/tmp/ab_$side/fwd_selftest" bench | grep "TFLOP/s" | sed "s/^/$side /" >>"$OUT/ab_forward.txt"
  done
done
python3 - "$OUT/ab_forward.txt" <<'EOF'
import collections, re, statistics, sys
cells = collections.defaultdict(lambda: {"A": [], "B": []})
for line in open(sys.argv[1]):
  side, rest = line.split(" ", 1)
  shape = re.sub(r"\s+[\d.]+ ms.*", "", rest).strip()
  cells[shape][side].append(float(re.search(r"([\d.]+) TFLOP/s", rest)[1]))
print(f"{'cell':28} {'A TFLOP/s':>10} {'B TFLOP/s':>10} {'B/A':>6}")
for shape, runs in cells.items():
  a, b = statistics.median(runs["A"]), statistics.median(runs["B"])
  print(f"{shape:28} {a:10.1f} {b:10.1f} {b / a:6.3f}")
EOF
