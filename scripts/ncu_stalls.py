"""Where a kernel's warps wait: Nsight Compute's warp-stall samples summed by reason, by source
file and by source line, from a report's source page (`ncu --import R --page source --csv
--print-source cuda,sass`; needs a -lineinfo build, which scripts/profile_kernel.sh makes).
The totals count each instruction once; an inlined instruction is listed under every line of its
inlining chain (the helper's and its caller's), so the lines' shares overlap.

  python3 scripts/ncu_stalls.py SOURCE.csv [--lines 30]
"""

from __future__ import annotations

import argparse
import collections
import csv


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("csv", help="the source page as CSV")
  parser.add_argument("--lines", type=int, default=30, help="how many source lines to list")
  args = parser.parse_args(argv)
  samples = collections.Counter()  # (file, line) -> all samples
  reasons = collections.defaultdict(collections.Counter)  # (file, line) -> reason -> samples
  instructions = {}  # address -> (samples, reason -> samples), each instruction once
  count = lambda v: int(v.replace(",", "")) if v.replace(",", "").isdigit() else 0
  path, header = None, None
  with open(args.csv, newline="") as f:
    for row in csv.reader(f):
      if not row:
        continue
      if row[0] == "File Path":
        path = row[1].rsplit("/", 1)[-1]
        continue
      if row[0] == "Line No":
        header = row
        continue
      if not header or len(row) != len(header):
        continue
      n = count(row[4])  # "Warp Stall Sampling (All Samples)"
      stalls = collections.Counter({name[len("stall_"):]: count(v) for name, v in zip(header, row)
                                    if name.startswith("stall_") and "(" not in name})
      if row[0].isdigit():  # a source line (a file's totals have no line number)
        samples[(path, int(row[0]))] += n
        reasons[(path, int(row[0]))].update(stalls)
      elif row[2].startswith("0x"):  # one of its instructions
        instructions[row[2]] = (n, stalls)
  total = sum(n for n, _ in instructions.values())
  if not total:
    print("no stall samples in", args.csv)
    return 1
  by_reason = collections.Counter()
  for _, stalls in instructions.values():
    by_reason.update(stalls)
  print(f"{total} warp-stall samples")
  print("by reason: " + ", ".join(f"{r} {100 * n / total:.1f}%" for r, n in by_reason.most_common(10)))
  for (p, line), n in samples.most_common(args.lines):
    top = ", ".join(f"{r} {100 * m / n:.0f}%" for r, m in reasons[(p, line)].most_common(3) if m)
    print(f"{100 * n / total:5.1f}%  {p}:{line}  ({top})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
