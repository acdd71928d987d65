#!/usr/bin/env bash
# Build a CUDA self-test for sm_90a and time one direction's bf16 kernel at
# FlashAttention's benchmark shapes (the forward also at D = 256); with a shape,
# time only that one, and with `ncu` also profile one launch of its main kernel
# (full section set; the report, its details page, its source page and a short
# summary with the warp-stall reasons and lines, scripts/ncu_stalls.py, in $OUT).
#
#   scripts/profile_kernel.sh fwd|bwd                      every benchmark shape
#   scripts/profile_kernel.sh bwd 128 4096 full            one shape (D, N, causal|full)
#   scripts/profile_kernel.sh fwd 128 4096 causal ncu      ... and its Nsight Compute profile
#   scripts/profile_kernel.sh bwd 128 4096 full split      ... and each kernel's share of one call
#                                                          (memset, pre-pass, main, post-pass)
#   scripts/profile_kernel.sh bwd 128 1024 full timeline   ... and where the sm_90 backward's CTAs
#                                                          spend their lives (cuda/gpu/timeline.h)
#   scripts/profile_kernel.sh fwd 128 1024 full timeline   ... and the sm_90 forward's phases per
#                                                          query tile (cuda/gpu/timeline.h)
#   PACKED=1 scripts/profile_kernel.sh fwd|bwd 128 1024 causal ...   the shape's rows packed
#                                                          into one by segment ids
set -euo pipefail
DIRECTION=${1:?usage: $0 fwd|bwd [D N causal|full [ncu]]}
shift
case "$DIRECTION" in
  fwd) KERNEL='regex:forward_(sm90_)?kernel' ;;
  bwd) KERNEL='regex:backward_(sm90_)?kernel' ;;
  *) echo "usage: $0 fwd|bwd [D N causal|full [ncu]]"; exit 2 ;;
esac
OUT=${OUT:-/tmp/jaxflash_out}
BUILD=${BUILD:-/tmp/kernel_profile}  # EXTRA_FLAGS: more nvcc flags, e.g. -DJAXFLASH_BWD_NO_BULK
if [ "${4:-}" = timeline ]; then  # a build of its own: the stamps are compiled in
  EXTRA_FLAGS="${EXTRA_FLAGS:-} -DJAXFLASH_$(echo "$DIRECTION" | tr a-z A-Z)_TIMELINE"
  BUILD=$BUILD.timeline
fi
mkdir -p "$OUT" "$BUILD"
cd "$(dirname "$0")/.."
# RelWithDebInfo: -lineinfo, so that Nsight Compute maps the profile to source lines.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DJAXFLASH_CUDA=ON \
  -DJAXFLASH_CUDA_ARCHITECTURES=90a -DJAXFLASH_BUILD_SELFTESTS=ON -DCMAKE_CUDA_FLAGS="${EXTRA_FLAGS:-}" >/dev/null
cmake --build "$BUILD" -j 16 --target "${DIRECTION}_selftest"
"$BUILD/${DIRECTION}_selftest" bench-only "${@:1:3}" ${PACKED:+packed}
if [ "${4:-}" = split ]; then
  # Every kernel of the first calls (the bench warms up with 3), at the running clocks and with
  # the caches as the call leaves them: duration, DRAM bytes and SM activity per kernel.
  name="${DIRECTION}_$1_$2_$3${PACKED:+_packed}"
  ncu --clock-control none --cache-control none -c 12 --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_active.avg,sm__cycles_elapsed.max \
    "$BUILD/${DIRECTION}_selftest" bench-only "$1" "$2" "$3" ${PACKED:+packed} > "$OUT/$name.split.csv" 2>&1 || true
  python3 - "$OUT/$name.split.csv" <<'PY' | tee "$OUT/$name.split.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(head)}
num = lambda x: float(x.replace(",", ""))  # ncu writes thousands separators
print(f"{'kernel':48s} {'us':>8s} {'DRAM rd MB':>10s} {'wr MB':>8s} {'SM active':>9s}")
for r in data:
  dur = num(r[col["gpu__time_duration.sum"]]) * {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3}[
      units[col["gpu__time_duration.sum"]]]
  mb = lambda m: num(r[col[m]]) / {"byte": 1e6, "B": 1e6, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1, "MB": 1, "Gbyte": 1e-3, "GB": 1e-3}[units[col[m]]]
  act = num(r[col["sm__cycles_active.avg"]]) / max(num(r[col["sm__cycles_elapsed.max"]]), 1)
  print(f"{r[col['Kernel Name']][:48]:48s} {dur:8.1f} {mb('dram__bytes_read.sum'):10.1f} "
        f"{mb('dram__bytes_write.sum'):8.1f} {act:9.2f}")
PY
fi
if [ "${4:-}" = ncu ]; then
  name="${DIRECTION}_$1_$2_$3${PACKED:+_packed}"
  ncu --set full -k "$KERNEL" -c 1 -o "$OUT/$name" -f "$BUILD/${DIRECTION}_selftest" bench-only "$1" "$2" "$3" ${PACKED:+packed} \
    > /dev/null
  ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name.txt"
  # The facts DESIGN.md quotes: throughput, tensor and MUFU pipes, occupancy, registers, stalls.
  grep -E "Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc Active|Duration" \
    "$OUT/$name.txt" | sed 's/  */ /g' | tee "$OUT/$name.summary.txt"
  ncu --import "$OUT/$name.ncu-rep" --page raw --csv \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_wait,smsp__average_warp_latency_issue_stalled_math_pipe_throttle \
    2>&1 | tee -a "$OUT/$name.summary.txt" || true
  # Where the warps wait, by reason and source line.
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source cuda,sass > "$OUT/$name.source.csv"
  python3 scripts/ncu_stalls.py "$OUT/$name.source.csv" | tee -a "$OUT/$name.summary.txt"
fi
