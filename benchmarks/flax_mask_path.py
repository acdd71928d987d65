"""What the Flax adapter's mask path costs one attention layer.

`jaxflash.flax_attention` given a causal mask classifies it on the device
(`flax_adapter.mask_structure`) and then picks the kernel call with one switch
(`attention.attention_switch`: one custom_vjp, a switch in its forward and one in its
backward). Timed in one process, forward and forward + backward (the gradient of the output's
sum in q, k and v):

- mask: `flax_attention` given the (B, 1, T, T) causal mask of `nnx.make_causal_mask`;
- is_causal: `flax_attention` given `is_causal=True` and no mask (no classification, no switch);
- switch only: the switch over the kernel calls (`flax_adapter.run_as`) with the mask's
  structure found beforehand and passed in, so that what is left of the mask path is the switch;
- classification only: `flax_adapter.mask_structure` of the mask (forward only: it has no
  gradient);
- switch of calls (before): switch only as it was before attention_switch, a `lax.switch` over
  `jaxflash.attention` calls, each its own custom_vjp (under differentiation the conditional
  then outputs every branch's residuals: copies of q, k, v, the mask and the ids besides out32);
- cudnn: `jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")`, the peer,
  on a GPU.

The default size is one layer of `examples/train_lm.py --size large` (8 x 2048 tokens, 12 heads
of 64, bf16), whose training step ran at 0.84 of cuDNN's tokens/s given the mask and 0.91 given
`is_causal` on an H200 (BENCHMARKS.md, 2026-11-28).

  python benchmarks/flax_mask_path.py [--batch 8] [--seqlen 2048] [--heads 12] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash
from jaxflash import flax_adapter
from jaxflash.bench import inputs, median_seconds


def _paths() -> dict:
  """name -> f(q, k, v, mask, found): the attention output, or for the classification its
  kind."""
  def switch_only(q, k, v, mask, found):
    return flax_adapter.run_as(found, q, k, v, None, mask, False, {})

  def switch_of_calls(q, k, v, mask, found):
    kind, calls = flax_adapter.candidates(found, mask, False, {})
    return jax.lax.switch(kind, [functools.partial(jaxflash.attention, q, k, v, **call)
                                 for call in calls])

  paths = {
      "mask": lambda q, k, v, mask, found: jaxflash.flax_attention(q, k, v, mask=mask),
      "is_causal": lambda q, k, v, mask, found: jaxflash.flax_attention(q, k, v, is_causal=True),
      "switch only": switch_only,
      "classification only": lambda q, k, v, mask, found: flax_adapter.mask_structure(
          mask[:, 0]).kind,
      "switch of calls (before)": switch_of_calls,
  }
  if jax.default_backend() == "gpu":
    paths["cudnn"] = lambda q, k, v, mask, found: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")
  return paths


def _compiled(fn, backward: bool):
  if not backward:
    return jax.jit(fn)
  loss = lambda q, k, v, mask, found: jnp.sum(fn(q, k, v, mask, found).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seqlen", type=int, default=2048)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=20, help="timed samples per cell")
  args = parser.parse_args(argv)

  q, k, v = inputs(jax.random.key(0), args.batch, args.seqlen, args.heads, args.head_dim,
                   jnp.bfloat16)
  mask = nnx.make_causal_mask(jnp.zeros((args.batch, args.seqlen)), dtype=jnp.bool_)
  # The switch-only path's structure, found outside its timed program (an argument, so that the
  # switch is not folded away).
  found = jax.jit(flax_adapter.mask_structure)(mask[:, 0])
  operands = (q, k, v, mask, found)
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: one attention layer, "
        f"{args.batch} x {args.seqlen} tokens, {args.heads} heads of {args.head_dim}, bf16, "
        f"median of {args.repeats}")
  print("| path | fwd ms | fwd+bwd ms | fwd / is_causal | fwd+bwd / is_causal |")
  print("|---|---|---|---|---|")
  times = {}
  for name, fn in _paths().items():
    directions = (False,) if name == "classification only" else (False, True)
    times[name] = [median_seconds(_compiled(fn, backward), operands, args.repeats) * 1e3
                   if backward in directions else None for backward in (False, True)]
  base = times["is_causal"]
  for name, cells in times.items():
    ms = [f"{t:.3f}" if t is not None else "-" for t in cells]
    ratios = [f"{t / b:.2f}" if t is not None else "-" for t, b in zip(cells, base)]
    print(f"| {name} | " + " | ".join(ms + ratios) + " |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
