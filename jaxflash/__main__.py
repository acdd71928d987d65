"""python -m jaxflash: is jaxflash right here, and how fast is it?

Runs on whatever backend JAX has (the GPU if there is one, else the CPU):

1. a self-check: jaxflash against jax.nn.dot_product_attention on a few configurations per
   dtype, forward and gradients, each held to FlashAttention's rule (error at most twice
   jax.nn's own error in the input dtype, plus a small atol), one PASS/FAIL line each;
2. a speed and memory table: jaxflash, jax.nn's XLA path and (on a GPU) jax.nn's cuDNN path,
   jitted and timed side by side in this process (median wall time, TFLOP/s, the compiled
   program's memory footprint), forward and forward+backward;
3. with --plot DIR, PNG plots: TFLOP/s and memory against sequence length, and TFLOP/s as the
   number of heads and the batch grow (two extra sweeps, run only for the plots).

The exit status is 0 when every self-check line passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import jaxflash
from jaxflash.accuracy import error_bound, max_abs_error
from jaxflash.bench import inputs, measure

# (name, q shape BTNH, kv shape BSKH, keyword arguments); no row is fully masked in these, so
# jax.nn's convention and ours agree.
CHECKS = (
    ("MHA", (2, 128, 4, 64), (2, 128, 4, 64), {}),
    ("causal GQA, odd sizes", (2, 113, 4, 64), (2, 203, 2, 64), {"is_causal": True}),
    ("window, head dim 40", (1, 255, 2, 40), (1, 256, 2, 40), {"local_window_size": (17, 5)}),
    ("bias, head dim 128", (1, 64, 2, 128), (1, 200, 2, 128), {"bias": (1, 2, 64, 200)}),
)

# Defaults per backend, chosen so that a default run takes about a minute: most of it is
# compiling one program per path, shape and direction, so the GPU gets few, long sequences.
DEFAULTS = {
    "gpu": dict(seqlens="1024,2048,4096,8192", batch=2, heads=16, head_dim=128, dtype="bfloat16",
                repeats=5, max_xla_seqlen=8192, heads_sweep="4,8,16,32", batch_sweep="1,2,4,8",
                sweep_seqlen=2048),
    "cpu": dict(seqlens="256,512,1024", batch=1, heads=4, head_dim=64, dtype="float32",
                repeats=3, max_xla_seqlen=1024, heads_sweep="1,2,4,8", batch_sweep="1,2,4",
                sweep_seqlen=256),
}

# Piped output (logs, CI) is not wrapped at 80 columns: the tables are wider than that.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)


# ---------------------------------------------------------------- self-check

def _check_inputs(key, q_shape, kv_shape, dtype, bias_shape=None):
  keys = jax.random.split(key, 5)
  q = jax.random.normal(keys[0], q_shape, dtype)
  k = jax.random.normal(keys[1], kv_shape, dtype)
  v = jax.random.normal(keys[2], kv_shape, dtype)
  bias = None if bias_shape is None else jax.random.normal(keys[3], bias_shape, dtype)
  cotangent = jax.random.normal(keys[4], q_shape, dtype)
  return q, k, v, bias, cotangent


def _output_and_grads(attention, q, k, v, bias, cotangent, **kwargs):
  def loss(q, k, v, bias):
    out = attention(q, k, v, bias, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32)), out
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  # Not under jit: jax.nn picks its float16 matmul precision inside a try that only catches
  # errors raised eagerly (the F16_F16_F32 preset fails on CPU).
  grads, out = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
  return (out,) + tuple(grads)


def self_check(progress: Progress) -> tuple[bool, Table]:
  """Every CHECKS configuration in each dtype; (all passed, the result table)."""
  table = Table(title=f"self-check on {jax.default_backend()}: max |error| / allowed "
                      "(2 x jax.nn's own error in the dtype + atol)", title_justify="left")
  for column in ("", "dtype", "configuration", "out", "dq", "dk", "dv", "dbias"):
    table.add_column(column)
  names = ("out", "dq", "dk", "dv", "dbias")
  dtypes = (jnp.float32, jnp.float16, jnp.bfloat16)
  task = progress.add_task("self-check", total=len(dtypes) * len(CHECKS))
  all_ok = True
  for dtype in dtypes:
    for i, (name, q_shape, kv_shape, kwargs) in enumerate(CHECKS):
      kwargs = dict(kwargs)
      bias_shape = kwargs.pop("bias", None)
      q, k, v, bias, ct = _check_inputs(jax.random.key(i), q_shape, kv_shape, dtype, bias_shape)
      ours = _output_and_grads(jaxflash.attention, q, k, v, bias, ct, **kwargs)
      baseline = _output_and_grads(jax.nn.dot_product_attention, q, k, v, bias, ct, **kwargs)
      up = lambda x: None if x is None else x.astype(jnp.float32)
      with jax.default_matmul_precision("highest"):
        reference = _output_and_grads(jax.nn.dot_product_attention, up(q), up(k), up(v), up(bias),
                                      ct, **kwargs)
      cells, ok = {}, True
      for label, x, b, r in zip(names, ours, baseline, reference):
        err, bound = max_abs_error(x, r), error_bound(r, b, dtype)
        ok &= err <= bound
        cells[label] = f"{err:.1e} / {bound:.1e}"
      all_ok &= ok
      table.add_row("[green]PASS[/]" if ok else "[bold red]FAIL[/]", jnp.dtype(dtype).name, name,
                    *(cells.get(label, "-") for label in names))
      progress.advance(task)
  return all_ok, table


# ---------------------------------------------------------------- benchmarks

def paths() -> dict[str, Callable]:
  """The implementations compared on this backend."""
  found = {"jaxflash": jaxflash.attention,
           "jax.nn xla": functools.partial(jax.nn.dot_product_attention, implementation="xla")}
  if jax.default_backend() == "gpu":
    found["jax.nn cudnn"] = functools.partial(jax.nn.dot_product_attention,
                                              implementation="cudnn")
  return found


def attention_flops(batch, seqlen, heads, head_dim, backward) -> float:
  """FlashAttention's count: 4·B·H·N²·D forward, 3.5x that for forward + backward."""
  return 4.0 * batch * heads * seqlen * seqlen * head_dim * (3.5 if backward else 1.0)


def sweep(points, args, progress, description) -> list[dict]:
  """Measures every path at each (batch, seqlen, heads, backward) point; one record each."""
  records = []
  task = progress.add_task(description, total=len(points) * len(paths()))
  for batch, seqlen, heads, backward in points:
    qkv = inputs(jax.random.key(seqlen), batch, seqlen, heads, args.head_dim, args.dtype)
    for name, fn in paths().items():
      if name != "jaxflash" and seqlen > args.max_xla_seqlen:
        seconds, footprint = "skipped", None  # T×S logits per head: too slow / too big here
      else:
        seconds, footprint = measure(fn, qkv, backward, False, args.repeats)
      ok = isinstance(seconds, float)
      records.append(dict(path=name, batch=batch, seqlen=seqlen, heads=heads, backward=backward,
                          seconds=seconds if ok else None, status=None if ok else seconds,
                          tflops=attention_flops(batch, seqlen, heads, args.head_dim, backward)
                          / seconds / 1e12 if ok else None,
                          mib=footprint / 2**20 if footprint else None))
      progress.advance(task)
  return records


def speed_table(records, args) -> Table:
  names = list(paths())
  table = Table(title=f"speed and memory on {jax.devices()[0].device_kind}: batch {args.batch}, "
                      f"{args.heads} heads, head dim {args.head_dim}, {jnp.dtype(args.dtype).name}, "
                      f"median of {args.repeats}; memory = compiled program's footprint",
                title_justify="left")
  table.add_column("N", justify="right")
  table.add_column("direction")
  for name in names:
    table.add_column(f"{name}\nms", justify="right")
    table.add_column(f"{name}\nTFLOP/s", justify="right")
  for name in names[1:]:
    table.add_column(f"vs {name}", justify="right")
  for name in names:
    table.add_column(f"{name}\nMiB", justify="right")
  rows = {}
  for r in records:
    rows.setdefault((r["seqlen"], r["backward"]), {})[r["path"]] = r
  for (seqlen, backward), by_path in rows.items():
    cells = [str(seqlen), "fwd+bwd" if backward else "fwd"]
    for name in names:
      r = by_path[name]
      cells += ([f"{r['seconds'] * 1e3:.2f}", f"{r['tflops']:.3g}"] if r["seconds"]
                else [r["status"], "-"])
    ours = by_path["jaxflash"]["seconds"]
    for name in names[1:]:
      theirs = by_path[name]["seconds"]
      cells.append(f"{theirs / ours:.2f}x" if ours and theirs else "-")
    cells += [f"{by_path[name]['mib']:.0f}" if by_path[name]["mib"] else "-" for name in names]
    table.add_row(*cells)
  return table


# ---------------------------------------------------------------- plots

def write_plots(directory, table_records, heads_records, batch_records, args) -> list[str]:
  """PNG plots of the measurements; returns the paths written."""
  try:
    import matplotlib
  except ImportError as e:
    raise SystemExit("python -m jaxflash: --plot needs matplotlib (pip install matplotlib, or "
                     "pip install 'jaxflash[plot]')") from e
  matplotlib.use("Agg")
  import os

  import matplotlib.pyplot as plt

  os.makedirs(directory, exist_ok=True)
  device = jax.devices()[0].device_kind
  setting = f"{device}, {jnp.dtype(args.dtype).name}, head dim {args.head_dim}"
  written = []

  def lines(ax, records, x_key, y_key, backward):
    for name in paths():
      points = [(r[x_key], r[y_key]) for r in records
                if r["path"] == name and r["backward"] == backward and r[y_key]]
      if points:
        ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()

  def save(fig, name):
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for ax, backward in zip(axes, (False, True)):
    lines(ax, table_records, "seqlen", "tflops", backward)
    ax.set(xlabel="sequence length", ylabel="TFLOP/s",
           title=f"{'forward + backward' if backward else 'forward'}")
  fig.suptitle(f"attention throughput: batch {args.batch}, {args.heads} heads; {setting}")
  save(fig, "tflops_vs_seqlen.png")

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for ax, backward in zip(axes, (False, True)):
    lines(ax, table_records, "seqlen", "mib", backward)
    ax.set_yscale("log")
    ax.set(xlabel="sequence length", ylabel="MiB (compiled program's footprint)",
           title=f"{'forward + backward' if backward else 'forward'}")
  fig.suptitle(f"memory: batch {args.batch}, {args.heads} heads; {setting}")
  save(fig, "memory_vs_seqlen.png")

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  lines(axes[0], heads_records, "heads", "tflops", True)
  axes[0].set(xlabel="heads", ylabel="TFLOP/s", title=f"fwd+bwd, batch {args.batch}")
  lines(axes[1], batch_records, "batch", "tflops", True)
  axes[1].set(xlabel="batch", ylabel="TFLOP/s", title=f"fwd+bwd, {args.heads} heads")
  fig.suptitle(f"scaling at sequence length {args.sweep_seqlen}; {setting}")
  save(fig, "scaling.png")
  return written


# ---------------------------------------------------------------- command line

def parse_args(argv):
  backend = "gpu" if jax.default_backend() == "gpu" else "cpu"
  d = DEFAULTS[backend]
  ints = lambda s: [int(x) for x in s.split(",")]
  parser = argparse.ArgumentParser(
      prog="python -m jaxflash", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Defaults depend on the backend (shown for this one, " + backend + "; on the other: "
             + ", ".join(f"{k}={v}" for k, v in DEFAULTS["cpu" if backend == "gpu" else "gpu"].items())
             + ").\n\nexamples:\n  python -m jaxflash\n  python -m jaxflash --skip-check --plot plots/\n"
             "  python -m jaxflash --seqlens 4096,16384 --head-dim 64 --dtype float16")
  parser.add_argument("--seqlens", type=ints, default=ints(d["seqlens"]),
                      help="comma-separated sequence lengths of the table (default: %s)" % d["seqlens"])
  parser.add_argument("--batch", type=int, default=d["batch"], help="batch size (default: %(default)s)")
  parser.add_argument("--heads", type=int, default=d["heads"],
                      help="attention heads (default: %(default)s)")
  parser.add_argument("--head-dim", type=int, default=d["head_dim"],
                      help="head dim (default: %(default)s)")
  parser.add_argument("--dtype", default=d["dtype"], choices=("float32", "float16", "bfloat16"),
                      help="dtype of the table and plots (default: %(default)s)")
  parser.add_argument("--repeats", type=int, default=d["repeats"],
                      help="timed runs per cell, after one warm-up (default: %(default)s)")
  parser.add_argument("--max-xla-seqlen", type=int, default=d["max_xla_seqlen"],
                      help="longest sequence the jax.nn paths run, whose T×S logits make them slow "
                           "and large; longer cells say 'skipped' (default: %(default)s)")
  parser.add_argument("--plot", metavar="DIR",
                      help="write PNG plots to DIR (needs matplotlib): TFLOP/s and memory vs "
                           "sequence length, and scaling with heads and batch (two extra sweeps)")
  parser.add_argument("--heads-sweep", type=ints, default=ints(d["heads_sweep"]),
                      help="head counts of the scaling plot (default: %s)" % d["heads_sweep"])
  parser.add_argument("--batch-sweep", type=ints, default=ints(d["batch_sweep"]),
                      help="batch sizes of the scaling plot (default: %s)" % d["batch_sweep"])
  parser.add_argument("--sweep-seqlen", type=int, default=d["sweep_seqlen"],
                      help="sequence length of the scaling sweeps (default: %(default)s)")
  parser.add_argument("--skip-check", action="store_true", help="skip the self-check")
  parser.add_argument("--skip-bench", action="store_true",
                      help="skip the speed/memory table (and the plots)")
  args = parser.parse_args(argv)
  args.dtype = jnp.dtype(args.dtype)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  console.print(f"jaxflash {jaxflash.__version__}, kernels for {', '.join(jaxflash.backends())}; "
                f"JAX {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
  ok = True
  progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True)
  with progress:
    if not args.skip_check:
      ok, table = self_check(progress)
      progress.console.print(table)
    if not args.skip_bench:
      points = [(args.batch, n, args.heads, backward) for n in args.seqlens
                for backward in (False, True)]
      records = sweep(points, args, progress, "speed and memory")
      progress.console.print(speed_table(records, args))
      if args.plot:
        heads = sweep([(args.batch, args.sweep_seqlen, h, True) for h in args.heads_sweep], args,
                      progress, "scaling with heads")
        batch = sweep([(b, args.sweep_seqlen, args.heads, True) for b in args.batch_sweep], args,
                      progress, "scaling with batch")
        for path in write_plots(args.plot, records, heads, batch, args):
          progress.console.print(f"wrote {path}")
  if not ok:
    console.print("[bold red]self-check FAILED[/]")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
