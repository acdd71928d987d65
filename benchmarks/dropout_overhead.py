"""What attention dropout costs: jaxflash fwd and fwd+bwd with dropout against itself without, and
Flax's dropout attention on XLA (which materialises the T×S weights and their mask) as the peer,
timed in one process. FlashAttention's protocol as jaxflash.bench: 16k tokens, hidden 2048, bf16.

  python benchmarks/dropout_overhead.py [--seqlens 4096,16384] [--rate 0.1]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from flax import linen

import jaxflash
from jaxflash.bench import attention_flops, inputs, measure


def flax_xla_dropout(rate, rng):
  """Flax's own dot_product_attention with dropout: XLA, weights materialised."""
  def attention(q, k, v, is_causal=False):
    mask = linen.make_causal_mask(jnp.ones(q.shape[:2])) if is_causal else None
    return linen.dot_product_attention(q, k, v, mask=mask, dropout_rng=rng, dropout_rate=rate,
                                       deterministic=False, broadcast_dropout=False)
  return attention


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  ints = lambda s: [int(x) for x in s.split(",")]
  parser.add_argument("--seqlens", type=ints, default=[4096, 16384], help="sequence lengths")
  parser.add_argument("--head-dims", type=ints, default=[64, 128], help="head dims")
  parser.add_argument("--rate", type=float, default=0.1, help="dropout rate (default: %(default)s)")
  parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
  parser.add_argument("--repeats", type=int, default=10, help="timed runs per cell")
  parser.add_argument("--xla-max-seqlen", type=int, default=4096,
                      help="longest sequence for the XLA peer (its T×S weights; default: %(default)s)")
  args = parser.parse_args(argv)

  rng = jax.random.key(0)
  paths = {"no dropout": jaxflash.attention,
           "dropout": functools.partial(jaxflash.attention, dropout_rate=args.rate, dropout_rng=rng),
           "flax xla dropout": flax_xla_dropout(args.rate, rng)}
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: TFLOP/s, bf16, "
        f"dropout rate {args.rate}, {args.tokens} tokens, hidden 2048, median of {args.repeats}")
  print("| D | N | causal | direction | " + " | ".join(paths) + " | dropout / no dropout |")
  print("|---|---|---|---|" + "---|" * (len(paths) + 1))
  for head_dim in args.head_dims:
    heads = 2048 // head_dim
    for n in args.seqlens:
      batch = max(1, args.tokens // n)
      qkv = inputs(jax.random.key(n), batch, n, heads, head_dim, jnp.bfloat16)
      for causal in (False, True):
        for backward in (False, True):
          flops = attention_flops(batch, n, heads, head_dim, causal=causal, backward=backward)
          rates = {}
          for name, fn in paths.items():
            if name.startswith("flax") and n > args.xla_max_seqlen:
              rates[name] = None
              continue
            t, _ = measure(fn, qkv, backward, causal, args.repeats)
            rates[name] = flops / t / 1e12 if isinstance(t, float) else None
          cells = [f"{r:.3g}" if r else "-" for r in rates.values()]
          ratio = (f"{rates['dropout'] / rates['no dropout']:.2f}"
                   if rates["dropout"] and rates["no dropout"] else "-")
          print(f"| {head_dim} | {n} | {'yes' if causal else 'no'} | {'fwd+bwd' if backward else 'fwd'} | " +
                " | ".join(cells) + f" | {ratio} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
