"""python -m jaxflash.bench: FlashAttention's benchmark protocol, side by side.

batch × seqlen = --tokens (16k), hidden 2048 (heads = 2048 / head dim), random
inputs; TFLOP/s of jaxflash, jax.nn's cuDNN path (GPU only) and jax.nn's XLA
path, timed in one process (calls issued back to back: run_seconds), with
jaxflash's ratio to cuDNN. FLOPs: forward 4·B·H·N²·D, halved when causal;
fwd+bwd 3.5× the forward (attention_flops, which every jaxflash benchmark
counts with). Memory is the compiled program's footprint (XLA's buffer
assignment). Last, the longest single
sequence (16 heads × 128, bf16) each path runs fwd+bwd.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxflash


def attention_flops(batch: int, seqlen: int, heads: int, head_dim: int, *, causal: bool,
                    backward: bool) -> float:
  """FlashAttention's FLOP count for attention over `seqlen` queries and keys: 4·B·H·N²·D for
  the forward (Q·Kᵀ and P·V, 2·N²·D each per head), halved when causal (half the logits are
  visible), and 3.5 times the forward for forward + backward (the backward's five products)."""
  forward = 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
  return forward * (3.5 if backward else 1.0)


def run_seconds(fn, args, repeats: int) -> list[float]:
  """Per-call wall times of fn(*args) after one warm-up call (compile): `repeats` samples, each
  the time of `calls` calls issued back to back and synchronised once, divided by `calls`.
  Synchronising every call would add the host's dispatch and wait (tens of µs) to each, a
  tenth of a short GPU call, and draw every path's ratios towards 1; issued together the calls
  queue on the device, which then times its own work, as CUDA events would. `calls` makes a
  sample last about 10 ms (at most 100 calls; 1 for calls longer than that)."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  single = time.perf_counter() - start
  calls = max(1, min(100, math.ceil(0.01 / max(single, 1e-6))))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) / calls)
  return times


def median_seconds(fn, args, repeats: int) -> float:
  """Median per-call wall time of fn(*args) (run_seconds)."""
  return statistics.median(run_seconds(fn, args, repeats))


def footprint_bytes(fn, args) -> int:
  """Arguments + outputs + temporaries of the compiled program (XLA's buffer assignment)."""
  stats = fn.lower(*args).compile().memory_analysis()
  return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def paths() -> dict:
  """The attention implementations to compare on the default backend."""
  found = {"jaxflash": jaxflash.attention,
           "xla": functools.partial(jax.nn.dot_product_attention, implementation="xla")}
  if jax.default_backend() == "gpu":
    found["cudnn"] = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
  return found


def compiled(attention, backward: bool, causal: bool):
  """jit of attention(q, k, v, *extra, is_causal=causal), or of its gradient in q, k and v;
  `extra` (segment ids, a mask) are arguments, not constants folded into the program."""
  if backward:
    def loss(q, k, v, *extra):
      return jnp.sum(attention(q, k, v, *extra, is_causal=causal).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return jax.jit(lambda q, k, v, *extra: attention(q, k, v, *extra, is_causal=causal))


def measure(attention, args, backward, causal, repeats):
  """(seconds, footprint bytes), or (the error's name, None) when the path cannot run it."""
  fn = compiled(attention, backward, causal)
  try:
    return median_seconds(fn, args, repeats), footprint_bytes(fn, args)
  except Exception as e:  # noqa: BLE001 - out of memory, or a shape cuDNN does not support
    return type(e).__name__, None


def inputs(key, batch, seqlen, heads, head_dim, dtype):
  keys = jax.random.split(key, 3)
  return tuple(jax.random.normal(k, (batch, seqlen, heads, head_dim), dtype) for k in keys)


def table(tokens, seqlens, head_dims, dtypes, repeats, hidden=2048):
  """Markdown rows of the protocol table; printed as they are measured."""
  names = list(paths())
  header = (["dtype", "D", "N", "causal", "direction"] + [f"{n} TFLOP/s" for n in names] +
            (["jaxflash / cudnn"] if "cudnn" in names else []) + [f"{n} MiB" for n in names])
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  print("\n".join(lines), flush=True)
  for dtype in dtypes:
    for head_dim in head_dims:
      heads = hidden // head_dim
      for n in seqlens:
        batch = max(1, tokens // n)
        args = inputs(jax.random.key(n), batch, n, heads, head_dim, dtype)
        for causal in (False, True):
          for backward in (False, True):
            flops = attention_flops(batch, n, heads, head_dim, causal=causal, backward=backward)
            results = {name: measure(fn, args, backward, causal, repeats) for name, fn in paths().items()}
            rate = {name: flops / t / 1e12 if isinstance(t, float) else None
                    for name, (t, _) in results.items()}
            cells = [jnp.dtype(dtype).name, str(head_dim), str(n), "yes" if causal else "no",
                     "fwd+bwd" if backward else "fwd"]
            cells += [f"{rate[name]:.3g}" if rate[name] else results[name][0] for name in names]
            if "cudnn" in names:
              cells.append(f"{rate['jaxflash'] / rate['cudnn']:.2f}" if rate["jaxflash"] and rate["cudnn"]
                           else "-")
            cells += [f"{m / 2**20:.0f}" if m else "-" for _, m in results.values()]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
  return lines


def longest_sequence(start, limit, heads=16, head_dim=128, dtype=jnp.bfloat16):
  """Per path, the longest single sequence (doubling from `start`) that runs fwd+bwd, and the
  seconds of one call at that length: {name: (length, seconds)}, (None, None) if none ran."""
  longest = {}
  for name, fn in paths().items():
    n, best, seconds = start, None, None
    while n <= limit:
      t, _ = measure(fn, inputs(jax.random.key(0), 1, n, heads, head_dim, dtype), True, True, 1)
      if not isinstance(t, float):
        break
      best, seconds, n = n, t, 2 * n
    longest[name] = (best, seconds)
    print(f"longest causal fwd+bwd sequence, {heads} heads x {head_dim}, {jnp.dtype(dtype).name}: "
          f"{name}: {f'{best} in {seconds:.3f} s' if best else 'none'} (limit {limit})", flush=True)
  return longest


def longest_ratio(longest) -> str | None:
  """jaxflash's time over cuDNN's at the longest length, where both reached the same one."""
  ours, cudnn = longest.get("jaxflash", (None, None)), longest.get("cudnn", (None, None))
  if not ours[0] or ours[0] != cudnn[0]:
    return None
  return f"jaxflash / cudnn time at {ours[0]}: {ours[1] / cudnn[1]:.2f}"


def longest_lines(longest) -> list[str]:
  """The search's result as markdown lines."""
  lines = [f"longest causal fwd+bwd sequence (16 heads x 128, bf16), {name}: "
           f"{f'{n} in {t:.3f} s' if n else 'none'}" for name, (n, t) in longest.items()]
  return lines + ([longest_ratio(longest)] if longest_ratio(longest) else [])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxflash.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  ints = lambda s: [int(x) for x in s.split(",")]
  parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (default: %(default)s)")
  parser.add_argument("--seqlens", type=ints, default=[512, 1024, 2048, 4096, 8192, 16384],
                      help="comma-separated sequence lengths")
  parser.add_argument("--head-dims", type=ints, default=[64, 128, 256], help="comma-separated head dims")
  parser.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated dtypes")
  parser.add_argument("--repeats", type=int, default=10, help="timed runs per cell (default: %(default)s)")
  parser.add_argument("--longest-from", type=int, default=16384,
                      help="first length of the longest-sequence search; 0 skips it (default: %(default)s)")
  parser.add_argument("--longest-limit", type=int, default=262144,
                      help="last length of the longest-sequence search (default: %(default)s)")
  parser.add_argument("--out", help="also write the table as markdown to this file")
  args = parser.parse_args(argv)

  device = jax.devices()[0].device_kind
  title = (f"jaxflash {jaxflash.__version__} on {device}, JAX {jax.__version__}, "
           f"{datetime.date.today().isoformat()}; {args.tokens} tokens, hidden 2048, "
           f"median of {args.repeats}")
  print(title, flush=True)
  lines = table(args.tokens, args.seqlens, args.head_dims,
                [jnp.dtype(d) for d in args.dtypes.split(",")], args.repeats)
  if args.out:  # the table first: a run cut short during the search still leaves it
    with open(args.out, "w") as f:
      f.write(f"{title}\n\n" + "\n".join(lines) + "\n")
  longest = longest_sequence(args.longest_from, args.longest_limit) if args.longest_from else {}
  if longest_ratio(longest):
    print(longest_ratio(longest), flush=True)
  if args.out and longest:
    with open(args.out, "a") as f:
      f.write("\n" + "\n\n".join(longest_lines(longest)) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
