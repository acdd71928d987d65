"""Small odd-shape jaxflash calls (forward and gradients) for compute-sanitizer.

scripts/gpu_check.sh runs this under memcheck and racecheck with
XLA_PYTHON_CLIENT_ALLOCATOR=platform (so every buffer is its own allocation
and an out-of-bounds access is not hidden inside XLA's pool), checking only
jaxflash's kernels. Every case is small (the largest has a few hundred tiles): instrumented
kernels run 10-100x slower.
"""

import jax
import jax.numpy as jnp

import jaxflash

# (dtype, q shape BTNH, kv shape BSKH, extra arguments)
CASES = (
    ("bfloat16", (2, 37, 4, 64), (2, 113, 2, 64), dict(is_causal=True)),
    ("float16", (1, 203, 2, 128), (1, 203, 2, 128), dict(local_window_size=(17, 5))),
    ("bfloat16", (3, 45, 2, 59), (3, 70, 1, 59), dict(bias=(3, 2, 45, 70), lengths=True)),
    ("float16", (2, 64, 2, 72), (2, 130, 2, 72), dict(mask=(2, 1, 64, 130))),
    ("float32", (1, 77, 2, 96), (1, 33, 2, 96), dict(bias=(1, 2, 77, 33), is_causal=True)),
    ("bfloat16", (1, 130, 2, 200), (1, 257, 2, 200), dict(mask_alignment="bottom_right", is_causal=True)),
    ("float16", (1, 1, 2, 32), (1, 1, 2, 32), {}),
    # The sm_90 forward (16-bit, D = 64 / 128): TMA past the ends, and V's rows past a sequence
    # length zeroed in shared memory.
    ("float16", (2, 150, 2, 128), (2, 200, 2, 128), dict(lengths=True)),
    # Dropout: the sm_90 backward's dropout copy (16-bit, D = 64, no bias) and the mma.sync
    # general kernels with the dbias pass (float32, bias).
    ("bfloat16", (2, 150, 4, 64), (2, 150, 2, 64), dict(is_causal=True, dropout=True)),
    ("float32", (1, 70, 2, 40), (1, 90, 2, 40), dict(bias=(1, 2, 70, 90), dropout=True)),
    # ALiBi's slopes differentiated: the mma.sync general kernel's dalibi (its shared-memory
    # slots, a barrier per instance, zeros for the instances a key tile's queries do not see),
    # the soft-cap copy's too.
    ("bfloat16", (3, 90, 4, 64), (3, 130, 2, 64), dict(is_causal=True, alibi=True, lengths=True)),
    ("float16", (1, 77, 2, 128), (1, 77, 1, 128), dict(alibi=True, logits_soft_cap=2.0)),
    # More backward key tiles (3 x 8 x 18 = 432) than an H100 has SMs, twice over: several per
    # CTA of a persistent kernel, with lengths (an instance without keys) and GQA.
    ("bfloat16", (3, 128, 16, 128), (3, 2200, 8, 128), dict(lengths=True)),
    # Head dims the sm_90 kernels pad to 64 / 128: their stores stop at the head dim (a row
    # stored whole runs past dk's last row: memcheck, with each buffer its own allocation).
    ("bfloat16", (2, 100, 2, 40), (2, 130, 1, 40), dict(is_causal=True)),
    ("float16", (1, 70, 2, 120), (1, 90, 2, 120), dict(logits_soft_cap=3.0)),
    # Segment ids (documents across tile edges: skipped tiles, tiles with the per-element test
    # and without): the sm_90 backward's copy for ids alone (its producer's plan, two dQ writers
    # with named turns) and the one with a soft-cap, the forward's ids copy (the walk handed over).
    ("bfloat16", (2, 300, 4, 128), (2, 300, 2, 128), dict(is_causal=True, documents=(97, 160, 43))),
    ("float16", (1, 520, 2, 64), (1, 520, 2, 64), dict(documents=(200, 64, 256), logits_soft_cap=2.0)),
)


def run(dtype, q_shape, kv_shape, extra):
  keys = jax.random.split(jax.random.key(0), 6)
  q = jax.random.normal(keys[0], q_shape, dtype)
  k = jax.random.normal(keys[1], kv_shape, dtype)
  v = jax.random.normal(keys[2], kv_shape, dtype)
  extra = dict(extra)
  bias_shape, mask_shape = extra.pop("bias", None), extra.pop("mask", None)
  bias = None if bias_shape is None else jax.random.normal(keys[3], bias_shape, dtype)
  mask = None if mask_shape is None else jax.random.bernoulli(keys[4], 0.8, mask_shape)
  if extra.pop("dropout", False):
    extra.update(dropout_rate=0.2, dropout_rng=keys[5])
  slopes = (jnp.linspace(0.05, 0.5, q_shape[2], dtype=jnp.float32)
            if extra.pop("alibi", False) else None)
  documents = extra.pop("documents", None)
  if documents is not None:  # the same documents in every row
    lengths = jnp.broadcast_to(jnp.array(documents, jnp.int32), (q_shape[0], len(documents)))
    extra["query_segment_ids"], extra["key_value_segment_ids"] = jaxflash.segment_ids_from_lengths(
        lengths, q_shape[1])
  if extra.pop("lengths", False):
    B, T, S = q_shape[0], q_shape[1], kv_shape[1]
    extra["query_seq_lengths"] = jnp.array([T, T // 2, 0][:B], jnp.int32)
    extra["key_value_seq_lengths"] = jnp.array([S // 2, 0, S][:B], jnp.int32)

  def loss(q, k, v, bias, slopes):
    out = jaxflash.attention(q, k, v, bias, mask, alibi_slopes=slopes, **extra)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  argnums = (0, 1, 2) + ((3,) if bias is not None else ()) + ((4,) if slopes is not None else ())
  grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias, slopes)
  jax.block_until_ready(grads)


if __name__ == "__main__":
  assert jax.default_backend() == "gpu", jax.default_backend()
  for case in CASES:
    run(*case)
    print("ok", case[0], case[1], case[2], sorted(case[3]))
