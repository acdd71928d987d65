"""jaxflash as the ``attention_fn`` of Flax's attention modules.

``flax_attention`` takes the arguments that ``flax.linen.MultiHeadDotProductAttention``
and ``flax.nnx.MultiHeadAttention`` pass to their ``attention_fn`` (linen passes only the
keyword arguments the function's signature names, so every one it may pass is named here,
and the ones jaxflash cannot honour raise instead of being dropped silently).

Masks. Flax modules receive their mask as a dense ``(batch..., 1 or heads, T, S)`` array,
usually from ``make_causal_mask`` and ``make_attention_mask`` (padding, or documents:
``make_attention_mask(ids, ids, jnp.equal)``). Read as such, the kernels would stream that T×S
mask tile by tile and could skip nothing. So a mask shared by the heads is classified on the
device first (:func:`mask_structure`), and the kernels get an equivalent description instead
where the mask has one, with or without ``s <= t`` (top-left causal):

- "query ``t < q_len[b]`` sees key ``s < kv_len[b]``" (prefix padding of queries and keys, a
  causal mask, or both): ``is_causal`` and the sequence lengths;
- "query ``t`` sees key ``s`` where ``q_ids[b, t] == kv_ids[b, s]``" (packed documents, any
  padding included): ``is_causal`` and segment ids. The ids are derived from the mask: a row's
  id is its first visible key (``QUERY_PADDING_ID`` where it sees none), a key's is the
  smallest id of the rows that see it (``KEY_VALUE_PADDING_ID`` where none does). For every
  mask of that form, whatever the ids it was made from, these reproduce it: every row that sees
  a key of a document sees the document's first key first, and only the document's rows see its
  keys. That holds for T != S
  (cross-attention, keys packed apart from the queries) and for documents in any order; with
  documents contiguous along the row, the kernels also skip the tiles between them.

Nothing is trusted: the structures are checked against the whole mask (:func:`mask_structure`:
the two reductions that give the lengths and ids, then every structure checked in one
elementwise pass), and what fits none reaches the kernels as it is. The kernel call is then
picked by one switch, :func:`jaxflash.attention.attention_switch`: one ``custom_vjp`` whose
forward switches over the candidate calls' forward kernels and whose backward over their
backward, with one set of residuals. Not a switch over ``attention()`` calls: under
differentiation a conditional outputs the union of its branches' residuals, and those of an
``attention()`` call include its inputs, so the switch wrote copies of q, k, v, the mask and
the ids besides the float32 output. Every
kernel call is compiled, one runs (under ``vmap`` of the whole call the switches become
selects, and all run); forward and gradients are bit for bit the picked call's.

Packed sequences by ids. ``flax_attention`` also takes ``query_segment_ids`` /
``key_value_segment_ids`` itself (bind them per call, e.g. ``functools.partial(
jaxflash.flax_attention, query_segment_ids=ids, key_value_segment_ids=ids)`` as the module's
``attention_fn``) and combines them with whatever mask the module passes; a mask is then not
turned into ids (the kernels take one pair), only into lengths.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash.attention import attention, attention_switch
from jaxflash.packing import KEY_VALUE_PADDING_ID, QUERY_PADDING_ID

# What mask_structure returns: the call each kind of mask runs as.
DENSE, PADDING, CAUSAL_PADDING, SEGMENTS, CAUSAL_SEGMENTS = range(5)
# When the mask has several of these structures (a padding mask is also one document followed by
# padding), the first that fits: lengths run in every kernel, segment ids only in CUDA's general
# (mma.sync) ones.
_PREFERENCE = (CAUSAL_PADDING, PADDING, CAUSAL_SEGMENTS, SEGMENTS)


class MaskStructure(NamedTuple):
  """What :func:`mask_structure` finds: the kind (an int32 scalar) and, per batch item, the
  lengths and segment ids that reproduce the mask when the kind says so."""
  kind: jax.Array
  query_seq_lengths: jax.Array  # int32 (B,)
  key_value_seq_lengths: jax.Array  # int32 (B,)
  query_segment_ids: jax.Array  # int32 (B, T)
  key_value_segment_ids: jax.Array  # int32 (B, S)


def mask_structure(mask) -> MaskStructure:
  """Classifies a boolean ``(B, T, S)`` mask.

  The kind is ``PADDING`` when ``mask[b, t, s] == (t < q_len[b]) & (s < kv_len[b])`` for every
  element, ``SEGMENTS`` when ``mask[b, t, s] == (q_ids[b, t] == kv_ids[b, s])``, ``CAUSAL_*``
  when it equals that and ``s <= t``, else ``DENSE`` (the first that fits of ``CAUSAL_PADDING``,
  ``PADDING``, ``CAUSAL_SEGMENTS``, ``SEGMENTS``). ``q_len`` / ``kv_len`` count the rows that
  see a key and the keys that a row sees. ``q_ids[b, t]`` is row t's first visible key, or
  ``QUERY_PADDING_ID`` (-1) where it sees none; ``kv_ids[b, s]`` is the smallest id of the rows
  that see key s, or ``KEY_VALUE_PADDING_ID`` (-2) where none does (see the module docstring
  for why these reproduce every mask of the segment form).
  """
  _, t_len, s_len = mask.shape
  t = lax.broadcasted_iota(jnp.int32, (1, t_len, s_len), 1)
  s = lax.broadcasted_iota(jnp.int32, (1, t_len, s_len), 2)
  first_key = jnp.min(jnp.where(mask, s, s_len), axis=2, initial=s_len)  # (B, T), S: none
  sees_a_key = first_key < s_len
  q_ids = jnp.where(sees_a_key, first_key, QUERY_PADDING_ID)
  smallest_seeing_id = jnp.min(jnp.where(mask, q_ids[:, :, None], s_len), axis=1,
                               initial=s_len)  # (B, S), S: no row sees the key
  is_seen = smallest_seeing_id < s_len
  kv_ids = jnp.where(is_seen, smallest_seeing_id, KEY_VALUE_PADDING_ID)
  q_len = jnp.sum(sees_a_key, axis=1, dtype=jnp.int32)
  kv_len = jnp.sum(is_seen, axis=1, dtype=jnp.int32)

  box = (t < q_len[:, None, None]) & (s < kv_len[:, None, None])
  same_segment = q_ids[:, :, None] == kv_ids[:, None, :]
  candidates = {PADDING: box, CAUSAL_PADDING: box & (s <= t), SEGMENTS: same_segment,
                CAUSAL_SEGMENTS: same_segment & (s <= t)}
  # One check per kind, whether the mask differs from its candidate anywhere: sibling reductions
  # of the same mask, which XLA fuses into one pass. (As one bitwise-or reduction of the four
  # mismatch bits, a sharded mask made it an all-reduce of bitwise-or, which XLA's CPU runtime
  # does not implement: UNIMPLEMENTED, under data-parallel jit.)
  broken = {kind: jnp.any(mask != candidate) for kind, candidate in candidates.items()}
  kind = jnp.int32(DENSE)
  for preferred in reversed(_PREFERENCE):
    kind = jnp.where(broken[preferred], kind, preferred)
  return MaskStructure(kind, q_len, kv_len, q_ids, kv_ids)


def _precision_name(precision):
  """Flax's PrecisionLike (None, a name, a lax.Precision or a pair of them) as one value for
  jaxflash.attention: of a pair, the higher precision, since both operands go through the same
  products."""
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2:
      raise ValueError(f"flax_attention: precision must be None, a precision or a pair of them; "
                       f"got {precision!r}")
    levels = [lax.Precision(p) if p is not None else lax.Precision.DEFAULT for p in precision]
    return max(levels, key=lambda p: p.value)
  return precision


def _merge_batch(x, batch_shape, name):
  """(batch..., a, b, c) -> (prod(batch), a, b, c), broadcasting x's leading axes to the
  query's batch shape first."""
  if x.ndim - 3 > len(batch_shape):
    raise ValueError(f"flax_attention: {name} has shape {x.shape}, more leading (batch) axes than "
                     f"the query's batch shape {tuple(batch_shape)}")
  x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[-3:])
  return x.reshape((math.prod(batch_shape),) + x.shape[-3:])


def _merge_batch_ids(ids, batch_shape):
  """(batch..., length) segment ids -> (prod(batch), length), as _merge_batch merges q/k/v."""
  if ids is None or jnp.ndim(ids) != len(batch_shape) + 1:
    return ids  # None, or a shape jaxflash.attention refuses by name
  ids = jnp.asarray(ids)
  return ids.reshape((math.prod(batch_shape), ids.shape[-1]))


def flax_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                   dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                   dtype=None, precision=None, module=None, is_causal: bool = False,
                   force_fp32_for_softmax: bool = False, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None, logits_soft_cap: float | None = None,
                   query_segment_ids=None, key_value_segment_ids=None, alibi_slopes=None):
  """Attention in Flax's ``attention_fn`` convention, computed by jaxflash's kernels.

  Use it as ``nnx.MultiHeadAttention(..., attention_fn=jaxflash.flax_attention)`` or
  ``linen.MultiHeadDotProductAttention(..., attention_fn=jaxflash.flax_attention)``.

  Args:
    query: ``(batch..., T, N, H)``.
    key, value: ``(batch..., S, K, H)`` and ``(batch..., S, K, Hv)``, ``N % K == 0``; the value
      head dim ``Hv`` may differ from ``H`` (:func:`jaxflash.attention`'s CPU kernels).
    bias: added to the logits, broadcastable to ``(batch..., N, T, S)``.
    mask: True (or nonzero) = attend, broadcastable to ``(batch..., N, T, S)``. A mask shared
      by the heads that is a causal and/or prefix-padding mask runs as ``is_causal`` and
      sequence lengths (see the module docstring).
    dropout_rate, deterministic, dropout_rng, broadcast_dropout: attention dropout, in the
      kernels (see :func:`jaxflash.attention`), when ``dropout_rate > 0`` and not
      ``deterministic``. Flax's semantics (kept weights scaled by ``1 / (1 - rate)``; with
      ``broadcast_dropout`` one mask for all batch items and heads), but jaxflash's own mask
      for a key: the same distribution as Flax's, not the same bits.
    dtype: the computation dtype; query, key and value are cast to it when given.
    precision: for float32 inputs, as :func:`jaxflash.attention`'s (a pair takes the higher).
    module: set by Flax when the module sows its attention weights, which FlashAttention never
      forms: raises.
    is_causal: (nnx) causal masking on top of ``mask``.
    force_fp32_for_softmax: accepted; jaxflash's softmax is always float32.
    qk_attn_weights_einsum, attn_weights_value_einsum: custom einsums (AQT) cannot run inside
      the kernels: anything but None raises.
    logits_soft_cap: :func:`jaxflash.attention`'s (not a Flax argument: bind it with
      ``functools.partial(jaxflash.flax_attention, logits_soft_cap=50.0)``).
    query_segment_ids, key_value_segment_ids: packed sequences, :func:`jaxflash.attention`'s,
      shaped ``(batch..., T)`` and ``(batch..., S)`` (not Flax arguments: bind them with
      ``functools.partial`` for the call; see the module docstring). Combined with ``mask``.
    alibi_slopes: ALiBi, :func:`jaxflash.attention`'s, shaped ``(N,)`` or ``(batch..., N)``
      (not a Flax argument: bind it with ``functools.partial``). Its distances are top-left
      aligned (``|s - t|``), as everything in this adapter.

  Returns:
    ``(batch..., T, N, Hv)`` (``Hv`` the value's head dim, usually the query's) in the query's
    dtype (``dtype`` when given).
  """
  del force_fp32_for_softmax
  if module is not None:
    raise ValueError("flax_attention: the module asked to sow its attention weights "
                     "(sow_weights=True), which FlashAttention never materialises")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    raise ValueError("flax_attention: custom attention einsums (qk_attn_weights_einsum, "
                     "attn_weights_value_einsum) are not supported; jaxflash runs its own kernels")
  if dtype is not None:
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  for name, x in (("query", query), ("key", key), ("value", value)):
    if jnp.ndim(x) < 3:
      raise ValueError(f"flax_attention: {name} must be (batch..., length, heads, head_dim); "
                       f"got shape {jnp.shape(x)}")
  batch_shape = query.shape[:-3]
  if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
    raise ValueError(f"flax_attention: query, key and value must share their batch axes; got "
                     f"{query.shape}, {key.shape}, {value.shape}")
  q, k, v = (_merge_batch(x, batch_shape, n) for x, n in ((query, "query"), (key, "key"),
                                                          (value, "value")))
  if bias is not None:
    bias = _merge_batch(jnp.asarray(bias), batch_shape, "bias") if jnp.ndim(bias) > 3 else bias
  if mask is not None:
    mask = jnp.asarray(mask)
    mask = mask if mask.dtype == jnp.bool_ else mask != 0
    mask = _merge_batch(mask, batch_shape, "mask") if mask.ndim > 3 else mask
  options = dict(precision=_precision_name(precision), logits_soft_cap=logits_soft_cap)
  if query_segment_ids is not None or key_value_segment_ids is not None:
    # jaxflash.attention checks them (both given, integer, their shapes) on the merged batch.
    options.update(query_segment_ids=_merge_batch_ids(query_segment_ids, batch_shape),
                   key_value_segment_ids=_merge_batch_ids(key_value_segment_ids, batch_shape))
  if alibi_slopes is not None:
    slopes = jnp.asarray(alibi_slopes)
    # jaxflash.attention checks the shape ((N,) or (B, N)) on the merged batch.
    options.update(alibi_slopes=slopes if slopes.ndim <= 1 else
                   slopes.reshape((math.prod(batch_shape), slopes.shape[-1])))
  if dropout_rate > 0.0 and not deterministic:
    options.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                   broadcast_dropout=bool(broadcast_dropout))
  out = _attend(q, k, v, bias, mask, is_causal, options)
  return out.reshape(query.shape[:-1] + value.shape[-1:])


def _attend(q, k, v, bias, mask, is_causal, options):
  """attention() with `options` (precision, soft-cap, segment ids, ALiBi, dropout), the mask run
  as causal, lengths and segment ids where it has that structure."""
  if mask is None:
    return attention(q, k, v, bias, **options, is_causal=is_causal)
  b, t_len, s_len = q.shape[0], q.shape[1], k.shape[1]
  if mask.ndim < 3 or mask.shape[-3] != 1 or any(n not in (1, m) for n, m in
                                                   zip(mask.shape[-2:], (t_len, s_len))):
    # Per-head masks go to the kernels as they are (as do malformed ones: attention() says why).
    return attention(q, k, v, bias, **options, mask=mask, is_causal=is_causal)
  shared = jnp.broadcast_to(mask[..., 0, :, :], (b, t_len, s_len))
  return run_as(mask_structure(shared), q, k, v, bias, mask, is_causal, options)


def candidates(found: MaskStructure, mask, is_causal, options):
  """The kernel call that `found` says reproduces `mask`: ``(kind, calls)``, the index of the
  call in `calls`, each call the attention() arguments that mask the logits (DENSE: the mask as
  it is, then by kind PADDING, CAUSAL_PADDING, SEGMENTS, CAUSAL_SEGMENTS)."""
  kind = found.kind
  if is_causal:  # the mask and causality: padding becomes causal padding, segments causal ones
    kind = jnp.where(kind == PADDING, CAUSAL_PADDING,
                     jnp.where(kind == SEGMENTS, CAUSAL_SEGMENTS, kind))
  lengths = dict(query_seq_lengths=found.query_seq_lengths,
                 key_value_seq_lengths=found.key_value_seq_lengths)
  calls = [dict(mask=mask, is_causal=is_causal),  # DENSE
           dict(**lengths),  # PADDING
           dict(is_causal=True, **lengths)]  # CAUSAL_PADDING
  if "query_segment_ids" in options:
    # The kernels take one pair of ids, the caller's: a segment mask is read as it is.
    kind = jnp.where(kind >= SEGMENTS, DENSE, kind)
  else:
    ids = dict(query_segment_ids=found.query_segment_ids,
               key_value_segment_ids=found.key_value_segment_ids)
    calls += [dict(**ids),  # SEGMENTS
              dict(is_causal=True, **ids)]  # CAUSAL_SEGMENTS
  return kind, calls


def run_as(found: MaskStructure, q, k, v, bias, mask, is_causal, options):
  """The kernel call that `found` says reproduces `mask`, picked on the device among every
  candidate call (compiled all; one runs) by attention_switch: one differentiable unit whose
  forward and backward are one switch each, with one set of residuals (see its docstring for
  why not a switch over attention() calls). Apart from _attend so that
  benchmarks/flax_mask_path.py can time the switch without the classification."""
  kind, calls = candidates(found, mask, is_causal, options)
  return attention_switch(kind, q, k, v, bias, candidates=calls, **options)
