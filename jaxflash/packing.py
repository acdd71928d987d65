"""Packed sequences: segment ids from the lengths of the documents packed into each row.

Several documents packed one after another into a row of T positions attend only within
themselves when jaxflash.attention gets ``query_segment_ids`` / ``key_value_segment_ids``
(a query sees a key only where their ids are equal). FlashAttention's varlen interface
describes the same packing by ``cu_seqlens``, the cumulative document lengths
``[0, l0, l0 + l1, ...]``; :func:`segment_ids_from_lengths` turns the lengths into ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The ids of the positions after the last document: different from each other and from every
# document's id, so that padding queries see no key (their output is 0, like any row that sees
# no key) and padding keys are seen by no query.
QUERY_PADDING_ID = -1
KEY_VALUE_PADDING_ID = -2


def segment_ids_from_lengths(lengths, total: int) -> tuple[jax.Array, jax.Array]:
  """Segment ids for documents packed one after another from position 0 of each row.

  Args:
    lengths: integer ``(B, D)`` (or ``(D,)`` for one row): the lengths of the row's documents
      in order, zeros for unused slots (rows with fewer documents). May be traced.
    total: the row length T (a Python int).

  Returns:
    ``(query_segment_ids, key_value_segment_ids)``, int32 ``(B, total)`` (``(total,)``): the
    positions of document ``j`` get id ``j`` in both; positions after the last document get
    ``QUERY_PADDING_ID`` (-1) in the query ids and ``KEY_VALUE_PADDING_ID`` (-2) in the key/value
    ids, so that a padding query sees no key (output 0, logsumexp -inf) and no query sees a
    padding key. Documents reaching past ``total`` are cut there; negative lengths count as 0.
    For keys packed differently from the queries (cross-attention), take the key/value ids of
    a second call with the keys' lengths and S.

  Example: lengths ``[[3, 2, 0]]`` and total 6 give query ids ``[[0, 0, 0, 1, 1, -1]]`` and
  key/value ids ``[[0, 0, 0, 1, 1, -2]]``; FlashAttention's ``cu_seqlens`` for that row would
  be ``[0, 3, 5]``.
  """
  if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 0:
    raise TypeError(f"jaxflash.segment_ids_from_lengths: total must be a Python int >= 0, got "
                    f"{total!r}")
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer) or lengths.ndim not in (1, 2):
    raise TypeError(f"jaxflash.segment_ids_from_lengths: lengths must be an integer array of "
                    f"shape (B, D) or (D,), got {lengths.dtype} of shape {tuple(lengths.shape)}")
  ends = jnp.cumsum(jnp.maximum(lengths, 0).astype(jnp.int32), axis=-1)  # cu_seqlens[1:]
  positions = jnp.arange(total, dtype=jnp.int32)
  # A position's document is the number of documents that end at or before it; past the last
  # one, the position is padding.
  documents_ended = lambda ends: jnp.searchsorted(ends, positions, side="right").astype(jnp.int32)
  document = documents_ended(ends) if ends.ndim == 1 else jax.vmap(documents_ended)(ends)
  padding = document >= lengths.shape[-1]
  return (jnp.where(padding, QUERY_PADDING_ID, document),
          jnp.where(padding, KEY_VALUE_PADDING_ID, document))
