"""Attention dropout: the mask the kernels apply, its statistics, reproducibility and transforms.

test_attention's DROPOUT_FEATURES compare forward and gradients with a reference that applies
jaxflash.dropout_mask; this file checks that dropout_mask IS the kernels' mask, read back from
the kernels themselves: with V the identity (S = H keys, one feature each), output row t of head
n is P[n, t, :] · keep / (1 - rate), and P > 0 everywhere without masking, so the kept entries
are exactly the nonzero outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import dropout as dropout_lib
from jaxflash import kernels, ring as ring_lib
from jaxflash.attention import _delta, _gradient_layouts
from jaxflash.contract import OPTIONAL_INPUTS, Flag, absent
from jaxflash.validation import validate


def kernel_keep_mask(rng, rate, *, batch, heads, kv_heads, seqlen_q, keys, broadcast=False,
                     is_causal=False):
  """The keep mask (B, N, T, S) the kernels applied, read from their output (module docstring).
  float32, so no P rounds to 0; keys = head dim."""
  q = jax.random.normal(jax.random.key(0), (batch, seqlen_q, heads, keys), jnp.float32)
  k = jax.random.normal(jax.random.key(1), (batch, keys, kv_heads, keys), jnp.float32)
  v = jnp.broadcast_to(jnp.eye(keys, dtype=jnp.float32)[None, :, None, :],
                       (batch, keys, kv_heads, keys))
  out = jaxflash.attention(q, k, v, is_causal=is_causal, dropout_rate=rate, dropout_rng=rng,
                           broadcast_dropout=broadcast)
  return jnp.transpose(out != 0, (0, 2, 1, 3))  # (B, T, N, S) -> (B, N, T, S)


@pytest.mark.parametrize("keys", [128, 256])
@pytest.mark.parametrize("broadcast", [False, True], ids=["per_head", "broadcast"])
def test_kernel_mask_is_dropout_mask(keys, broadcast, backend):
  """Bit for bit, on every query tile and key tile, for per-head and broadcast masks; the
  broadcast one is the same for every batch item and head."""
  rng, rate = jax.random.key(42), 0.3
  shape = dict(batch=2, heads=4, kv_heads=2, seqlen_q=300, keys=keys)
  ours = kernel_keep_mask(rng, rate, broadcast=broadcast, **shape)
  expected = jaxflash.dropout_mask(rng, (2, 300, 4, keys), (2, keys, 2, keys), rate,
                                   broadcast_dropout=broadcast)
  assert expected.shape == (2, 4, 300, keys)
  mismatch = np.asarray(ours != expected)
  assert not mismatch.any(), (
      f"{int(mismatch.sum())} of {mismatch.size} entries differ from dropout_mask, first at "
      f"{tuple(int(i) for i in np.argwhere(mismatch)[0])}")
  heads_equal = bool(jnp.all(expected == expected[:1, :1]))
  assert heads_equal == broadcast


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kept_fraction(rate, backend):
  """Within 1% of 1 - rate over ~1.6M entries (the sampling error is ~0.1-0.3% of it)."""
  keep = kernel_keep_mask(jax.random.key(int(rate * 10)), rate, batch=2, heads=8, kv_heads=8,
                          seqlen_q=800, keys=128)
  fraction = float(jnp.mean(keep.astype(jnp.float32)))
  assert abs(fraction / (1.0 - rate) - 1.0) < 0.01, (fraction, 1.0 - rate)


def test_causal_rows_keep_their_visible_entries_only(backend):
  """Dropout never makes an invisible entry visible: under causal masking the read-back mask is
  dropout_mask restricted to the lower triangle."""
  rng, rate = jax.random.key(3), 0.5
  ours = kernel_keep_mask(rng, rate, batch=1, heads=2, kv_heads=2, seqlen_q=128, keys=128,
                          is_causal=True)
  expected = jaxflash.dropout_mask(rng, (1, 128, 2, 128), (1, 128, 2, 128), rate)
  expected = expected & jnp.tril(jnp.ones((128, 128), jnp.bool_))
  assert bool(jnp.all(ours == expected))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("broadcast", [False, True], ids=["per_head", "broadcast"])
def test_placed_kernel_mask_is_a_block_of_dropout_mask(dtype, broadcast, backend):
  """A kernel call given its block's place in a larger problem (ring attention's calls:
  Flag.DROPOUT_OFFSETS) applies that block of the problem's mask, bit for bit, forward and
  backward. Read back as in kernel_keep_mask, with T = S = H: the forward's output with V the
  identity, and the backward's dV = (P o keep)ᵀ dO / (1 - rate) with dO the identity. H = 128 in
  16 bits runs the sm_90 kernels' dropout copies on Hopper; offsets 0 are
  test_kernel_mask_is_dropout_mask's."""
  rng, rate, row, col = jax.random.key(8), 0.3, 200, 48  # col: a multiple of 16, not of a tile
  B, N, D = 2, 2, 128
  dtype = jnp.dtype(dtype)
  q = jax.random.normal(jax.random.key(0), (B, D, N, D), jnp.float32).astype(dtype)
  k = jax.random.normal(jax.random.key(1), (B, D, N, D), jnp.float32).astype(dtype)
  eye = jnp.broadcast_to(jnp.eye(D, dtype=dtype)[None, :, None, :], (B, D, N, D))
  call = validate(q, k, eye, dropout_rate=rate, dropout_rng=rng, broadcast_dropout=broadcast)
  config = ring_lib.placed_config(call.config)

  @jax.jit
  def placed(q, k, eye, seed):
    present = dict(seed=ring_lib.placed_seed(seed, call.config.layout("seed"), row, col))
    optional = [present.get(slot, absent(slot, dtype)) for slot in OPTIONAL_INPUTS]
    forward_config = config.replace(flags=config.flags | Flag.OUTPUT_F32)
    o32, lse, _ = kernels.forward_kernel_p.bind(q, k, eye, *optional, config=forward_config)
    _, _, dv, *_ = kernels.backward_kernel_p.bind(
        q, k, eye, *optional, lse, _delta(eye, o32, config), eye,
        absent("dscale_centre", jnp.float32), absent("dalibi_centre", jnp.float32),
        config=config.with_layouts(_gradient_layouts(config)))
    return o32, dv

  o32, dv = placed(q, k, eye, call.seed)
  whole = jaxflash.dropout_mask(rng, (B, row + D, N, D), (B, col + D, N, D), rate,
                                broadcast_dropout=broadcast)
  expected = np.asarray(whole[:, :, row:, col:])  # (B, N, T, S)
  by_output = np.transpose(np.asarray(o32 != 0), (0, 2, 1, 3))  # (B, T, N, S) -> (B, N, T, S)
  by_dv = np.transpose(np.asarray(dv != 0), (0, 2, 3, 1))       # (B, S, N, T) -> (B, N, T, S)
  for what, ours in (("forward", by_output), ("backward", by_dv)):
    mismatch = ours != expected
    assert not mismatch.any(), (
        f"{what}: {int(mismatch.sum())} of {mismatch.size} entries differ from the block of "
        f"dropout_mask, first at {tuple(int(i) for i in np.argwhere(mismatch)[0])}")
  block = dropout_lib.keep_from_seeds(np.asarray(call.seed), D, D,
                                      dropout_lib.keep_threshold_and_scale(rate)[0], row, col)
  assert np.array_equal(np.broadcast_to(block, expected.shape), expected)


def test_mask_has_no_visible_structure():
  """The hash behaves as independent coin flips where dropout would show structure: along rows,
  down columns, between neighbouring seeds' streams and across heads. Correlations of the keep
  indicators (~0.01 sampling error at 10k-60k pairs) stay below 0.03."""
  keep = np.asarray(jaxflash.dropout_mask(jax.random.key(9), (1, 256, 4, 64), (1, 256, 4, 64),
                                          0.5)).astype(np.float64)[0]  # (N, T, S)
  def corr(a, b):
    return abs(float(np.corrcoef(a.ravel(), b.ravel())[0, 1]))
  assert corr(keep[:, :, :-1], keep[:, :, 1:]) < 0.03    # neighbouring keys
  assert corr(keep[:, :, :-8], keep[:, :, 8:]) < 0.03    # keys 8 apart: two halves of one hash
  assert corr(keep[:, :-1, :], keep[:, 1:, :]) < 0.03    # neighbouring queries
  assert corr(keep[:-1], keep[1:]) < 0.03                # neighbouring heads
  assert corr(keep[:, :-1, :-1], keep[:, 1:, 1:]) < 0.03  # the diagonal
  # Consecutive seed words (the worst case for a weak mix): still independent.
  words = jnp.stack([jnp.arange(64, dtype=jnp.uint32), jnp.zeros(64, jnp.uint32)], axis=-1)
  threshold, _ = dropout_lib.keep_threshold_and_scale(0.5)
  rows = np.asarray(dropout_lib.keep_from_seeds(words, 16, 64, threshold)).astype(np.float64)
  assert corr(rows[:-1], rows[1:]) < 0.05
  assert abs(rows.mean() - 0.5) < 0.01


def test_rate_resolves_to_2_to_the_minus_16():
  """Each entry is decided by 16 bits of a hash: the threshold is round(2**16 (1 - rate)),
  kept in [1, 2**16] (a rate within 2**-17 of 1 still keeps 1 in 65536, so kept entries never
  meet a zero keep probability), and the scale stays 1 / (1 - rate)."""
  resolution = jaxflash.contract.DROPOUT_RESOLUTION
  assert resolution == 2**16
  for rate, threshold in ((0.1, 58982), (0.5, 32768), (1e-9, resolution), (1 - 1e-9, 1)):
    got, scale = dropout_lib.keep_threshold_and_scale(rate)
    assert got == threshold, (rate, got)
    assert scale == np.float32(1 / (1 - rate))


def _inputs(dtype=jnp.bfloat16, shape=(2, 70, 4, 32), kv_heads=2):
  keys = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(keys[0], shape, dtype)
  kv_shape = shape[:2] + (kv_heads, shape[3])
  return q, jax.random.normal(keys[1], kv_shape, dtype), jax.random.normal(keys[2], kv_shape, dtype)


def test_reproducible_from_the_key_and_regenerated_in_the_backward(backend):
  """The same key gives bitwise the same output and gradients (the backward regenerates the
  forward's mask, it stores none); another key gives another result."""
  q, k, v = _inputs()

  def run(rng):
    def loss(q, k, v):
      out = jaxflash.attention(q, k, v, is_causal=True, dropout_rate=0.3, dropout_rng=rng)
      return jnp.sum(out.astype(jnp.float32) ** 2), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (grads_a, out_a), (grads_b, out_b) = run(jax.random.key(1)), run(jax.random.key(1))
  for a, b in zip((out_a, *grads_a), (out_b, *grads_b)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  _, out_c = run(jax.random.key(2))
  assert not bool(jnp.all(out_c == out_a))


def test_rate_zero_is_no_dropout(backend):
  """dropout_rate=0 is the plain kernel (bitwise), with or without a key."""
  q, k, v = _inputs()
  plain = jaxflash.attention(q, k, v)
  for rng in (None, jax.random.key(0)):
    out = jaxflash.attention(q, k, v, dropout_rate=0.0, dropout_rng=rng)
    assert np.asarray(out).tobytes() == np.asarray(plain).tobytes()


def test_legacy_raw_key_is_the_typed_key(backend):
  """jax.random.PRNGKey's raw uint32 data and the typed key it wraps give the same mask."""
  q, k, v = _inputs()
  typed = jaxflash.attention(q, k, v, dropout_rate=0.2, dropout_rng=jax.random.key(11))
  raw = jaxflash.attention(q, k, v, dropout_rate=0.2, dropout_rng=jax.random.PRNGKey(11))
  assert np.asarray(raw).tobytes() == np.asarray(typed).tobytes()


def test_vmap_over_keys_and_over_data(backend):
  """vmap with one key per item equals a loop over the items with their keys; vmap over the
  data with a single key applies that key's mask to every item, as the loop does."""
  q, k, v = _inputs(shape=(2, 40, 2, 32), kv_heads=2)
  rngs = jax.random.split(jax.random.key(3), 3)
  qs = jnp.stack([q, q * 0.5, q + 1.0])
  f = lambda q, rng: jaxflash.attention(q, k, v, dropout_rate=0.4, dropout_rng=rng)
  batched = jax.vmap(f)(qs, rngs)
  shared = jax.vmap(f, in_axes=(0, None))(qs, rngs[0])
  for i in range(3):
    assert np.asarray(batched[i]).tobytes() == np.asarray(f(qs[i], rngs[i])).tobytes()
    assert np.asarray(shared[i]).tobytes() == np.asarray(f(qs[i], rngs[0])).tobytes()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_rate=0.1), ValueError, "dropout_rate=0.1 needs a dropout_rng"),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError,
     r"dropout_rate must be in \[0, 1\), got 1.0"),
    (dict(dropout_rate=-0.1, dropout_rng=jax.random.key(0)), ValueError,
     r"dropout_rate must be in \[0, 1\)"),
    (dict(dropout_rate=True, dropout_rng=jax.random.key(0)), TypeError,
     "dropout_rate must be a Python float"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.uint32)), TypeError,
     "dropout_rng must be a jax.random.key or legacy uint32 key data"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0), 2)), ValueError,
     r"dropout_rng must be a single key \(shape \(\)\)"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), broadcast_dropout=1), TypeError,
     "broadcast_dropout must be a bool"),
])
def test_bad_dropout_arguments_are_named(kwargs, error, match):
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  with pytest.raises(error, match=match):
    jaxflash.attention(q, q, q, **kwargs)


def test_traced_rate_is_refused():
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  with pytest.raises(TypeError, match=r"dropout_rate must be a Python float \(a static value"):
    jax.jit(lambda rate: jaxflash.attention(q, q, q, dropout_rate=rate,
                                            dropout_rng=jax.random.key(0)))(0.1)
