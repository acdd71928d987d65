"""Every GPU kernel of one benchmark step, as `python -m jaxflash.bench` compiles it: jaxflash's
and XLA's (the fusions around the custom calls), with the time each takes per call, from Nsight
Compute at the running clocks. Answers "where does the step's time go besides our kernels".

  python3 scripts/profile_step.py D N causal|full fwd|fwdbwd [jaxflash|cudnn]

Runs itself under `ncu --clock-control none` (the step's calls back to back, as the bench issues
them) and prints one line per kernel name: calls per step, µs per step, and the share of the
step; the whole step's time from the same profile last. A CSV of the raw profile goes to $OUT.
"""
import collections
import csv
import functools
import os
import subprocess
import sys

CALLS = 5  # steps profiled after the warm-up


def run_steps(head_dim: int, seqlen: int, causal: bool, backward: bool, path: str) -> None:
  import jax
  import jax.numpy as jnp
  from jaxflash import bench
  attention = bench.paths()[path]
  heads, batch = 2048 // head_dim, max(1, 16384 // seqlen)
  args = bench.inputs(jax.random.key(0), batch, seqlen, heads, head_dim, jnp.bfloat16)
  fn = bench.compiled(attention, backward, causal)
  jax.block_until_ready(fn(*args))  # compile outside the profiled range's count
  for _ in range(CALLS):
    jax.block_until_ready(fn(*args))


def profile(argv: list[str]) -> None:
  out = os.environ.get("OUT", "/tmp/jaxflash_out")
  os.makedirs(out, exist_ok=True)
  csv_path = os.path.join(out, "step_" + "_".join(argv) + ".csv")
  with open(csv_path, "w") as f:
    subprocess.run(["ncu", "--clock-control", "none", "--cache-control", "none", "--csv",
                    "--page", "raw", "--metrics", "gpu__time_duration.sum",
                    sys.executable, __file__, "run", *argv], stdout=f, stderr=subprocess.STDOUT,
                   check=False)
  rows = [r for r in csv.reader(open(csv_path)) if len(r) > 5]
  head, units, data = rows[0], rows[1], rows[2:]
  col = {h: i for i, h in enumerate(head)}
  scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
  unit = scale[units[col["gpu__time_duration.sum"]]]
  # Each step launches the same kernels in the same order: the shortest period that the last
  # CALLS steps repeat is one step (the inputs' and the warm-up's kernels come before them).
  names = [r[col["Kernel Name"]] for r in data]
  times = [float(r[col["gpu__time_duration.sum"]].replace(",", "")) * unit for r in data]
  per_step = next((p for p in range(1, len(names) // CALLS + 1)
                   if names[-p * CALLS:] == names[-p:] * CALLS), 0)
  if per_step == 0:
    print("\n".join(",".join(r) for r in rows[:20]))
    raise SystemExit("ncu profiled no repeating step")
  steps = CALLS
  last = slice(len(data) - per_step * steps, len(data))
  total = collections.defaultdict(float)
  count = collections.Counter()
  for name, t in zip(names[last], times[last]):
    short = name.split("(")[0][:70]
    total[short] += t / steps
    count[short] += 1
  step_us = sum(total.values())
  print(f"{'kernel':70s} {'calls':>5s} {'us/step':>9s} {'share':>6s}")
  for name, t in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{name:70s} {count[name] // steps:5d} {t:9.1f} {t / step_us:6.1%}")
  print(f"{'step (kernels only)':70s} {'':5s} {step_us:9.1f}")


if __name__ == "__main__":
  if sys.argv[1] == "run":
    d, n, mask, direction = sys.argv[2:6]
    run_steps(int(d), int(n), mask == "causal", direction == "fwdbwd",
              sys.argv[6] if len(sys.argv) > 6 else "jaxflash")
  else:
    profile(sys.argv[1:])
