"""python -m jaxflash: a self-check against jax.nn and a speed/memory table.

Runs on whatever backend JAX has (GPU if present, else CPU). The self-check
compares jaxflash with jax.nn.dot_product_attention on a few configurations
per dtype (forward and gradients); the table times jitted jaxflash and jax.nn
(XLA) side by side and reads each compiled program's memory footprint.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.accuracy import error_bound, max_abs_error
from jaxflash.bench import measure

# (name, q shape BTNH, kv shape BSKH, keyword arguments); no row is fully
# masked in these, so jax.nn's convention and ours agree.
CHECKS = (
    ("MHA", (2, 128, 4, 64), (2, 128, 4, 64), {}),
    ("causal GQA, odd sizes", (2, 113, 4, 64), (2, 203, 2, 64), {"is_causal": True}),
    ("window, head dim 40", (1, 255, 2, 40), (1, 256, 2, 40), {"local_window_size": (17, 5)}),
    ("bias, head dim 128", (1, 64, 2, 128), (1, 200, 2, 128), {"bias": (1, 2, 64, 200)}),
)


def _inputs(key, q_shape, kv_shape, dtype, bias_shape=None):
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
  # Not under jit: jax.nn picks its float16 matmul precision inside a try that
  # only catches errors raised eagerly (the F16_F16_F32 preset fails on CPU).
  grads, out = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
  return (out,) + tuple(grads)


def self_check() -> bool:
  print(f"self-check on {jax.default_backend()} against jax.nn.dot_product_attention "
        f"(error <= 2 x jax.nn's own error in the input dtype + atol)")
  names = ("out", "dq", "dk", "dv", "dbias")
  all_ok = True
  for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
    for i, (name, q_shape, kv_shape, kwargs) in enumerate(CHECKS):
      kwargs = dict(kwargs)
      bias_shape = kwargs.pop("bias", None)
      q, k, v, bias, ct = _inputs(jax.random.key(i), q_shape, kv_shape, dtype, bias_shape)
      ours = _output_and_grads(jaxflash.attention, q, k, v, bias, ct, **kwargs)
      baseline = _output_and_grads(jax.nn.dot_product_attention, q, k, v, bias, ct, **kwargs)
      up = lambda x: None if x is None else x.astype(jnp.float32)
      with jax.default_matmul_precision("highest"):
        reference = _output_and_grads(jax.nn.dot_product_attention, up(q), up(k), up(v), up(bias),
                                      ct, **kwargs)
      figures, ok = [], True
      for label, x, b, r in zip(names, ours, baseline, reference):
        err, bound = max_abs_error(x, r), error_bound(r, b, dtype)
        ok &= err <= bound
        figures.append(f"{label} {err:.1e}/{bound:.1e}")
      all_ok &= ok
      print(f"  {'PASS' if ok else 'FAIL'}  {jnp.dtype(dtype).name:8s} {name:22s} "
            + "  ".join(figures))
  return all_ok


def bench(seqlens, batch, heads, head_dim, dtype, repeats) -> None:
  print(f"\nspeed and memory on {jax.devices()[0].device_kind} ({jax.default_backend()}): "
        f"batch {batch}, {heads} heads, head dim {head_dim}, {jnp.dtype(dtype).name}, "
        f"median of {repeats}; memory = compiled program's args+outputs+temps")
  header = ("N", "direction", "jaxflash ms", "jax.nn ms", "speedup", "jaxflash MiB", "jax.nn MiB")
  print("  " + " ".join(f"{h:>13s}" for h in header))
  for n in seqlens:
    keys = jax.random.split(jax.random.key(n), 3)
    args = tuple(jax.random.normal(k, (batch, n, heads, head_dim), dtype) for k in keys)
    for backward in (False, True):
      ours_t, ours_m = measure(jaxflash.attention, args, backward, False, repeats)
      xla_t, xla_m = measure(jax.nn.dot_product_attention, args, backward, False, repeats)
      fmt_t = lambda t: f"{t * 1e3:.1f}" if isinstance(t, float) else t
      fmt_m = lambda m: f"{m / 2**20:.0f}" if m is not None else "-"
      speedup = (f"{xla_t / ours_t:.2f}x" if isinstance(ours_t, float) and isinstance(xla_t, float)
                 else "-")
      row = (str(n), "fwd+bwd" if backward else "fwd", fmt_t(ours_t), fmt_t(xla_t), speedup,
             fmt_m(ours_m), fmt_m(xla_m))
      print("  " + " ".join(f"{c:>13s}" for c in row), flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxflash", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seqlens", default="512,1024,2048,4096,8192",
                      help="comma-separated sequence lengths for the table (default: %(default)s)")
  parser.add_argument("--batch", type=int, default=1, help="batch size (default: %(default)s)")
  parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
  parser.add_argument("--head-dim", type=int, default=64, help="head dim (default: %(default)s)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                      help="dtype of the table (default: %(default)s)")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (default: %(default)s)")
  parser.add_argument("--skip-check", action="store_true", help="skip the self-check")
  parser.add_argument("--skip-bench", action="store_true", help="skip the speed/memory table")
  args = parser.parse_args(argv)

  print(f"jaxflash {jaxflash.__version__}, kernels for {', '.join(jaxflash.backends())}; "
        f"JAX {jax.__version__} on {jax.default_backend()}")
  ok = True if args.skip_check else self_check()
  if not args.skip_bench:
    bench([int(n) for n in args.seqlens.split(",")], args.batch, args.heads, args.head_dim,
          jnp.dtype(args.dtype), args.repeats)
  if not ok:
    print("\nself-check FAILED", file=sys.stderr)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
