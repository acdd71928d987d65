"""Scaling of jaxflash over the GPUs of one host, side by side with jax.nn's cuDNN path.

  batch   weak scaling: a fixed batch per GPU, the batch sharded over n GPUs versus one GPU
          with its share; efficiency = t(1 GPU) / t(n GPUs), ideally 1.
  ring    strong scaling of one long causal sequence (default 128k tokens): the sequence
          sharded over n GPUs (ring attention, zig-zag order, chosen by jaxflash.attention's
          partitioning) versus the whole sequence on one GPU; efficiency = t(1) / (n t(n)).
          Also the per-GPU memory of the compiled program, and the largest |difference|
          between the two outputs.
  window  the same with a causal sliding window (default 4096 tokens): the ring stops after
          the blocks the window reaches (one step behind at 2 GPUs, contiguous order).
  packed  the same sequence as documents of random lengths (default 1k-16k tokens, seeded)
          packed one after another: segment ids (sharded with the sequence, the key ids
          travelling with their K/V block) and causal. jaxflash only: jax.nn takes no
          segment ids.

Every time is the median of --repeats synchronised calls of a jitted forward + backward
(the loss is the sum of the output) after a warm-up call. Run: python benchmarks/multi_device.py
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxflash
from jaxflash.bench import footprint_bytes, median_seconds


# Array options (segment ids) come after q, k, v as arguments, sharded like the sequence, so
# that they are not constants of the compiled program; `options` holds the others.
def grad_fn(attention, options, array_names=()):
  def loss(q, k, v, *arrays):
    out = attention(q, k, v, **options, **dict(zip(array_names, arrays)))
    return jnp.sum(out.astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def forward_fn(attention, options, array_names=()):
  return jax.jit(lambda q, k, v, *arrays: attention(q, k, v, **options,
                                                    **dict(zip(array_names, arrays))))


CAUSAL = dict(is_causal=True)


PATHS = {"jaxflash": jaxflash.attention,
         "cudnn": functools.partial(jax.nn.dot_product_attention, implementation="cudnn")}


def operands(shape, dtype, sharding):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.device_put(jax.random.normal(k, shape, jnp.float32).astype(dtype), sharding)
          for k in keys]


def timed(fn, args, repeats):
  try:
    return median_seconds(fn, args, repeats), footprint_bytes(fn, args)
  except Exception as e:  # noqa: BLE001 - a path that cannot run this sharding or size
    return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}", None


def batch_scaling(devices, per_device_batch, seqlen, heads, head_dim, dtype, repeats):
  n = len(devices)
  rows = []
  one = jax.sharding.SingleDeviceSharding(devices[0])
  mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
  shape1 = (per_device_batch, seqlen, heads, head_dim)
  shape_n = (n * per_device_batch, seqlen, heads, head_dim)
  for name, attention in PATHS.items():
    t1, _ = timed(grad_fn(attention, CAUSAL), operands(shape1, dtype, one), repeats)
    tn, _ = timed(grad_fn(attention, CAUSAL),
                  operands(shape_n, dtype, NamedSharding(mesh, P("data"))), repeats)
    eff = t1 / tn if isinstance(t1, float) and isinstance(tn, float) else None
    rows.append((name, t1, tn, eff))
  return rows


def ring_scaling(devices, seqlen, heads, head_dim, dtype, repeats, options, arrays=None,
                 paths=PATHS):
  """`arrays`: (1, seqlen) options by name (segment ids), sharded like the sequence."""
  n = len(devices)
  arrays = arrays or {}
  one = jax.sharding.SingleDeviceSharding(devices[0])
  mesh = jax.sharding.Mesh(np.asarray(devices), ("seq",))
  shape = (1, seqlen, heads, head_dim)
  names = tuple(arrays)
  args1 = operands(shape, dtype, one) + [jax.device_put(a, one) for a in arrays.values()]
  args_n = (operands(shape, dtype, NamedSharding(mesh, P(None, "seq"))) +
            [jax.device_put(a, NamedSharding(mesh, P(None, "seq"))) for a in arrays.values()])
  rows = []
  # One jitted function per (pass, path), for both placements: the HLO and the outputs below
  # reuse the programs the timing compiled.
  fns = {}
  for direction, make in (("forward", forward_fn), ("fwd+bwd", grad_fn)):
    for name, attention in paths.items():
      fns[direction, name] = fn = make(attention, options, names)
      t1, m1 = timed(fn, args1, repeats)
      tn, mn = timed(fn, args_n, repeats)
      eff = t1 / (n * tn) if isinstance(t1, float) and isinstance(tn, float) else None
      rows.append((direction, name, t1, tn, eff, m1, mn))  # memory_analysis: per device
  # What the sharded program communicates: the ring's collective-permutes, and no all-gather
  # or all-to-all of the sequence.
  hlo = "".join(fns[direction, "jaxflash"].lower(*args_n).compile().as_text()
                for direction in ("forward", "fwd+bwd"))
  ops = {op: len(re.findall(rf"= [^=]* {op}(-start)?\(", hlo))
         for op in ("collective-permute", "all-gather", "all-to-all", "all-reduce")}
  out1 = fns["forward", "jaxflash"](*args1)
  out_n = fns["forward", "jaxflash"](*args_n)
  diff = float(jnp.max(jnp.abs(jax.device_put(out_n, one).astype(jnp.float32) -
                               out1.astype(jnp.float32))))
  return rows, diff, ops


def packed_lengths(total, shortest, longest, seed=0):
  """Document lengths drawn uniformly from [shortest, longest] until they fill `total` (the
  last one cut to fit)."""
  rng = np.random.default_rng(seed)
  lengths = []
  while sum(lengths) < total:
    lengths.append(int(min(rng.integers(shortest, longest + 1), total - sum(lengths))))
  return lengths


def fmt_t(t):
  return f"{t * 1e3:9.2f} ms" if isinstance(t, float) else f"{t}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqlen", type=int, default=131072, help="ring: tokens in the sequence")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--window", type=int, default=4096, help="sliding window: tokens back")
  parser.add_argument("--doc-lengths", default="1024,16384",
                      help="packed: the documents' shortest and longest length (tokens)")
  parser.add_argument("--batch-seqlen", type=int, default=4096)
  parser.add_argument("--per-device-batch", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args(argv)
  devices = jax.devices()
  dtype = jnp.bfloat16
  print(f"{len(devices)} x {devices[0].device_kind}, JAX {jax.__version__}, bf16, causal, "
        f"H={args.head_dim}, {args.heads} heads")

  print(f"\nbatch sharding (weak scaling): {args.per_device_batch} x {args.batch_seqlen} tokens "
        f"per GPU, forward + backward")
  print(f"{'path':10s} {'1 GPU':>12s} {f'{len(devices)} GPUs':>12s} {'efficiency':>11s}")
  for name, t1, tn, eff in batch_scaling(devices, args.per_device_batch, args.batch_seqlen,
                                         args.heads, args.head_dim, dtype, args.repeats):
    print(f"{name:10s} {fmt_t(t1):>12s} {fmt_t(tn):>12s} "
          f"{'' if eff is None else f'{eff:10.2f}':>11s}")

  shortest, longest = (int(x) for x in args.doc_lengths.split(","))
  lengths = packed_lengths(args.seqlen, shortest, longest)
  q_ids, kv_ids = jaxflash.segment_ids_from_lengths(jnp.asarray(lengths)[None], args.seqlen)
  scenarios = (
      ("causal", CAUSAL, None, PATHS),
      (f"causal, window {args.window}", dict(is_causal=True, local_window_size=(args.window, 0)),
       None, PATHS),
      (f"causal, {len(lengths)} packed documents of {min(lengths)}-{max(lengths)} tokens "
       f"(segment ids)", CAUSAL, dict(query_segment_ids=q_ids, key_value_segment_ids=kv_ids),
       {"jaxflash": jaxflash.attention}))
  for title, options, arrays, paths in scenarios:
    rows, diff, ops = ring_scaling(devices, args.seqlen, args.heads, args.head_dim, dtype,
                                   args.repeats, options, arrays, paths)
    print(f"\nsequence sharding (strong scaling): 1 x {args.seqlen} tokens, {title}")
    print(f"{'pass':8s} {'path':10s} {'1 GPU':>12s} {f'{len(devices)} GPUs':>12s} "
          f"{'efficiency':>11s} {'GiB/GPU 1':>10s} {f'GiB/GPU {len(devices)}':>10s}")
    gib = lambda b: "" if b is None else f"{b / 2**30:10.2f}"
    for direction, name, t1, tn, eff, m1, mn in rows:
      print(f"{direction:8s} {name:10s} {fmt_t(t1):>12s} {fmt_t(tn):>12s} "
            f"{'' if eff is None else f'{eff:10.2f}':>11s} {gib(m1):>10s} {gib(mn):>10s}")
    print(f"max |out({len(devices)} GPUs) - out(1 GPU)| = {diff:.3g} (bf16 output)")
    print(f"jaxflash's {len(devices)}-GPU programs (forward, fwd+bwd) hold: " +
          ", ".join(f"{count} {op}" for op, count in ops.items()))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
