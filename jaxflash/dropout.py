"""Attention dropout: which entries of P the kernels drop, from the user's rng key.

The kernels decide each (query t, key s) entry with a counter-based hash of the
instance's two seed words (cuda/dropout.h), so the backward regenerates the
forward's mask from the seeds and nothing T×S is stored. This module derives
the seeds from the key, turns the rate into the kernels' integer threshold, and
restates the hash in jnp (``dropout_mask``): the same mask, bit for bit, for
debugging or for a reference implementation (the tests compare the two).

  row_key(t) = mix(mix(t + seed0) ^ seed1)
  pair(s)    = 8 (s // 16) + s % 8            (keys s and s + 8 share a hash)
  bits(t, s) = mix(row_key(t) ^ pair(s) * 0x9E3779B9)
  keep(t, s) = (bits % 2**16 if s % 16 < 8 else bits // 2**16) < keep_threshold

t and s are positions in the whole problem (mod 2**32): ring attention's kernel calls, each on a
block of it, add the block's first row and key to their own (``keep_from_seeds``' offsets), and
so drop what one call on the whole sequence drops.

One hash decides two entries from 16 bits each, so the rate resolves to 2**-16: an entry is
kept with probability keep_threshold / 2**16, keep_threshold = round(2**16 (1 - rate)) (at
least 1), and kept entries are scaled by 1 / (1 - rate).

Seeds: ``jax.random.bits(dropout_rng, (B, N, 2), uint32)``, one pair per batch
item and query head, or a single pair shared by all of them with
``broadcast_dropout`` (Flax's default).
"""

from __future__ import annotations

from typing import Sequence

from jaxflash.contract import DROPOUT_RESOLUTION

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(0x9E3779B9)
_MIX_MULTIPLIERS = (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))


def keep_threshold_and_scale(rate: float) -> tuple[int, float]:
  """The kernels' integer threshold (keep iff an entry's 16 hash bits are below it, so in
  [1, 2**16]) and the kept entries' scale 1 / (1 - rate), for 0 < rate < 1."""
  keep = 1.0 - rate
  threshold = min(max(int(round(keep * DROPOUT_RESOLUTION)), 1), DROPOUT_RESOLUTION)
  return threshold, float(np.float32(1.0 / keep))


def seed_shape(logits_shape: Sequence[int], broadcast_dropout: bool) -> tuple[int, ...]:
  """Shape of the seed words for logits (B, N, T, S) / (N, T, S) / (T, S): one pair per
  batch item and head, or one pair for all of them."""
  if broadcast_dropout:
    return (2,)
  return tuple(logits_shape[:-2]) + (2,)


def seeds(dropout_rng, logits_shape: Sequence[int], broadcast_dropout: bool) -> jax.Array:
  """The uint32 seed words the kernels read, from a jax.random key (typed, or legacy raw
  uint32 key data)."""
  return jax.random.bits(dropout_rng, seed_shape(logits_shape, broadcast_dropout), jnp.uint32)


def _mix(x):
  x = x ^ (x >> 16)
  x = x * _MIX_MULTIPLIERS[0]
  x = x ^ (x >> 15)
  x = x * _MIX_MULTIPLIERS[1]
  return x ^ (x >> 16)


def keep_from_seeds(seed_words, seqlen_q: int, seqlen_k: int, threshold: int, row_offset: int = 0,
                    col_offset: int = 0) -> jax.Array:
  """Bool (..., T, S) keep mask from seed words (..., 2): cuda/dropout.h in jnp. The offsets
  place the block in a larger problem: its entry (t, s) is that problem's (row_offset + t,
  col_offset + s)."""
  seed0, seed1 = seed_words[..., 0, None], seed_words[..., 1, None]
  t = jnp.arange(seqlen_q, dtype=jnp.uint32) + np.uint32(row_offset % 2**32)
  s = jnp.arange(seqlen_k, dtype=jnp.uint32) + np.uint32(col_offset % 2**32)
  row_key = _mix(_mix(t + seed0) ^ seed1)                      # (..., T)
  pair = ((s >> 4) << 3) | (s & 7)
  bits = _mix(row_key[..., :, None] ^ (pair * _GOLDEN))        # (..., T, S)
  field = jnp.where((s & 8) == 0, bits & 0xFFFF, bits >> 16)
  return field < jnp.uint32(threshold)


def dropout_mask(dropout_rng, query_shape: Sequence[int], key_shape: Sequence[int],
                 dropout_rate: float, *, broadcast_dropout: bool = False) -> jax.Array:
  """The boolean keep mask (True = kept) that ``jaxflash.attention`` applies for these
  dropout arguments, shaped like the logits: (B, N, T, S) for 4-D query (B, T, N, H) and
  key (B, S, K, H), (N, T, S) for 3-D inputs, (T, S) for a single head (2-D).

  Kept probabilities are scaled by 1 / (1 - dropout_rate). Meant for debugging and
  reference implementations: it materialises T×S booleans per head, which the kernels
  never do.
  """
  rank = len(query_shape)
  if rank not in (2, 3, 4) or len(key_shape) != rank:
    raise ValueError(f"jaxflash.dropout_mask: query_shape and key_shape must both have rank 2, 3 "
                     f"or 4, got {tuple(query_shape)} and {tuple(key_shape)}")
  rate = float(dropout_rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"jaxflash.dropout_mask: dropout_rate must be in [0, 1), got {dropout_rate!r}")
  T, S = query_shape[-3 if rank > 2 else -2], key_shape[-3 if rank > 2 else -2]
  logits_shape = ((query_shape[0], query_shape[2]) if rank == 4 else
                  (query_shape[1],) if rank == 3 else ()) + (T, S)
  if rate == 0.0:
    return jnp.ones(logits_shape, jnp.bool_)
  threshold, _ = keep_threshold_and_scale(rate)
  words = seeds(dropout_rng, logits_shape, broadcast_dropout)
  return jnp.broadcast_to(keep_from_seeds(words, T, S, threshold), logits_shape)
