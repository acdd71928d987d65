"""What packed sequences, the logit soft-cap and ALiBi cost: issue 18's speed bar, timed in one
process. bf16, 16 heads of dim 128 (hidden 2048), median of --repeats.

- Packing: --docs documents of --doc-len tokens each, causal, three ways: a batch of separate
  rows (the work itself), packed into one row with segment ids, and packed with the same
  packing as a dense T×S boolean mask (what `jax.nn` takes). Columns: tokens/s of each, and
  packed / separate (bar ≥ 0.9) and packed / dense mask (bar ≥ 5).
- Soft-cap and ALiBi: FlashAttention's protocol (--tokens tokens per call) with
  `logits_soft_cap` / `alibi_slopes` against the same call without (bar: cost ≤ 10%, i.e. a
  ratio ≥ 0.9). A call the backend cannot run shows its error's name (NotImplementedError: a
  modifier its kernels do not have).

  python benchmarks/score_modifiers.py [--docs 16] [--doc-len 1024] [--seqlens 4096,16384]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.bench import attention_flops, inputs, measure

HEADS, HEAD_DIM = 16, 128


def packing_rows(docs, doc_len, repeats):
  """Markdown rows: separate rows, segment ids, dense mask; tokens/s and the two ratios."""
  total = docs * doc_len
  separate = inputs(jax.random.key(1), docs, doc_len, HEADS, HEAD_DIM, jnp.bfloat16)
  packed = tuple(x.reshape(1, total, HEADS, HEAD_DIM) for x in separate)
  q_ids, kv_ids = jaxflash.segment_ids_from_lengths(jnp.full((1, docs), doc_len), total)
  dense = (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
  ways = {
      "separate rows": (jaxflash.attention, separate),
      "segment ids": (lambda q, k, v, qi, ki, is_causal: jaxflash.attention(
          q, k, v, is_causal=is_causal, query_segment_ids=qi, key_value_segment_ids=ki),
                      packed + (q_ids, kv_ids)),
      "dense mask": (lambda q, k, v, m, is_causal: jaxflash.attention(q, k, v, mask=m, is_causal=is_causal),
                     packed + (dense,)),
  }
  lines = ["| direction | " + " | ".join(f"{w} tokens/s" for w in ways) +
           " | ids / separate | ids / dense mask | " + " | ".join(f"{w} MiB" for w in ways) + " |",
           "|---|" + "---|" * (2 * len(ways) + 2)]
  print(f"\n{docs} documents of {doc_len} tokens, causal, bf16, {HEADS} heads x {HEAD_DIM}")
  print("\n".join(lines), flush=True)
  for backward in (False, True):
    results = {w: measure(fn, args, backward, True, repeats) for w, (fn, args) in ways.items()}
    rate = {w: total / t if isinstance(t, float) else None for w, (t, _) in results.items()}
    ratio = lambda a, b: f"{rate[a] / rate[b]:.2f}" if rate[a] and rate[b] else "-"
    cells = ["fwd+bwd" if backward else "fwd"]
    cells += [f"{rate[w]:.3g}" if rate[w] else results[w][0] for w in ways]
    cells += [ratio("segment ids", "separate rows"), ratio("segment ids", "dense mask")]
    cells += [f"{m / 2**20:.0f}" if m else "-" for _, m in results.values()]
    lines.append("| " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
  return lines


def modifier_rows(tokens, seqlens, soft_cap, repeats):
  """Markdown rows: TFLOP/s without and with each modifier, and their ratio."""
  slopes = 2.0 ** (-8.0 * jnp.arange(1, HEADS + 1) / HEADS)  # ALiBi's geometric slopes
  modifiers = {"soft-cap": dict(logits_soft_cap=soft_cap), "ALiBi": dict(alibi_slopes=slopes)}
  lines = ["| N | causal | direction | plain TFLOP/s | " +
           " | ".join(f"{m} TFLOP/s | {m} / plain" for m in modifiers) + " |",
           "|---|---|---|---|" + "---|---|" * len(modifiers)]
  print(f"\nsoft-cap {soft_cap}, ALiBi slopes 2^(-8h/{HEADS}); {tokens} tokens, bf16, "
        f"{HEADS} heads x {HEAD_DIM}")
  print("\n".join(lines), flush=True)
  for n in seqlens:
    batch = max(1, tokens // n)
    qkv = inputs(jax.random.key(n), batch, n, HEADS, HEAD_DIM, jnp.bfloat16)
    for causal in (False, True):
      for backward in (False, True):
        flops = attention_flops(batch, n, HEADS, HEAD_DIM, causal=causal, backward=backward)
        call = lambda **options: functools.partial(jaxflash.attention, **options)
        plain, _ = measure(call(), qkv, backward, causal, repeats)
        cells = [str(n), "yes" if causal else "no", "fwd+bwd" if backward else "fwd",
                 f"{flops / plain / 1e12:.3g}" if isinstance(plain, float) else plain]
        for options in modifiers.values():
          t, _ = measure(call(**options), qkv, backward, causal, repeats)
          cells += ([f"{flops / t / 1e12:.3g}", f"{plain / t:.2f}"]
                    if isinstance(t, float) and isinstance(plain, float) else [t, "-"])
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  ints = lambda s: [int(x) for x in s.split(",")]
  parser.add_argument("--docs", type=int, default=16, help="documents packed in one row")
  parser.add_argument("--doc-len", type=int, default=1024, help="tokens per document")
  parser.add_argument("--seqlens", type=ints, default=[4096, 16384],
                      help="sequence lengths of the soft-cap / ALiBi rows")
  parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen of those rows")
  parser.add_argument("--soft-cap", type=float, default=30.0, help="logits_soft_cap (Gemma 2's 50, Grok's 30)")
  parser.add_argument("--repeats", type=int, default=10, help="timed runs per cell")
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, jaxflash {jaxflash.__version__}")
  packing_rows(args.docs, args.doc_len, args.repeats)
  modifier_rows(args.tokens, args.seqlens, args.soft_cap, args.repeats)
  return 0


if __name__ == "__main__":
  sys.exit(main())
