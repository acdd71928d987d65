"""python -m jaxflash: is jaxflash right on this machine, and how fast is it?

Runs on the backend JAX picked (the GPU if there is one, else the CPU), after a header that
says what this build of jaxflash is (its version, the CUDA architectures its kernels were built
for, the XLA FFI API it was built against, which instruction sets its CPU kernels run with) and
what JAX runs on:

1. a self-check: jaxflash against jax.nn.dot_product_attention on a few configurations in each
   of float32, float16 and bfloat16, forward and gradients. Each result is held to
   FlashAttention's rule: against a float32 reference, jaxflash's error may be at most twice
   jax.nn's own error in the input dtype, plus a small atol (jaxflash/accuracy.py). One
   PASS/FAIL line per configuration, with the error and the allowed error of each output;
2. a speed and memory table: jaxflash, jax.nn's XLA path and, on a GPU, jax.nn's cuDNN path,
   jitted and timed side by side in this process, forward and forward+backward (causal
   attention with --causal): median and fastest time, FLOP/s (bench.attention_flops; in
   TFLOP/s, or GFLOP/s where TFLOP/s would read 0.0), the compiled program's memory footprint,
   and jaxflash's speedup over each (of the medians);
3. with --plot DIR (or --scaling), two more sweeps: the number of heads and the batch size
   grow at a fixed sequence length. --plot writes PNG plots: FLOP/s and memory against
   sequence length, and the scaling with heads and batch (needs matplotlib).

--json FILE also writes all of it, machine-readable: the build, JAX and the device, the
options, every self-check result and every timing cell.

Most of a run is compiling: one program per path, shape and direction, so the defaults, chosen
per backend, keep the shapes few and finish in about a minute. The exit status is 0 when every
self-check line passes (or --skip-check), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import jaxflash
from jaxflash import bench, kernels
from jaxflash.accuracy import error_bound, max_abs_error

# (name, q shape BTNH, kv shape BSKH, keyword arguments, with "bias" a shape); no row is fully
# masked in these, so jax.nn's convention and jaxflash's agree.
CHECKS = (
    ("MHA", (2, 128, 4, 64), (2, 128, 4, 64), {}),
    ("causal GQA, odd sizes", (2, 113, 4, 64), (2, 203, 2, 64), {"is_causal": True}),
    ("window, head dim 40", (1, 255, 2, 40), (1, 256, 2, 40), {"local_window_size": (17, 5)}),
    ("bias, head dim 128", (1, 64, 2, 128), (1, 200, 2, 128), {"bias": (1, 2, 64, 200)}),
)
CHECK_DTYPES = ("float32", "float16", "bfloat16")
CHECK_RESULTS = ("out", "dq", "dk", "dv", "dbias")

# Defaults per backend ("gpu" or "cpu"), each chosen so that a default run takes about a
# minute. On a GPU compiling dominates (one program per path, shape and direction), so it gets
# four sequence lengths, and the sweeps share the table's batch and heads, so that one point of
# each is a table cell already. The CPU's kernels run at GFLOP/s: it gets short sequences, and
# jax.nn's XLA path, which stores the T×S logits, a limit. A max_xla_seqlen of None: no limit.
# The CPU times a call of a few milliseconds anywhere from 1x to 2x of its fastest (other work
# on the cores, caches): with 3 runs a cell's speedup swung from 0.6x to 2.2x between runs of
# this command; with 100 it repeats within about 10% (no closer with 200), and a default run
# takes about 30 s on two cores, half of it timing.
DEFAULTS = {
    "gpu": dict(seqlens=(512, 1024, 2048, 4096), batch=2, heads=16, head_dim=128,
                dtype="bfloat16", repeats=10, max_xla_seqlen=None, heads_sweep=(4, 8, 16, 32),
                batch_sweep=(1, 2, 4, 8), sweep_seqlen=2048),
    "cpu": dict(seqlens=(256, 512, 1024), batch=1, heads=4, head_dim=64, dtype="float32",
                repeats=100, max_xla_seqlen=4096, heads_sweep=(1, 2, 4, 8),
                batch_sweep=(1, 2, 4), sweep_seqlen=256),
}

# jaxflash's CUDA kernels serve JAX's "gpu" backend; its CPU kernels the "cpu" backend.
KERNELS_FOR_BACKEND = {"gpu": "cuda", "cpu": "cpu"}

# How the table and plots name bench.paths()'s implementations.
PATH_LABELS = {"jaxflash": "jaxflash", "xla": "jax.nn XLA", "cudnn": "jax.nn cuDNN"}

# Piped output (logs, CI) is not wrapped at 80 columns: the tables are wider than that.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)


# ---------------------------------------------------------------- self-check

def _check_inputs(seed, q_shape, kv_shape, bias_shape, dtype):
  """q, k, v, bias (None without a bias shape) and the output's cotangent, rounded to dtype.

  Drawn by numpy on the host: a jax.random call would compile a device program per shape.
  """
  rng = np.random.default_rng(seed)
  shapes = (q_shape, kv_shape, kv_shape, bias_shape, q_shape)
  return tuple(None if shape is None else rng.standard_normal(shape, np.float32).astype(dtype)
               for shape in shapes)


def _output_and_grads(attention: Callable, options: tuple) -> Callable:
  """A function of (q, k, v, bias, cotangent) returning attention's output and its gradients."""
  def output_and_grads(q, k, v, bias, cotangent):
    def loss(q, k, v, bias):
      out = attention(q, k, v, bias, **dict(options))
      return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32)), out
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    grads, out = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
    return (out,) + tuple(grads)
  return output_and_grads


@functools.cache
def _compiled_output_and_grads(attention: Callable, options: tuple) -> Callable:
  """_output_and_grads as one jitted program: run op by op, every operation of every
  configuration would be compiled on its own. Cached per (function, options), so the float32
  reference of the three dtypes, which has the same shapes, compiles once per configuration.

  On a GPU, XLA's autotuning (timing candidate GEMM kernels on the device while compiling)
  only buys speed, which the self-check does not measure, at a large share of its compile
  time: it is turned off for these programs.
  """
  compiler_options = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None
  return jax.jit(_output_and_grads(attention, options), compiler_options=compiler_options)


def _run_jax_nn(options, inputs):
  try:
    return _compiled_output_and_grads(jax.nn.dot_product_attention, options)(*inputs)
  except ValueError:
    # jax.nn asks for the F16_F16_F32 dot algorithm in float16 and falls back to the default
    # one inside a try that only catches errors raised eagerly; under jit the CPU's refusal
    # surfaces at lowering instead. Eagerly, the fallback works.
    return _output_and_grads(jax.nn.dot_product_attention, options)(*inputs)


@dataclasses.dataclass(frozen=True)
class CheckResult:
  """One CHECKS configuration in one dtype: per output (of CHECK_RESULTS, those it has)
  jaxflash's max |error| against a float32 reference, and the error allowed."""
  dtype: str
  configuration: str
  q_shape: tuple[int, ...]
  kv_shape: tuple[int, ...]
  options: dict  # CHECKS' keyword arguments, "bias" a shape
  errors: dict[str, tuple[float, float]]  # output -> (error, allowed)

  @property
  def passed(self) -> bool:
    return all(error <= allowed for error, allowed in self.errors.values())


def self_check(progress: Progress) -> list[CheckResult]:
  """Every CHECKS configuration in each CHECK_DTYPES dtype."""
  task = progress.add_task("self-check", total=len(CHECK_DTYPES) * len(CHECKS))
  upcast = lambda x: None if x is None else x.astype(np.float32)
  results = []
  for dtype in CHECK_DTYPES:
    for seed, (name, q_shape, kv_shape, kwargs) in enumerate(CHECKS):
      progress.update(task, description=f"self-check: {dtype}, {name}")
      options = tuple(sorted((k, v) for k, v in kwargs.items() if k != "bias"))
      inputs = _check_inputs(seed, q_shape, kv_shape, kwargs.get("bias"), jnp.dtype(dtype))
      ours = _compiled_output_and_grads(jaxflash.attention, options)(*inputs)
      baseline = _run_jax_nn(options, inputs)
      with jax.default_matmul_precision("highest"):
        reference = _run_jax_nn(options, tuple(map(upcast, inputs)))
      errors = {output: (max_abs_error(x, r), error_bound(r, b, dtype))
                for output, x, b, r in zip(CHECK_RESULTS, ours, baseline, reference)}
      results.append(CheckResult(dtype, name, q_shape, kv_shape, kwargs, errors))
      progress.advance(task)
  return results


def check_table(results: list[CheckResult]) -> Table:
  """One PASS/FAIL row per result: each output's error / the allowed error."""
  table = Table(title=f"self-check on {_device_name()}: jaxflash against jax.nn.dot_product_"
                      "attention, forward and gradients", title_justify="left",
                caption="cells: jaxflash's max |error| / the allowed error, against a float32 "
                        "reference; allowed: 2 x jax.nn's own error in the dtype + atol",
                caption_justify="left")
  for column in ("", "dtype", "configuration", *CHECK_RESULTS):
    table.add_column(column)
  for result in results:
    cells = []
    for output in CHECK_RESULTS:
      if output not in result.errors:
        cells.append("-")
        continue
      error, allowed = result.errors[output]
      cells.append(f"{error:.1e} / {allowed:.1e}" if error <= allowed
                   else f"[bold red]{error:.1e}[/] / {allowed:.1e}")
    table.add_row("[green]PASS[/]" if result.passed else "[bold red]FAIL[/]", result.dtype,
                  result.configuration, *cells)
  return table


# ---------------------------------------------------------------- benchmarks

@dataclasses.dataclass(frozen=True)
class Measurement:
  """One path timed at one shape and direction: the median and the fastest of its timed runs
  and the compiled program's footprint; these are None when it did not run, and status then
  says why for the table ("skipped", "OOM" or "-"). flops: bench.attention_flops."""
  path: str
  batch: int
  seqlen: int
  heads: int
  backward: bool
  flops: float
  seconds: float | None = None
  min_seconds: float | None = None
  mib: float | None = None
  status: str = ""

  @property
  def flop_per_s(self) -> float | None:
    """Of the median time."""
    return self.flops / self.seconds if self.seconds else None


def _is_out_of_memory(error: Exception) -> bool:
  message = str(error)
  return "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()


class Benchmark:
  """Times every path at the points it is given, remembering each measurement, so that a
  sweep point that is also a table cell is not compiled and timed twice."""

  def __init__(self, args, progress: Progress):
    self.args = args
    self.progress = progress
    self.paths = bench.paths()
    self.measured: dict[tuple, Measurement] = {}
    self.failures: dict[str, str] = {}  # path label -> first line of its first error

  def sweep(self, points, description) -> list[Measurement]:
    """Measures every path at each (batch, seqlen, heads, backward) point."""
    todo = [(point, path) for point in points for path in self.paths
            if (path, *point) not in self.measured]
    task = self.progress.add_task(description, total=len(todo))
    shape = qkv = None  # the inputs of the latest shape: one set on the device at a time
    for (batch, seqlen, heads, backward), path in todo:
      self.progress.update(task, description=f"{description}: {PATH_LABELS[path]}, batch "
                           f"{batch}, N {seqlen}, {heads} heads, {_direction(backward)}")
      if shape != (batch, seqlen, heads):
        shape, qkv = (batch, seqlen, heads), None  # the old inputs go before the new come
        qkv = bench.inputs(jax.random.key(seqlen), batch, seqlen, heads, self.args.head_dim,
                           self.args.dtype)
      self.measured[(path, batch, seqlen, heads, backward)] = self._measure(
          path, batch, seqlen, heads, backward, qkv)
      self.progress.advance(task)
    self.progress.remove_task(task)
    return [self.measured[(path, *point)] for point in points for path in self.paths]

  def _measure(self, path, batch, seqlen, heads, backward, qkv) -> Measurement:
    causal = self.args.causal
    cell = functools.partial(Measurement, path, batch, seqlen, heads, backward,
                             bench.attention_flops(batch, seqlen, heads, self.args.head_dim,
                                                   causal=causal, backward=backward))
    max_xla = self.args.max_xla_seqlen
    if path == "xla" and max_xla is not None and seqlen > max_xla:
      return cell(status="skipped")  # T×S logits per head: slow and large
    program = bench.compiled(self.paths[path], backward, causal)
    try:
      times = bench.run_seconds(program, qkv, self.args.repeats)
      footprint = bench.footprint_bytes(program, qkv)
    except Exception as error:  # noqa: BLE001 - out of memory, or a case the path cannot run
      self.failures.setdefault(PATH_LABELS[path],
                               f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
      return cell(status="OOM" if _is_out_of_memory(error) else "-")
    return cell(statistics.median(times), min(times), footprint / 2**20)


def _direction(backward: bool) -> str:
  return "fwd+bwd" if backward else "fwd"


def _device_name() -> str:
  device = jax.devices()[0]
  return f"CPU, {os.cpu_count()} threads" if device.platform == "cpu" else device.device_kind


def _ms_text(ms: float) -> str:
  return f"{ms:,.0f}" if ms >= 99.5 else f"{ms:#.3g}"  # 3 digits: "0.0512", "5.10", "51.0"


def _mib_text(mib: float) -> str:
  return f"{mib:,.0f}" if mib >= 10 else f"{mib:.1f}"


def rate_unit(measurements) -> tuple[str, float]:
  """The unit the FLOP/s of these measurements are shown in, and its size in FLOP/s: TFLOP/s,
  or GFLOP/s where the fastest would read below 1 TFLOP/s (a CPU's kernels)."""
  fastest = max((m.flop_per_s for m in measurements if m.flop_per_s), default=0.0)
  return ("TFLOP/s", 1e12) if fastest >= 1e12 else ("GFLOP/s", 1e9)


def speed_table(measurements, varying: str, title: str, caption: str | None = None) -> Table:
  """One row per direction and value of `varying` ("seqlen", "heads" or "batch"); per path its
  median and fastest time, FLOP/s (in rate_unit's unit) and memory, then jaxflash's speedup
  over each other path (of the median times)."""
  paths = list(dict.fromkeys(m.path for m in measurements))
  others = [path for path in paths if path != "jaxflash"]
  rate_name, rate_size = rate_unit(measurements)
  table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
  table.add_column("direction")
  table.add_column({"seqlen": "N", "heads": "heads", "batch": "batch"}[varying], justify="right")
  for path in paths:
    style = "bold" if path == "jaxflash" else None
    for unit in ("ms", "min ms", rate_name, "MiB"):
      table.add_column(f"{PATH_LABELS[path]}\n{unit}", justify="right", style=style)
  for path in others:
    table.add_column(f"speedup\nvs {PATH_LABELS[path]}", justify="right")
  rows: dict[tuple, dict[str, Measurement]] = {}
  for m in sorted(measurements, key=lambda m: (m.backward, getattr(m, varying))):
    rows.setdefault((m.backward, getattr(m, varying)), {})[m.path] = m
  previous_direction = None
  for (backward, value), by_path in rows.items():
    if previous_direction is not None and backward != previous_direction:
      table.add_section()
    previous_direction = backward
    cells = [_direction(backward), str(value)]
    for path in paths:
      m = by_path[path]
      cells += ([_ms_text(m.seconds * 1e3), _ms_text(m.min_seconds * 1e3),
                 f"{m.flop_per_s / rate_size:.3g}", _mib_text(m.mib)] if m.seconds
                else [m.status, "-", "-", "-"])
    ours = by_path["jaxflash"].seconds
    for path in others:
      theirs = by_path[path].seconds
      speedup = theirs / ours if ours and theirs else None
      cells.append("-" if speedup is None else
                   f"[green]{speedup:.2f}x[/]" if speedup >= 1 else f"[red]{speedup:.2f}x[/]")
    table.add_row(*cells)
  return table


# ---------------------------------------------------------------- plots

def _pyplot():
  """matplotlib.pyplot on the Agg backend (files, no display). matplotlib is an optional
  dependency, so it is imported only for --plot, and before anything is measured."""
  try:
    import matplotlib
  except ImportError as error:
    raise SystemExit("python -m jaxflash: --plot needs matplotlib: pip install matplotlib "
                     "(or pip install 'jaxflash[plot]')") from error
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def write_plots(plt, directory, by_seqlen, by_heads, by_batch, args) -> list[str]:
  """tflops_vs_seqlen.png, memory_vs_seqlen.png and scaling.png in directory; their paths."""
  from matplotlib.ticker import FuncFormatter  # matplotlib is there: main imported it

  setting = (f"{_device_name()}, {args.dtype.name}, head dim {args.head_dim}"
             f"{', causal' if args.causal else ''}")
  paths = list(dict.fromkeys(m.path for m in by_seqlen))
  colors = {path: f"C{i}" for i, path in enumerate(paths)}
  written = []

  def lines(ax, measurements, varying, value, backward, ylabel, log_y=False):
    """One line per path of value(measurement); a path's cells that did not run are named in
    its legend entry."""
    for path in paths:
      mine = [m for m in measurements if m.path == path and m.backward == backward]
      points = [(getattr(m, varying), value(m)) for m in mine if m.seconds]
      missing = [f"{m.status} at {getattr(m, varying)}" for m in mine if not m.seconds]
      label = PATH_LABELS[path] + (f" ({', '.join(missing)})" if missing else "")
      if points:
        ax.plot(*zip(*points), marker="o", color=colors[path], label=label)
    values = sorted({getattr(m, varying) for m in measurements})
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()
    if log_y:  # plain numbers at 1, 2 and 5 times a power of ten, not 10^k notation
      ax.set_yscale("log")
      ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
      ax.yaxis.set_minor_formatter(FuncFormatter(
          lambda y, _: f"{y:g}" if round(y / 10**math.floor(math.log10(y))) in (2, 5) else ""))
    else:
      ax.set_ylim(bottom=0)
    ax.set_xlabel({"seqlen": "sequence length N", "heads": "heads",
                   "batch": "batch size"}[varying])
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()

  def save(fig, name, title):
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(directory, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

  def rate(measurements):
    """The value function and axis label of FLOP/s in rate_unit's unit."""
    name, size = rate_unit(measurements)
    return lambda m: m.flop_per_s / size, name

  shape = f"batch {args.batch}, {args.heads} heads"
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  value, unit = rate(by_seqlen)
  for ax, backward in zip(axes, (False, True)):
    lines(ax, by_seqlen, "seqlen", value, backward, unit)
    ax.set_title("forward + backward" if backward else "forward")
  save(fig, "tflops_vs_seqlen.png", f"attention throughput: {shape}; {setting}")

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  for ax, backward in zip(axes, (False, True)):
    lines(ax, by_seqlen, "seqlen", lambda m: m.mib, backward, "MiB (compiled program's footprint)",
          log_y=True)
    ax.set_title("forward + backward" if backward else "forward")
  save(fig, "memory_vs_seqlen.png", f"attention memory: {shape}; {setting}")

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  value, unit = rate(by_heads + by_batch)
  lines(axes[0], by_heads, "heads", value, True, f"{unit} (fwd+bwd)")
  axes[0].set_title(f"more heads, batch {args.batch}")
  lines(axes[1], by_batch, "batch", value, True, f"{unit} (fwd+bwd)")
  axes[1].set_title(f"larger batch, {args.heads} heads")
  save(fig, "scaling.png", f"scaling at sequence length {args.sweep_seqlen}; {setting}")
  return written


# ---------------------------------------------------------------- command line

def _int_list(text: str) -> tuple[int, ...]:
  try:
    values = tuple(int(x) for x in text.split(","))
  except ValueError:
    values = ()
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(
        f"expected positive integers separated by commas, got {text!r}")
  return values


def _positive_int(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
  return int(text)


def _default_text(name: str) -> str:
  """'(default: X on a GPU, Y on the CPU)' for a per-backend default."""
  def show(value):
    return ("no limit" if value is None else
            ",".join(map(str, value)) if isinstance(value, tuple) else str(value))
  gpu, cpu = show(DEFAULTS["gpu"][name]), show(DEFAULTS["cpu"][name])
  return f"(default: {gpu})" if gpu == cpu else f"(default: {gpu} on a GPU, {cpu} on the CPU)"


EPILOG = """\
Options left out take their default for the backend JAX runs on: a GPU's defaults are sized
for an H100, the CPU's for a few cores. Both take about a minute; --plot adds the sweeps.

examples:
  python -m jaxflash                            self-check, then the speed and memory table
  python -m jaxflash --skip-check --plot plots  the table, the sweeps and three PNG plots
  python -m jaxflash --skip-bench               the self-check alone (exit status 0 = passed)
  python -m jaxflash --seqlens 4096,16384 --head-dim 64 --dtype float16
  python -m jaxflash --causal --json run.json   causal attention; all results also in run.json
  JAX_PLATFORMS=cpu python -m jaxflash          the CPU kernels on a machine with a GPU
"""


def parse_args(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m jaxflash", description=__doc__, epilog=EPILOG,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  check = parser.add_argument_group("what to run")
  check.add_argument("--skip-check", action="store_true",
                     help="skip the self-check (the exit status is then 0)")
  check.add_argument("--skip-bench", action="store_true",
                     help="skip the speed and memory table (cannot go with --plot or --scaling)")
  check.add_argument("--json", metavar="FILE",
                     help="also write the results to FILE as JSON: the build, JAX and the "
                          "device, the options, every self-check result and every timing cell")
  shape = parser.add_argument_group("speed and memory table")
  shape.add_argument("--seqlens", type=_int_list, metavar="N,N,...",
                     help="sequence lengths of the table, queries and keys alike; each is one "
                          "compiled program per path and direction " + _default_text("seqlens"))
  shape.add_argument("--batch", type=_positive_int, metavar="B",
                     help="batch size " + _default_text("batch"))
  shape.add_argument("--heads", type=_positive_int, metavar="H",
                     help="attention heads (queries and keys alike) " + _default_text("heads"))
  shape.add_argument("--head-dim", type=_positive_int, metavar="D",
                     help="head dimension, up to 256 " + _default_text("head_dim"))
  shape.add_argument("--causal", action="store_true",
                     help="time causal attention (its FLOPs are half of full attention's)")
  shape.add_argument("--dtype", choices=CHECK_DTYPES,
                     help="dtype of the table and the plots; the self-check runs all three "
                          + _default_text("dtype"))
  shape.add_argument("--repeats", type=_positive_int, metavar="R",
                     help="timed runs per cell after the one that compiles; the table shows "
                          "their median and the fastest " + _default_text("repeats"))
  shape.add_argument("--max-xla-seqlen", type=_positive_int, metavar="N",
                     help="longest sequence jax.nn's XLA path is run at: it stores the T×S "
                          "logits, slow and large on a CPU; longer cells show 'skipped' (a cell "
                          "that runs out of memory shows OOM) " + _default_text("max_xla_seqlen"))
  sweeps = parser.add_argument_group("scaling sweeps (fwd+bwd, run only for --plot or --scaling)")
  sweeps.add_argument("--plot", metavar="DIR",
                      help="run the sweeps and write tflops_vs_seqlen.png, memory_vs_seqlen.png "
                           "and scaling.png to DIR (created if missing; needs matplotlib)")
  sweeps.add_argument("--scaling", action="store_true",
                      help="run the sweeps and print their tables without plotting")
  sweeps.add_argument("--heads-sweep", type=_int_list, metavar="H,H,...",
                      help="head counts of the heads sweep, at --batch "
                           + _default_text("heads_sweep"))
  sweeps.add_argument("--batch-sweep", type=_int_list, metavar="B,B,...",
                      help="batch sizes of the batch sweep, at --heads "
                           + _default_text("batch_sweep"))
  sweeps.add_argument("--sweep-seqlen", type=_positive_int, metavar="N",
                      help="sequence length of both sweeps " + _default_text("sweep_seqlen"))
  args = parser.parse_args(argv)
  if args.skip_bench and (args.plot or args.scaling):
    parser.error("--plot and --scaling need the benchmark: drop --skip-bench")
  if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
    parser.error(f"--json: the directory of {args.json} does not exist")
  backend = "gpu" if jax.default_backend() == "gpu" else "cpu"
  for name, value in DEFAULTS[backend].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.dtype = jnp.dtype(args.dtype)
  return args


def benchmark(args, progress: Progress, plt) -> list[Measurement]:
  """The speed and memory table; with --plot or --scaling the sweeps, with --plot the plots.
  Returns every cell measured (a sweep point that is a table cell once)."""
  runner = Benchmark(args, progress)
  attention = "causal" if args.causal else "not causal"
  by_seqlen = runner.sweep([(args.batch, n, args.heads, backward)
                            for backward in (False, True) for n in args.seqlens],
                           "speed and memory")
  rate_name, _ = rate_unit(by_seqlen)
  progress.console.print(speed_table(
      by_seqlen, "seqlen", f"speed and memory on {_device_name()}: batch {args.batch}, "
      f"{args.heads} heads, {args.dtype.name}, head dim {args.head_dim}, {attention}", caption=(
          f"ms: median and fastest of {args.repeats} runs after a compiling one; {rate_name}: "
          f"4·B·H·N²·D{', halved (causal)' if args.causal else ''}, x3.5 for fwd+bwd, over the "
          "median; MiB: the compiled program's footprint (arguments + outputs + temporaries); "
          "speedup: the other path's median / jaxflash's; skipped: N over --max-xla-seqlen; "
          "OOM: out of memory")))
  if args.plot or args.scaling:
    n = args.sweep_seqlen
    by_heads = runner.sweep([(args.batch, n, h, True) for h in args.heads_sweep],
                            "scaling with heads")
    progress.console.print(speed_table(
        by_heads, "heads", f"scaling with heads: N {n}, batch {args.batch}, {attention}"))
    by_batch = runner.sweep([(b, n, args.heads, True) for b in args.batch_sweep],
                            "scaling with batch")
    progress.console.print(speed_table(
        by_batch, "batch", f"scaling with batch: N {n}, {args.heads} heads, {attention}"))
  for label, message in runner.failures.items():
    progress.console.print(f"{label} did not run a cell ('-' or OOM above); its first error: "
                           f"{message}", markup=False)
  if plt is not None:
    for path in write_plots(plt, args.plot, by_seqlen, by_heads, by_batch, args):
      progress.console.print(f"wrote {path}")
  return list(runner.measured.values())


# ---------------------------------------------------------------- what ran, and where

def build_header(build: dict) -> list[str]:
  """What this build of jaxflash is (kernels.build_info()) and what JAX runs on."""
  major, minor = build["ffi_api_version"]
  return [f"jaxflash {jaxflash.__version__}: kernels for {', '.join(build['platforms'])}; CUDA "
          f"architectures: {build['cuda_architectures'] or 'none (a CPU-only build)'}; built "
          f"against XLA FFI API {major}.{minor}",
          f"CPU kernels: {build['cpu_instruction_sets']}",
          f"JAX {jax.__version__} (jaxlib {jaxlib.__version__}) on {jax.default_backend()}: "
          f"{_device_name()}"]


def _json_number(x: float | None) -> float | None:
  """x, or None where JSON has no number for it (an error of inf: a NaN in an output)."""
  return x if x is None or math.isfinite(x) else None


def json_report(args, build: dict, checks: list[CheckResult] | None,
                cells: list[Measurement] | None, seconds: float) -> dict:
  """Everything a run found, for --json: None for a phase that was skipped."""
  device = jax.devices()[0]
  options = {name: value.name if isinstance(value, np.dtype) else value
             for name, value in sorted(vars(args).items())}
  report = {
      "jaxflash": dict(version=jaxflash.__version__, backends=list(build["platforms"]),
                       cuda_architectures=build["cuda_architectures"],
                       cpu_instruction_sets=build["cpu_instruction_sets"],
                       ffi_api_version=".".join(map(str, build["ffi_api_version"]))),
      "jax": dict(version=jax.__version__, jaxlib_version=jaxlib.__version__,
                  backend=jax.default_backend()),
      "device": dict(platform=device.platform, kind=device.device_kind, name=_device_name(),
                     count=jax.device_count()),
      "options": options, "self_check": None, "benchmark": None, "seconds": seconds,
  }
  if checks is not None:
    report["self_check"] = dict(passed=all(c.passed for c in checks), results=[
        dict(dtype=c.dtype, configuration=c.configuration, q_shape=c.q_shape,
             kv_shape=c.kv_shape, options=c.options, passed=c.passed,
             errors={output: dict(error=_json_number(error), allowed=_json_number(allowed))
                     for output, (error, allowed) in c.errors.items()})
        for c in checks])
  if cells is not None:
    report["benchmark"] = dict(cells=[
        dict(path=m.path, label=PATH_LABELS[m.path], direction=_direction(m.backward),
             batch=m.batch, seqlen=m.seqlen, heads=m.heads, head_dim=args.head_dim,
             dtype=args.dtype.name, causal=args.causal, repeats=args.repeats,
             status=m.status or "ok", median_seconds=m.seconds, min_seconds=m.min_seconds,
             flops=m.flops, flop_per_s=m.flop_per_s, footprint_mib=m.mib)
        for m in cells])
  return report


def main(argv=None) -> int:
  started = time.perf_counter()
  args = parse_args(argv)
  plt = None
  if args.plot:  # before anything runs: a missing matplotlib or a bad DIR fails at once
    plt = _pyplot()
    os.makedirs(args.plot, exist_ok=True)
  build = kernels.build_info()
  for line in build_header(build):
    console.print(line, markup=False)
  backend = jax.default_backend()
  if backend == "gpu" and "cuda" not in jaxflash.backends():
    console.print("[bold red]JAX sees a GPU, but this build of jaxflash has no CUDA kernels[/]: "
                  "rebuild it with them, JAXFLASH_CUDA=ON pip install . (or "
                  "JAXFLASH_CUDA_ARCHITECTURES=90a pip install . for an H100's), or run on the "
                  "CPU: JAX_PLATFORMS=cpu")
    return 1
  if KERNELS_FOR_BACKEND.get(backend) not in jaxflash.backends():
    console.print(f"[bold red]jaxflash has no kernels for JAX's {backend} backend[/] in this "
                  "build: reinstall it with them (README: Install), or choose a backend it has, "
                  "e.g. JAX_PLATFORMS=cpu")
    return 1
  checks = cells = None
  phases = []
  progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True)
  with progress:
    if not args.skip_check:
      start = time.perf_counter()
      checks = self_check(progress)
      progress.console.print(check_table(checks))
      phases.append(f"self-check {time.perf_counter() - start:.0f} s")
    if not args.skip_bench:
      start = time.perf_counter()
      cells = benchmark(args, progress, plt)
      phases.append(f"benchmark {time.perf_counter() - start:.0f} s")
  passed = checks is None or all(check.passed for check in checks)
  if checks is not None:
    console.print("self-check: [green]all passed[/]" if passed else
                  "self-check: [bold red]FAILED[/] (see the rows above)")
  seconds = time.perf_counter() - started
  if args.json:
    with open(args.json, "w") as f:
      json.dump(json_report(args, build, checks, cells, seconds), f, indent=1, allow_nan=False)
    console.print(f"wrote {args.json}", markup=False)
  console.print(f"done in {seconds:.0f} s ({', '.join(phases) or 'nothing run'})")
  return 0 if passed else 1


if __name__ == "__main__":
  sys.exit(main())
