"""Numerical tests of jaxflash.attention against jax.nn: forward, dq, dk, dv, dbias and lse, on
every backend present (see conftest.py), through one parametrized test body.

The grid is not a full cartesian product (that would take hours): every masking feature runs
over all sequence-length pairs (shape/layout features over a few), while the dtype and head dim
rotate with the pair so that each feature still meets every dtype and several head dims; a
separate dtype x head-dim grid covers every kernel instantiation on one awkward shape.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import reference
from jaxflash.contract import Flag
from reference import assert_close, assert_rows_zero

DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = (32, 40, 59, 64, 96, 128, 256)  # 59: odd, not a multiple of any vector width

# (T, S) pairs: single query / single key, lengths that are not multiples of any block size,
# T < S and T > S (where top-left and bottom-right alignments differ), one exact 2^k square-ish.
SEQLENS = ((1, 1), (1, 37), (113, 203), (128, 217), (255, 256), (512, 128), (37, 1))


@dataclasses.dataclass(frozen=True)
class Case:
  """One call of jaxflash.attention. Operand shapes: query BTNH (or TNH / TH per `layout`),
  key/value BSKH. `bias`/`mask` spell the operand's axes over "BNTS" with "1" for a broadcast
  axis (e.g. "B11S"); their rank is the string's length."""
  dtype: str = "bfloat16"
  batch: int = 2
  q_len: int = 113
  kv_len: int = 203
  num_heads: int = 2
  num_kv_heads: int = 2
  head_dim: int = 64
  value_head_dim: int | None = None  # value's head dim; None: head_dim (jax.nn's only choice)
  layout: str = "BTNH"  # "BTNH", "TNH" (no batch axis) or "TH" (a single head)
  is_causal: bool = False
  window: int | tuple[int, int] | None = None
  alignment: str = "top_left"
  bias: str | None = None
  bias_dtype: str | None = None  # None: the query dtype
  mask: str | None = None
  q_lengths: bool = False
  kv_lengths: bool = False
  scale: float | None = None
  # The scale as a traced scalar of this dtype (differentiated, a jit argument) rather than a
  # Python float: `scale`, or 0.37 without one.
  traced_scale: str | None = None
  return_residual: bool = False
  input_scale: float = 1.0  # q and k are multiplied by it (large logits)
  bias_neg_inf: bool = False  # ~10% of the bias entries (never key 0) are -inf
  lengths_out_of_range: bool = False  # lengths above T/S and negative (jax.nn clamps)
  precision: str | None = None  # jaxflash's argument (float32: "highest" = exact products)
  dropout_rate: float = 0.0  # > 0: dropout from a fixed key (make_inputs), same mask in the reference
  broadcast_dropout: bool = False
  soft_cap: float | None = None  # logits_soft_cap
  # Segment ids (packed sequences): "docs", documents of about 3/10, 5/10 and 2/10 of the row
  # (padding after them in the second batch item), numbered in order as packing does;
  # "short_docs", documents of 1 to 24 positions (many per tile: tiles skipped next to tiles
  # not, and rows cut at tile boundaries); "tile_docs", documents that end at multiples of 64
  # as well as inside tiles, so that neighbouring tiles have disjoint ids; "random", ids drawn from {0, 1, 2} at every
  # position (no tile can be skipped, some rows see no key).
  segments: str | None = None
  # ALiBi slopes: "N" (one per head), "BN" (per batch item and head), or for the single-head
  # layout "scalar" / "1" (shapes () and (1,)).
  alibi: str | None = None

  def axis_sizes(self):
    return dict(B=self.batch, N=self.num_heads, T=self.q_len, S=self.kv_len)

  def operand_shapes(self):
    """The shapes of query, key, value and the output."""
    B, T, S = self.batch, self.q_len, self.kv_len
    N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
    Hv = self.head_dim if self.value_head_dim is None else self.value_head_dim
    if self.layout == "BTNH":
      q_rows, kv_rows = (B, T, N), (B, S, K)
    elif self.layout == "TNH":
      q_rows, kv_rows = (T, N), (S, K)
    else:
      assert self.layout == "TH" and N == K == 1
      q_rows, kv_rows = (T,), (S,)
    return q_rows + (H,), kv_rows + (H,), kv_rows + (Hv,), q_rows + (Hv,)

  def broadcast_shape(self, spec):
    sizes = self.axis_sizes()
    return tuple(1 if axis == "1" else sizes[axis] for axis in spec)

  def seq_lengths(self):
    """Per-batch lengths: a full/half-padded entry, a fully padded entry (no key, or no query
    at all), so that both 'output 0' paths are exercised. Needs batch == 3."""
    T, S = self.q_len, self.kv_len
    if self.lengths_out_of_range:
      q, kv = np.array([T + 3, -2, T], np.int32), np.array([S + 7, S, -1], np.int32)
    else:
      q = np.array([T, math.ceil(T / 2), 0], np.int32)
      kv = np.array([math.ceil(S / 2), 0, S], np.int32)
    return (jnp.asarray(q) if self.q_lengths else None,
            jnp.asarray(kv) if self.kv_lengths else None)

  def segment_ids(self, key):
    """(query_segment_ids, key_value_segment_ids) for the case's segments, None without."""
    if self.segments is None:
      return None, None
    B, T, S = self.batch, self.q_len, self.kv_len
    if self.segments == "random":
      k_q, k_kv = jax.random.split(key)
      q_ids = jax.random.randint(k_q, (B, T), 0, 3, jnp.int32)
      kv_ids = jax.random.randint(k_kv, (B, S), 0, 3, jnp.int32)
    elif self.segments in ("short_docs", "tile_docs"):  # the same lengths, cut at T and at S
      if self.segments == "short_docs":
        lengths = np.random.RandomState(0).randint(1, 25, (B, max(T, S)))
      else:  # ends at 16, 64, 128, 137, 192, 320, ...
        lengths = np.resize(np.array([16, 48, 64, 9, 55, 128]), (B, max(T, S) // 16 + 1))
        lengths[1::2] = np.roll(lengths[1::2], 1, axis=-1)
      lengths[1::2, -max(T, S) // 40:] = 0  # fewer documents: padding after them
      q_ids, _ = jaxflash.segment_ids_from_lengths(lengths, T)
      _, kv_ids = jaxflash.segment_ids_from_lengths(lengths, S)
    else:
      assert self.segments == "docs", self.segments
      fractions = np.array([[0.3, 0.5, 0.2], [0.15, 0.45, 0.0], [1.0, 0.0, 0.0]])[np.arange(B) % 3]
      q_ids, _ = jaxflash.segment_ids_from_lengths(np.floor(fractions * T).astype(np.int32), T)
      _, kv_ids = jaxflash.segment_ids_from_lengths(np.floor(fractions * S).astype(np.int32), S)
    if self.layout != "BTNH":  # one row of ids, the shape of 3-D and single-head calls
      q_ids, kv_ids = q_ids[0], kv_ids[0]
    return q_ids, kv_ids

  def alibi_slopes(self, key):
    """ALiBi slopes for the case, None without: the usual geometric slopes 2^(-8 (n+1) / N),
    each times a random factor in [0.5, 2) (per batch item too for "BN")."""
    if self.alibi is None:
      return None
    N = self.num_heads
    geometric = 2.0 ** (-8.0 * (np.arange(N) + 1) / N)
    shape = {"N": (N,), "BN": (self.batch, N), "scalar": (), "1": (1,)}[self.alibi]
    factor = jax.random.uniform(key, shape, jnp.float32, 0.5, 2.0)
    return (jnp.asarray(geometric, jnp.float32).reshape(shape[-1:] if shape else ()) * factor)

  def static_kwargs(self):
    kwargs = dict(is_causal=self.is_causal, local_window_size=self.window,
                  return_residual=self.return_residual)
    if self.traced_scale is None:
      kwargs["scale"] = self.scale
    if self.alignment != "top_left":  # keep the jax.nn-compatible call when possible
      kwargs["mask_alignment"] = self.alignment
    if self.precision is not None:
      kwargs["precision"] = self.precision
    if self.dropout_rate > 0.0:
      kwargs.update(dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout)
    if self.soft_cap is not None:
      kwargs["logits_soft_cap"] = self.soft_cap
    return kwargs


# Features (overrides of Case). Masking features depend on positions, so they run on every
# (T, S) pair in SEQLENS; the others (operand shapes, dtypes, layouts) on SEQLENS_FEW.
POSITIONAL_FEATURES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window_8": dict(window=8),
    "window_0_0": dict(window=(0, 0)),
    "window_5_0": dict(window=(5, 0)),
    "window_0_7": dict(window=(0, 7)),
    "causal_window_16": dict(is_causal=True, window=(16, 16)),
    "q_and_kv_lengths": dict(batch=3, q_lengths=True, kv_lengths=True),
    "q_lengths": dict(batch=3, q_lengths=True),
    "kv_lengths_causal": dict(batch=3, kv_lengths=True, is_causal=True),
    "mask_BNTS": dict(mask="BNTS"),
    "mask_B1TS": dict(mask="B1TS"),
    "mask_1N1S": dict(mask="1N1S"),
    "bias_mask_causal": dict(bias="BNTS", mask="B1TS", is_causal=True),
    "residual_mask_lengths": dict(return_residual=True, mask="BNTS", batch=3, q_lengths=True,
                                  kv_lengths=True),
    "bottom_right_causal": dict(alignment="bottom_right", is_causal=True),
    "bottom_right_window_5_0": dict(alignment="bottom_right", window=(5, 0)),
    "bottom_right_causal_lengths": dict(alignment="bottom_right", is_causal=True, batch=3,
                                        q_lengths=True, kv_lengths=True, return_residual=True),
    "everything": dict(num_heads=4, num_kv_heads=2, bias="1NTS", mask="B1TS", is_causal=True,
                       window=(40, 3), batch=3, q_lengths=True, kv_lengths=True,
                       return_residual=True, alignment="bottom_right", scale=0.2),
}
SEQLENS_FEW = ((1, 37), (128, 217), (512, 128))
SHAPE_FEATURES = {
    "gqa_4_2": dict(num_heads=4, num_kv_heads=2),
    "mqa_4_1": dict(num_heads=4, num_kv_heads=1, is_causal=True),
    "mask_TS_rank2": dict(mask="TS"),
    "bias_BNTS": dict(bias="BNTS"),
    "bias_1NTS": dict(bias="1NTS"),
    "bias_B11S": dict(bias="B11S"),
    "bias_11T1": dict(bias="11T1"),
    # jax.nn adds any bias dtype to float32 logits; a drop-in must accept a float32 bias with
    # half-precision q/k/v (and return a float32 dbias).
    "bias_float32": dict(bias="1NTS", bias_dtype="float32"),
    "residual": dict(return_residual=True),
    "layout_TNH": dict(layout="TNH", mask="NTS"),
    "layout_TNH_gqa_bias_causal": dict(layout="TNH", num_heads=4, num_kv_heads=2, bias="NTS",
                                       is_causal=True),
    "layout_TH": dict(layout="TH", num_heads=1, num_kv_heads=1),
    "layout_TH_bias_mask_causal": dict(layout="TH", num_heads=1, num_kv_heads=1, bias="TS",
                                       mask="TS", is_causal=True),
    "explicit_scale": dict(scale=0.3),
    # Logits of several hundred: exp overflows unless the running max is subtracted.
    "large_logits": dict(input_scale=16.0, is_causal=True),
    # An additive -inf mask in the bias (partial rows): no NaN from inf - inf, dbias 0 there.
    "bias_with_neg_inf": dict(bias="BNTS", bias_neg_inf=True),
    "lengths_out_of_range": dict(batch=3, q_lengths=True, kv_lengths=True,
                                 lengths_out_of_range=True),
}
# Attention dropout: the reference applies jaxflash.dropout_mask for the same key (test_dropout
# checks that it is the kernels' mask). With the masking features it meets (lengths, dense mask,
# causal, GQA), a bias whose gradient goes through the dropped P, and every layout.
DROPOUT_FEATURES = {
    "dropout": dict(dropout_rate=0.2),
    "dropout_causal_gqa": dict(dropout_rate=0.5, is_causal=True, num_heads=4, num_kv_heads=2),
    "dropout_broadcast_bias": dict(dropout_rate=0.1, broadcast_dropout=True, bias="1NTS"),
    "dropout_lengths_mask_residual": dict(dropout_rate=0.3, batch=3, q_lengths=True,
                                          kv_lengths=True, mask="B1TS", return_residual=True),
    "dropout_layout_TNH": dict(dropout_rate=0.25, layout="TNH", num_heads=4, num_kv_heads=1),
    "dropout_layout_TH_window": dict(dropout_rate=0.4, layout="TH", num_heads=1, num_kv_heads=1,
                                     window=(9, 2)),
}
# Packed sequences (segment ids), on every (T, S) pair: documents in order (tiles whose ids
# cannot meet are skipped) and random ids (element masking only), with the masks they combine
# with (causal both ways, windows, lengths, dense mask, bias and its gradient, GQA).
SEGMENT_FEATURES = {
    "segments_docs": dict(segments="docs", batch=3),
    "segments_short_docs": dict(segments="short_docs"),
    "segments_random": dict(segments="random"),
    "segments_docs_causal": dict(segments="docs", is_causal=True, batch=3, return_residual=True),
    "segments_docs_bottom_right_causal": dict(segments="docs", is_causal=True, batch=3,
                                              alignment="bottom_right"),
    "segments_window_lengths": dict(segments="tile_docs", window=(20, 5), batch=3,
                                    q_lengths=True, kv_lengths=True),
    "segments_tile_docs_window": dict(segments="tile_docs", window=(70, 70)),
    "segments_short_docs_bottom_right_causal": dict(segments="short_docs", is_causal=True,
                                                    alignment="bottom_right"),
    "segments_bias_mask_gqa": dict(segments="random", bias="1NTS", mask="B1TS", num_heads=4,
                                   num_kv_heads=2, return_residual=True),
}
# Segment ids with the other layouts (ids of shape (T,)), MQA and dropout.
SEGMENT_SHAPE_FEATURES = {
    "segments_layout_TNH_mqa": dict(segments="docs", layout="TNH", num_heads=4, num_kv_heads=1),
    "segments_layout_TH_causal": dict(segments="docs", layout="TH", num_heads=1, num_kv_heads=1,
                                      is_causal=True),
    "segments_dropout_bias_BNTS": dict(segments="docs", batch=3, dropout_rate=0.2, bias="BNTS"),
}
# The logit soft-cap, small enough against the logits that tanh bends them (the reference caps
# its float32 logits in jnp: jax.nn has no soft-cap), with the features it composes with.
SOFTCAP_FEATURES = {
    "softcap": dict(soft_cap=1.5),
    "softcap_large_logits_causal": dict(soft_cap=5.0, input_scale=4.0, is_causal=True),
    "softcap_bias_gqa_lengths": dict(soft_cap=3.0, bias="1NTS", num_heads=4, num_kv_heads=2,
                                     batch=3, q_lengths=True, kv_lengths=True,
                                     return_residual=True),
    "softcap_dropout_mask_window": dict(soft_cap=2.5, dropout_rate=0.2, mask="B1TS",
                                        window=(30, 4)),
}
# A traced scale (a learned temperature): the kernels read it from an operand, and its gradient
# is checked like the others; with the features whose logits it scales (bias after it, the
# soft-cap of the scaled logits, masks, dropout, GQA), large logits, 0 (whose gradient cannot be
# divided out of dq) and a negative scale, in float32 and the half types.
TRACED_SCALE_FEATURES = {
    "traced_scale": dict(traced_scale="float32"),
    "traced_scale_bfloat16_causal_bias_gqa": dict(traced_scale="bfloat16", scale=0.25,
                                                  bias="1NTS", is_causal=True, num_heads=4,
                                                  num_kv_heads=2),
    "traced_scale_softcap_lengths_residual": dict(traced_scale="float32", scale=0.6, soft_cap=3.0,
                                                  batch=3, q_lengths=True, kv_lengths=True,
                                                  return_residual=True),
    "traced_scale_dropout_mask": dict(traced_scale="float32", dropout_rate=0.2, mask="B1TS"),
    # Logits of about +-10 (scale 1.3 at head dim 64): folding the scale into q in the input
    # dtype was measured above 2x jax.nn's error here (docs/DESIGN.md, "A traced scale").
    "traced_scale_large_logits": dict(traced_scale="float32", scale=1.3, head_dim=64,
                                      is_causal=True),
    "traced_scale_zero": dict(traced_scale="float32", scale=0.0, bias="BNTS"),
    "traced_scale_negative_window": dict(traced_scale="float16", scale=-0.5, window=(20, 3)),
}
# float32 with precision="highest": the CUDA kernels' exact (3xTF32) products, compared with the
# exact float32 baseline (on CPU they check that the argument is accepted and changes nothing).
SEQLENS_HIGHEST = ((113, 203),)
HIGHEST_FEATURES = {
    "highest_causal": dict(is_causal=True),
    "highest_bias_BNTS": dict(bias="BNTS"),  # with dbias
    "highest_gqa_4_2": dict(num_heads=4, num_kv_heads=2, q_len=128, kv_len=217),
    "highest_lengths": dict(batch=3, q_lengths=True, kv_lengths=True, return_residual=True),
    "highest_h59": dict(head_dim=59, q_len=255, kv_len=256),
}
# ALiBi (the reference adds it to jax.nn as a dense float32 bias), on every (T, S) pair with
# the masks whose diagonal it shares (causal and windows in both alignments, lengths), and
# on a few with everything else it composes with; the slopes' gradient is compared too.
ALIBI_FEATURES = {
    "alibi": dict(alibi="N"),
    "alibi_BN_causal": dict(alibi="BN", is_causal=True),
    "alibi_window": dict(alibi="N", window=(20, 5)),
    "alibi_bottom_right_causal_lengths": dict(alibi="BN", alignment="bottom_right",
                                              is_causal=True, batch=3, q_lengths=True,
                                              kv_lengths=True, return_residual=True),
    "alibi_bottom_right_window": dict(alibi="N", alignment="bottom_right", window=(9, 2)),
    "alibi_bias_gqa_residual": dict(alibi="N", bias="1NTS", num_heads=4, num_kv_heads=2,
                                    return_residual=True),
}
ALIBI_SHAPE_FEATURES = {
    "alibi_segments_mask": dict(alibi="BN", segments="docs", batch=3, mask="B1TS"),
    "alibi_softcap_causal": dict(alibi="N", soft_cap=2.0, is_causal=True),
    "alibi_dropout_mqa": dict(alibi="N", dropout_rate=0.2, num_heads=4, num_kv_heads=1),
    "alibi_layout_TNH_gqa": dict(alibi="N", layout="TNH", num_heads=4, num_kv_heads=2),
    "alibi_layout_TH_scalar": dict(alibi="scalar", layout="TH", num_heads=1, num_kv_heads=1,
                                   is_causal=True),
    "alibi_layout_TH_1": dict(alibi="1", layout="TH", num_heads=1, num_kv_heads=1),
}
# Zero-size sequence axes (the kernels see null data pointers).
SEQLENS_EMPTY = ((0, 5), (5, 0), (0, 0))
EMPTY_FEATURES = {
    "empty": {},
    "empty_bias_causal_residual": dict(bias="BNTS", is_causal=True, return_residual=True),
}


def _case_id(name, case):
  precision = "" if case.precision is None else f"-{case.precision}"
  value_head_dim = "" if case.value_head_dim is None else f"-hv{case.value_head_dim}"
  return (f"{name}-T{case.q_len}-S{case.kv_len}-{case.dtype}{precision}-h{case.head_dim}"
          f"{value_head_dim}")


def _feature_cases():
  """Features x sequence-length pairs, with the dtype and head dim rotating along both so that
  every feature meets every dtype and several head dims."""
  params = []
  groups = ((POSITIONAL_FEATURES, SEQLENS), (SHAPE_FEATURES, SEQLENS_FEW),
            (DROPOUT_FEATURES, SEQLENS_FEW), (SOFTCAP_FEATURES, SEQLENS_FEW),
            (SEGMENT_FEATURES, SEQLENS), (SEGMENT_SHAPE_FEATURES, SEQLENS_FEW),
            (EMPTY_FEATURES, SEQLENS_EMPTY), (ALIBI_FEATURES, SEQLENS),
            (ALIBI_SHAPE_FEATURES, SEQLENS_FEW), (TRACED_SCALE_FEATURES, SEQLENS))
  i = 0
  for features, seqlens in groups:
    for name, overrides in features.items():
      for j, (T, S) in enumerate(seqlens):
        dtype = DTYPES[(i + j) % len(DTYPES)]
        if overrides.get("bias_dtype") == "float32" and dtype == "float32":
          dtype = "bfloat16"  # the point of that feature is a bias dtype != query dtype
        fields = dict(dict(head_dim=HEAD_DIMS[(i + j) % len(HEAD_DIMS)]), **overrides)
        case = Case(q_len=T, kv_len=S, dtype=dtype, **fields)
        params.append(pytest.param(case, id=_case_id(name, case)))
      i += 1
  for name, overrides in HIGHEST_FEATURES.items():
    for T, S in SEQLENS_HIGHEST:
      fields = dict(dict(q_len=T, kv_len=S, head_dim=64), **overrides)
      case = Case(dtype="float32", precision="highest", **fields)
      params.append(pytest.param(case, id=_case_id(name, case)))
  return params


# The rows of the kernel grid: each dtype, and float32 with exact products (its own kernels).
KERNEL_ROWS = tuple((dtype, None) for dtype in DTYPES) + (("float32", "highest"),)


def _dtype_head_dim_cases():
  """Every (dtype, head dim) kernel instantiation on one shape with ragged lengths; every other
  one with a bias, a mask and causal masking so that the tile-skipping and masking paths run
  in every instantiation family too."""
  params = []
  for i, (dtype, precision) in enumerate(KERNEL_ROWS):
    for j, head_dim in enumerate(HEAD_DIMS):
      name, overrides = (("plain", {}) if (i + j) % 2 == 0 else
                         ("bias_mask_causal", dict(bias="1NTS", mask="B1TS", is_causal=True)))
      case = Case(dtype=dtype, head_dim=head_dim, q_len=128, kv_len=217, precision=precision,
                  **overrides)
      params.append(pytest.param(case, id="kernel-" + _case_id(name, case)))
  return params


def make_inputs(case: Case, key):
  """Rounded random operands, mask, lengths and cotangent(s) for `case`."""
  q_shape, k_shape, v_shape, out_shape = case.operand_shapes()
  dtype = jnp.dtype(case.dtype)
  k_float, k_bias, k_mask, k_ct = jax.random.split(key, 4)
  inputs = reference.random_inputs(k_float, dict(query=q_shape, key=k_shape, value=v_shape),
                                   jnp.float32)
  for name in ("query", "key"):
    inputs[name] = inputs[name] * case.input_scale
  inputs = {name: x.astype(dtype) for name, x in inputs.items()}  # rounded once, here
  inputs["bias"] = None
  if case.bias is not None:
    bias_dtype = jnp.dtype(case.bias_dtype or case.dtype)
    bias = reference.random_inputs(k_bias, dict(bias=case.broadcast_shape(case.bias)),
                                   bias_dtype)["bias"]
    if case.bias_neg_inf:
      s = jnp.arange(bias.shape[-1])
      hidden = (jax.random.uniform(jax.random.fold_in(k_bias, 1), bias.shape) < 0.1) & (s > 0)
      bias = jnp.where(hidden, -jnp.inf, bias).astype(bias_dtype)
    inputs["bias"] = bias
  inputs["mask"] = (reference.random_mask(k_mask, case.broadcast_shape(case.mask))
                    if case.mask is not None else None)
  inputs["query_seq_lengths"], inputs["key_value_seq_lengths"] = case.seq_lengths()
  inputs["dropout_rng"] = (jax.random.key(1234) if case.dropout_rate > 0.0 else None)
  # (A key of its own, so that the other operands stay those of the cases without ids.)
  inputs["query_segment_ids"], inputs["key_value_segment_ids"] = case.segment_ids(
      jax.random.fold_in(key, 5))
  inputs["alibi_slopes"] = case.alibi_slopes(jax.random.fold_in(key, 6))
  if case.traced_scale is not None:
    scale = 0.37 if case.scale is None else case.scale
    inputs["scale"] = jnp.asarray(scale, case.traced_scale)
  cotangents = reference.random_inputs(k_ct, dict(out=out_shape, lse=q_shape[:-1]), dtype)
  cotangent = ((cotangents["out"], cotangents["lse"]) if case.return_residual
               else cotangents["out"])
  return inputs, cotangent


def _dropout_kernel_cases():
  """Dropout in each backward kernel family: every dtype at head dims 64 and 128, where the
  16-bit backward runs the sm_90 kernel on Hopper (the mma.sync one elsewhere), with GQA and
  causal masking alternating."""
  params = []
  for i, dtype in enumerate(DTYPES):
    for j, head_dim in enumerate((64, 128)):
      case = Case(dtype=dtype, head_dim=head_dim, q_len=300, kv_len=300, num_heads=4,
                  num_kv_heads=2, is_causal=(i + j) % 2 == 0, dropout_rate=0.2)
      params.append(pytest.param(case, id="kernel-" + _case_id("dropout", case)))
  return params


# A value head dim Hv other than the query/key one H (jax.nn refuses it; the reference is its
# restated XLA path in float32): MLA's (192, 128), Hv above and below H, odd sizes, the largest
# Hv with a small H; with the features whose code paths read v, o or dO (GQA/MQA, lengths and
# masks that zero rows, dropout on P·V, every layout). The CPU kernels take both head dims; on
# CUDA the lowering zero-pads the smaller one to the larger (kernels.call_with_one_head_dim),
# which test_one_head_dim_call_equals_the_native_call also runs around the CPU kernels.
VALUE_HEAD_DIMS = ((192, 128), (128, 64), (64, 128), (59, 37), (16, 256))
VALUE_HEAD_DIM_FEATURES = {
    "plain": {},
    "causal_gqa_residual": dict(is_causal=True, num_heads=4, num_kv_heads=2,
                                return_residual=True),
    "bias_mask_lengths": dict(bias="1NTS", mask="B1TS", batch=3, q_lengths=True,
                              kv_lengths=True),
    "dropout_softcap_window": dict(dropout_rate=0.2, soft_cap=2.5, window=(30, 4)),
    "alibi_segments_bottom_right": dict(alibi="N", segments="docs", batch=3, is_causal=True,
                                        alignment="bottom_right"),
    "layout_TNH_mqa": dict(layout="TNH", num_heads=4, num_kv_heads=1),
    "layout_TH_causal": dict(layout="TH", num_heads=1, num_kv_heads=1, is_causal=True),
}


def _value_head_dim_cases():
  """Every feature with every (H, Hv) pair, the dtype and (T, S) rotating along both."""
  params = []
  for i, (name, overrides) in enumerate(VALUE_HEAD_DIM_FEATURES.items()):
    for j, (head_dim, value_head_dim) in enumerate(VALUE_HEAD_DIMS):
      T, S = SEQLENS_FEW[(i + j) % len(SEQLENS_FEW)]
      case = Case(q_len=T, kv_len=S, dtype=DTYPES[(i + j) % len(DTYPES)], head_dim=head_dim,
                  value_head_dim=value_head_dim, **overrides)
      params.append(pytest.param(case, id="value_head_dim-" + _case_id(name, case)))
  return params


ALL_CASES = (_feature_cases() + _dtype_head_dim_cases() + _dropout_kernel_cases() +
             _value_head_dim_cases())

# The GPU's larger grid: long and odd sequence lengths (up to 8k, where a tile-indexing or
# 32-bit offset bug shows), every head dim the kernels specialise (and odd ones padded up),
# every dtype and the main features, forward and gradients. GPU only: the CPU kernels are
# tested on the shared grid above, and at these sizes they would take minutes per case.
LARGE_SEQLENS = ((1023, 1023), (2048, 2048), (8192, 8192), (1, 8191), (8191, 1), (3001, 4999),
                 (4999, 3001), (4096, 8192))
LARGE_HEAD_DIMS = (32, 59, 64, 96, 128, 192, 200, 256)
LARGE_FEATURES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window_256": dict(window=(256, 0)),
    "gqa_4_1_causal": dict(num_heads=4, num_kv_heads=1, is_causal=True),
    "bias_1NTS": dict(bias="1NTS"),  # with dbias
    "mask_B1TS": dict(mask="B1TS"),
    "lengths": dict(batch=3, q_lengths=True, kv_lengths=True, num_heads=1, num_kv_heads=1),
    "bottom_right_causal_residual": dict(alignment="bottom_right", is_causal=True,
                                         return_residual=True),
    "dropout_causal_gqa": dict(dropout_rate=0.1, is_causal=True, num_heads=4, num_kv_heads=2),
    "traced_scale_causal_bias": dict(traced_scale="float32", scale=0.2, is_causal=True,
                                     bias="1NTS"),
    # A value head dim of 48 against the rotating H: above and below it (zero-padded on CUDA to
    # one head dim, kernels.call_with_one_head_dim), at the long lengths.
    "value_head_dim_48_causal": dict(value_head_dim=48, is_causal=True),
}


def _large_cases():
  """Every feature on half the lengths (and every length with half the features); the dtype
  and head dim rotate along the cases, so each meets several features and lengths."""
  params = []
  for i, (name, overrides) in enumerate(LARGE_FEATURES.items()):
    for j, (T, S) in enumerate(LARGE_SEQLENS):
      if (i + j) % 2:
        continue
      n = len(params)
      fields = dict(dict(batch=1, num_heads=2, num_kv_heads=2), **overrides)
      case = Case(q_len=T, kv_len=S, dtype=DTYPES[n % len(DTYPES)],
                  head_dim=LARGE_HEAD_DIMS[n % len(LARGE_HEAD_DIMS)], **fields)
      params.append(pytest.param(case, id="large-" + _case_id(name, case)))
  return params


# The sm_90 forward's tile geometry (GPU only, like the large grid): 16-bit at D = 64, whose
# 192-row tiles of three 64-row warpgroups over 128-key tiles let a warpgroup pass the key tiles
# its own rows cannot see (the top ones under causal masking, the bottom ones beyond a window's
# left edge, with the query tile's other warpgroups computing them), and D = 128's 160-key tiles
# from 2k keys, under windows whose edges cross tiles, bottom-right alignment (a diagonal that
# does not fall on tile edges) and lengths (V's padding zeroed in the first key tile). The score
# modifiers' copies in those shapes: the soft-cap's and ALiBi's at D = 64 (three warpgroups),
# ALiBi's 160-key tiles, and the segment ids' copy over 33 key tiles (more than one 32-tile
# window of its walk), packed documents bounding each query tile's key span.
SM90_GEOMETRY = (
    ("window_40_0", "bfloat16", 64, 700, 700, dict(window=(40, 0))),
    ("window_70_70", "float16", 64, 450, 450, dict(window=(70, 70))),
    ("causal_window_100", "float16", 64, 1000, 1000, dict(is_causal=True, window=(100, 0))),
    ("bottom_right_causal", "bfloat16", 64, 577, 900, dict(alignment="bottom_right",
                                                            is_causal=True)),
    ("causal_lengths", "float16", 64, 500, 500, dict(is_causal=True, batch=3, q_lengths=True,
                                                      kv_lengths=True)),
    ("window_200_0", "bfloat16", 128, 2100, 2100, dict(window=(200, 0))),
    ("soft_cap_causal_window_100", "bfloat16", 64, 1000, 1000, dict(soft_cap=5.0, is_causal=True,
                                                                    window=(100, 0))),
    ("alibi_window_40_0", "float16", 64, 700, 700, dict(alibi="N", window=(40, 0))),
    ("alibi_causal_lengths", "bfloat16", 128, 2100, 2100, dict(alibi="BN", is_causal=True, batch=3,
                                                                q_lengths=True, kv_lengths=True)),
    ("segments_docs_causal", "bfloat16", 128, 4200, 4200, dict(segments="docs", is_causal=True)),
    ("segments_short_docs", "float16", 128, 4200, 4200, dict(segments="short_docs")),
)


def _sm90_geometry_cases():
  return [pytest.param(Case(dtype=dtype, head_dim=head_dim, q_len=T, kv_len=S, num_heads=2,
                            num_kv_heads=2, **overrides), id="sm90-" + name)
          for name, dtype, head_dim, T, S, overrides in SM90_GEOMETRY]


@pytest.mark.parametrize("case", ALL_CASES)
def test_attention_matches_reference(case: Case, backend, device):
  check_against_reference(case, backend, device)


@pytest.mark.parametrize("case", _large_cases() + _sm90_geometry_cases())
def test_large_attention_matches_reference(case: Case, backend, device):
  if backend == "cpu":
    pytest.skip("the large grid runs on the GPU only (the CPU kernels take the shared grid)")
  check_against_reference(case, backend, device)


@pytest.mark.parametrize("documents", [1, 16])
def test_packed_documents_of_a_16k_row_match_the_dense_mask(documents, backend, device):
  """Segment ids over one 16k row, causal, 16 heads of 128: the CUDA backward takes its key tiles
  in the order that the longest document's span allows, which the id tables' kernel checks on the
  device (one document spans more rows than L2 keeps: ascending; sixteen of 1k: descending).
  Both orders must give what the same packing gives as a dense mask (the general kernels, which
  the reference checks above). GPU only: the CPU kernels have no such order, and the check runs
  only on rows this long."""
  if backend == "cpu":
    pytest.skip("the CUDA backward's key order (the CPU kernels have none)")
  B, T, H, D = 1, 16384, 16, 128
  q, k, v, do = (jax.device_put(jax.random.normal(key, (B, T, H, D), jnp.bfloat16), device)
                 for key in jax.random.split(jax.random.key(3), 4))
  q_ids, kv_ids = jaxflash.segment_ids_from_lengths(jnp.full((B, documents), T // documents), T)
  mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]

  @jax.jit
  def outputs_and_grads(q, k, v, do, q_ids, kv_ids, mask):
    def attend(**logits):
      call = lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True, **logits)
      out, vjp = jax.vjp(call, q, k, v)
      return (out, *vjp(do))
    return (attend(query_segment_ids=q_ids, key_value_segment_ids=kv_ids), attend(mask=mask))

  logits = jax.device_put((q_ids, kv_ids, mask), device)
  with_ids, with_mask = outputs_and_grads(q, k, v, do, *logits)
  for name, ours, dense in zip(("out", "dq", "dk", "dv"), with_ids, with_mask):
    ours, dense = np.asarray(ours, np.float32), np.asarray(dense, np.float32)
    # Two kernels' bf16 roundings apart: within two bf16 steps of the largest value (measured
    # on the H200: 0.1-0.2 of it).
    bound = 2 * 2.0**-7 * np.max(np.abs(dense))
    err = np.max(np.abs(ours - dense))
    assert err <= bound, (
        f"{documents} documents, {name}: max|ids - dense mask| {err:.3g} > {bound:.3g}")


def check_against_reference(case: Case, backend: str, device):
  """jaxflash's outputs and gradients for `case` on `backend` against the reference, with
  the baseline's error as the yardstick; the drop-in contract (shapes, dtypes, placement); and
  exact zeros for rows that see no key. A traced scale's gradient is checked last, after every
  other result has passed."""
  # Inputs, reference and baseline are made on the CPU; only ours runs on `backend`.
  inputs, cotangent = reference.made_on_cpu(device, lambda: make_inputs(case, jax.random.key(0)))
  static = case.static_kwargs()

  ours, ours_grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **static)
  (ref, ref_grads), (base, base_grads) = reference.reference_and_baseline(
      inputs, cotangent, backend=backend, **static)

  query = inputs["query"]
  if case.return_residual:
    (ours_out, ours_lse), (ref_out, ref_lse), (base_out, base_lse) = ours, ref, base
  else:
    ours_out, ref_out, base_out = ours, ref, base

  # Shapes, dtypes and placement are part of the drop-in contract.
  assert ours_out.shape == case.operand_shapes()[-1] and ours_out.dtype == query.dtype
  assert ours_out.devices() == {device}, f"output on {ours_out.devices()}, expected {device}"
  for operand_name, name in reference.GRAD_NAMES.items():
    if name in ours_grads:
      grad, operand = ours_grads[name], inputs[operand_name]
      assert grad.shape == operand.shape and grad.dtype == operand.dtype, (
          f"{name}: {grad.shape} {grad.dtype}, expected {operand.shape} {operand.dtype}")

  # Scaled q and k scale dk and dq (and their rounding noise) by the same factor.
  floor = case.input_scale
  tolerance = reference.compute_name(backend, case.dtype, case.precision)
  assert_close(ours_out, ref_out, base_out, tolerance, "out", floor=floor)
  if case.return_residual:
    assert ours_lse.shape == query.shape[:-1] and ours_lse.dtype == query.dtype, (
        f"lse: {ours_lse.shape} {ours_lse.dtype}, expected {query.shape[:-1]} {query.dtype}")
    assert_close(ours_lse, ref_lse, base_lse, tolerance, "lse", floor=floor)
  for name in (n for n in ref_grads if n != "dscale"):
    # A slope's gradient sums dS·|s - t - offset| over the head's entries: its terms are
    # distances times unit-scale dS, so it can cancel (to exactly 0 in the reference with one
    # key) from terms as large as the longest distance.
    grad_floor = max(floor, case.q_len, case.kv_len) if name == "dslopes" else floor
    assert_close(ours_grads[name], ref_grads[name], base_grads[name], tolerance, name,
                 floor=grad_floor)
  # Rows with no visible key: exactly 0 (not merely small, never NaN), and so is their dq.
  rows = reference.on_cpu(
      reference.visible_rows, query, inputs["key"], inputs["mask"], is_causal=case.is_causal,
      local_window_size=case.window, query_seq_lengths=inputs["query_seq_lengths"],
      key_value_seq_lengths=inputs["key_value_seq_lengths"], mask_alignment=case.alignment,
      query_segment_ids=inputs["query_segment_ids"],
      key_value_segment_ids=inputs["key_value_segment_ids"])
  assert_rows_zero(ours_out, rows, "out")
  assert_rows_zero(ours_grads["dq"], rows, "dq")

  if "dscale" in ref_grads:
    # dscale = Σ dS∘(q·kᵀ) over every logit, summed in float32 by the kernels (per key row or
    # key tile) and then by XLA; its accumulation noise is allowed for as that of a sum over q's
    # elements (Σ q∘dq, the formula it replaced, whose bar it met on the CPU).
    assert_close(ours_grads["dscale"], ref_grads["dscale"], base_grads["dscale"], tolerance,
                 "dscale", floor=floor, summed_terms=query.size)


@pytest.mark.parametrize("case", _value_head_dim_cases())
def test_one_head_dim_call_equals_the_native_call(case: Case):
  """The CUDA lowering's way with a value head dim Hv other than the query/key one H (zero
  padding to one head dim max(H, Hv) around the kernel, slices after it:
  kernels.call_with_one_head_dim) run around the CPU kernels, on the CPU in every build: its
  outputs and gradients (dslopes, dscale and the lse included) equal the CPU kernels' native
  Hv ≠ H call to one rounding, and both the forward and the backward went through the
  padding. (test_transforms checks the CUDA lowering's layouts, with vmap.)"""
  device = jax.devices("cpu")[0]
  inputs, cotangent = reference.made_on_cpu(device, lambda: make_inputs(case, jax.random.key(0)))
  static = case.static_kwargs()
  with jax.default_device(device):
    native, native_grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent,
                                                       **static)
    with reference.one_head_dim_on_cpu() as padded_calls:
      padded, padded_grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent,
                                                         **static)
  T, S, H, Hv = case.q_len, case.kv_len, case.head_dim, case.value_head_dim
  assert {name for name, _ in padded_calls} == {"jaxflash_fwd_kernel", "jaxflash_bwd_kernel"}
  assert {dims for _, dims in padded_calls} == {(T, S, H, Hv)}, padded_calls
  for i, (ours, want) in enumerate(zip(jax.tree.leaves(padded), jax.tree.leaves(native))):
    assert ours.shape == want.shape and ours.dtype == want.dtype, (i, ours.shape, want.shape)
    reference.assert_same_kernel(ours, want, case.dtype, f"output {i}")
  assert padded_grads.keys() == native_grads.keys()
  for name, want in native_grads.items():
    ours = padded_grads[name]
    assert ours.shape == want.shape and ours.dtype == want.dtype, (name, ours.shape, want.shape)
    reference.assert_same_kernel(ours, want, case.dtype, name)


REFERENCE_SELF_CHECK = ("causal", "window_5_0", "window_0_7", "q_and_kv_lengths", "mask_1N1S",
                        "bias_mask_causal", "bottom_right_causal_lengths", "everything",
                        "segments_docs_causal", "segments_bias_mask_gqa")


@pytest.mark.parametrize("feature", REFERENCE_SELF_CHECK)
def test_reference_is_jax_nn(feature):
  """The test's own machinery: the restated XLA path (the baseline's math, masked by
  reference.visibility) equals jax.nn called with its own masking arguments, in float32, on a
  T > S shape with GQA. This pins `visibility` (used for the zero-row convention and the lse)
  to jax.nn's masking, and the baseline to jax.nn's algorithm."""
  features = {**POSITIONAL_FEATURES, **SEGMENT_FEATURES}[feature]
  case = Case(dtype="float32", q_len=45, kv_len=30,
              **{**features, "num_heads": 4, "num_kv_heads": 2})
  static = case.static_kwargs()

  def both():  # on the CPU, where the reference and baseline always run
    inputs, cotangent = make_inputs(case, jax.random.key(1))
    return (reference.forward_and_grads(reference.reference_attention, inputs, cotangent,
                                        **static),
            reference.forward_and_grads(reference.restated_reference_attention, inputs,
                                        cotangent, **static))

  (jax_nn, jax_nn_grads), (restated, restated_grads) = reference.on_cpu(both)
  for name, a, b in zip(("out", "lse"), jax.tree.leaves(restated), jax.tree.leaves(jax_nn)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
  for name in jax_nn_grads:
    np.testing.assert_allclose(np.asarray(restated_grads[name]), np.asarray(jax_nn_grads[name]),
                               rtol=1e-5, atol=1e-5, err_msg=name)


def test_tf32_baseline_rounds_every_matmul_operand():
  """The test's own machinery: round_to_tf32 rounds to 10 mantissa bits, to nearest with ties
  away from zero; tf32_dot_general rounds both operands, and in its VJP the cotangent and the
  saved operands, then multiplies exactly. (On the CPU, where the baseline runs.)"""
  with jax.default_device(jax.devices("cpu")[0]):
    _check_tf32_rounding()


def _check_tf32_rounding():
  one = 1.0
  values = np.array([one, one + 2**-11, one + 3 * 2**-11, one + 2**-12, -(one + 2**-11),
                     np.inf, -np.inf], np.float32)
  expected = np.array([one, one + 2**-10, one + 2**-9, one, -(one + 2**-10), np.inf, -np.inf],
                      np.float32)
  np.testing.assert_array_equal(np.asarray(reference.round_to_tf32(jnp.asarray(values))),
                                expected)

  a, b, g = (jax.random.normal(jax.random.key(i), shape, jnp.float32)
             for i, shape in enumerate(((5, 7), (7, 3), (5, 3))))
  matmul = lambda a, b: jnp.einsum("ij,jk->ik", a, b, _dot_general=reference.tf32_dot_general)
  out, vjp = jax.vjp(matmul, a, b)
  da, db = vjp(g)
  ra, rb, rg = (np.asarray(reference.round_to_tf32(x), np.float64) for x in (a, b, g))
  np.testing.assert_allclose(np.asarray(out), ra @ rb, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(da), rg @ rb.T, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(db), ra.T @ rg, rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(out) - np.asarray(a) @ np.asarray(b)).max() > 1e-5  # it did round


# (dtype, precision argument, jax.default_matmul_precision context, EXACT_F32 expected)
PRECISION_FLAGS = (
    ("float32", None, None, False),
    ("float32", "default", None, False),
    ("float32", "tensorfloat32", None, False),
    ("float32", "highest", None, True),
    ("float32", "float32", None, True),
    ("float32", jax.lax.Precision.HIGHEST, None, True),
    ("float32", jax.lax.Precision.HIGH, None, False),
    ("float32", None, "highest", True),  # None follows the context at trace time
    ("float32", "default", "highest", False),  # an explicit argument wins
    ("float32", "F32_F32_F32", None, True),
    ("bfloat16", "highest", None, False),  # 16-bit inputs never carry the bit
)


@pytest.mark.parametrize("dtype,precision,context,exact", PRECISION_FLAGS,
                         ids=[f"{d}-{p}-ctx_{c}" for d, p, c, _ in PRECISION_FLAGS])
def test_precision_selects_exact_float32(dtype, precision, context, exact, backend):
  """`precision` reaches both kernels' flags as EXACT_F32 (bit 8), only for float32 inputs."""
  q = jnp.ones((1, 8, 2, 16), dtype)
  fn = jax.jit(jax.grad(lambda q: jnp.sum(jaxflash.attention(q, q, q, precision=precision)
                                          .astype(jnp.float32))))
  if context is None:
    text = fn.lower(q).as_text()
  else:
    with jax.default_matmul_precision(context):
      text = fn.lower(q).as_text()
  flags = [int(f) for f in re.findall(r"flags = (\d+)", text)]
  assert len(flags) == 2, f"expected a forward and a backward call, got flags {flags}"
  assert all(bool(f & Flag.EXACT_F32) == exact for f in flags), flags


def test_only_a_traced_scale_becomes_an_operand(backend):
  """A static scale (a Python float, or a jnp scalar that is not traced) stays the kernels'
  attribute, as before; a traced one (a jit argument) becomes the scale operand (flag
  SCALE_OPERAND in the forward and the backward)."""
  q = jnp.ones((1, 8, 2, 16), jnp.float32)

  def flags(attention, *args):  # of the forward and the backward call
    grad = jax.grad(lambda *a: jnp.sum(attention(*a)))
    return [int(f) for f in re.findall(r"flags = (\d+)", jax.jit(grad).lower(*args).as_text())]

  for static in (0.3, jnp.float32(0.3)):
    found = flags(lambda q: jaxflash.attention(q, q, q, scale=static), q)
    assert len(found) == 2 and not any(f & Flag.SCALE_OPERAND for f in found), found
  found = flags(lambda q, s: jaxflash.attention(q, q, q, scale=s), q, jnp.float32(0.3))
  assert len(found) == 2 and all(f & Flag.SCALE_OPERAND for f in found), found


# (operand keyword, its value, the gradient's flag, the flag its forwards carry): a traced scale's
# centre (jaxflash/attention.py, _dscale_centre), and the ALiBi slopes' (_mean_keys).
_CENTRED_GRADIENTS = {
    "dscale": ("scale", jnp.float32(0.3), Flag.HAS_DSCALE, Flag.SCALE_OPERAND),
    "dalibi": ("alibi_slopes", jnp.array([0.5, 0.25], jnp.float32), Flag.HAS_DALIBI, Flag.HAS_ALIBI),
}


@pytest.mark.parametrize("gradient", sorted(_CENTRED_GRADIENTS))
def test_centre_forward_only_when_differentiated(backend, gradient):
  """The rows' centres of a traced scale's gradient and of the ALiBi slopes' cost one more
  forward call (attention(q, k, v=k), or v = the key positions, in float32 without dropout) only
  when that operand is differentiated (with a soft-cap too). The backward then carries the
  gradient's flag (HAS_DSCALE, HAS_DALIBI)."""
  keyword, value, wanted, forward_flag = _CENTRED_GRADIENTS[gradient]
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  rng = jax.random.key(0)

  def flags(argnums, **kwargs):  # of every jaxflash call in the lowered gradient
    f = lambda q, x: jnp.sum(jaxflash.attention(q, q, q, **{keyword: x}, **kwargs))
    text = jax.jit(jax.grad(f, argnums=argnums)).lower(q, value).as_text()
    return [int(f) for f in re.findall(r"flags = (\d+)", text)]

  found = flags(0)  # q only: no gradient of the operand, no centre
  assert len(found) == 2 and not any(f & wanted for f in found), found
  for kwargs in (dict(dropout_rate=0.2, dropout_rng=rng), dict(logits_soft_cap=2.0)):
    found = flags((0, 1), **kwargs)
    assert len(found) == 3, (kwargs, found)
    assert sum(bool(f & wanted) for f in found) == 1, (kwargs, found)
    forwards = [f for f in found if not f & wanted]  # the training one's and the centre's
    assert all(f & Flag.OUTPUT_F32 and f & forward_flag for f in forwards), (kwargs, found)
    assert sum(bool(f & Flag.DROPOUT) for f in forwards) == ("dropout_rate" in kwargs), (kwargs, found)


@pytest.mark.parametrize("soft_cap", (None, 2.0), ids=("plain", "softcap"))
@pytest.mark.parametrize("return_residual", (False, True), ids=("out", "out_and_lse"))
def test_dscale_centre_takes_out_the_delta_residue(monkeypatch, return_residual, soft_cap, backend):
  """The mechanism of the centre, on any backend: a residue δᵢ added to each row's Δ (what the
  forward's rounding of P leaves there on CUDA, made large here) moves the uncentred dscale by
  −Σᵢ δᵢ·(the row's P-mean of ∂logit/∂scale), the centred one only by δ times the centre's own
  error: its rounding without a soft-cap, with one the distance of f(E) (_dscale_centre) from that
  mean. Unperturbed, the centre changes nothing (against a float32 XLA reference); with a
  differentiated lse (each row of dS then sums to its cotangent) that needs the centre's share
  Σ C·dlse added back. GQA, a bias and causal masking, so that E has every part of the call's P."""
  attention_lib = sys.modules["jaxflash.attention"]  # (jaxflash.attention is the function)
  keys = jax.random.split(jax.random.key(3), 5)
  B, T, S, N, K, H = 2, 37, 53, 4, 2, 32
  q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(keys[1], (B, S, K, H), jnp.float32) + 0.5  # mean logits far from 0
  v = jax.random.normal(keys[2], (B, S, K, H), jnp.float32)
  bias = jax.random.normal(keys[3], (1, N, T, S), jnp.float32)
  ct = jax.random.normal(keys[4], (B, T, N, H), jnp.float32)
  ct_lse = jnp.linspace(-1.0, 1.0, B * T * N, dtype=jnp.float32).reshape(B, T, N)
  # precision="highest": float32-exact products on CUDA too (3xTF32; its default tf32 moves dscale
  # by ~0.3% here, seen on the H100), so that the checks below see the centre's mechanism alone.
  kwargs = dict(is_causal=True, logits_soft_cap=soft_cap, precision="highest")

  def loss(attention, scale):
    out, lse = attention(q, k, v, bias, scale=scale, return_residual=True, **kwargs)
    return jnp.sum(out * ct) + (jnp.sum(lse * ct_lse) if return_residual else 0.0)

  def dscale(attention=jaxflash.attention):
    return float(jax.jit(jax.grad(functools.partial(loss, attention)))(jnp.float32(0.4)))

  def xla_attention(q, k, v, bias, *, scale, soft_cap=None, **_):
    qk = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2),
                    precision=jax.lax.Precision.HIGHEST)
    logits = scale * qk if soft_cap is None else soft_cap * jnp.tanh(scale * qk / soft_cap)
    logits = jnp.where(jnp.arange(S) <= jnp.arange(T)[:, None], logits + bias, -jnp.inf)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1),
                     jnp.repeat(v, N // K, axis=2), precision=jax.lax.Precision.HIGHEST)
    return out, jnp.moveaxis(jax.nn.logsumexp(logits, axis=-1), 1, 2)

  exact = dscale()
  expected = dscale(functools.partial(xla_attention, soft_cap=soft_cap))
  assert abs(exact - expected) <= 1e-4 * max(1.0, abs(expected)), (exact, expected)
  delta = attention_lib._delta
  monkeypatch.setattr(attention_lib, "_delta", lambda *a: delta(*a) + 0.05)
  centred = dscale()
  monkeypatch.setattr(attention_lib, "_dscale_centre",
                      lambda q, *_: jnp.zeros(q.shape[:-1], jnp.float32))
  uncentred = dscale()
  # δ = 0.05 on each of B·T·N rows whose mean logits are several units: the uncentred sum
  # moves by tens.
  assert abs(uncentred - exact) > 1.0, (uncentred, exact)
  if soft_cap is None:
    assert abs(centred - exact) <= 1e-4 * max(1.0, abs(exact)) + 1e-3, (centred, exact)
  else:
    assert abs(centred - exact) <= 0.5 * abs(uncentred - exact), (centred, uncentred, exact)


# Masks under which every visible key of a row lies on one side of its diagonal, where the kernels'
# centre |E[s] - t - offset| is the row's P-mean distance exactly; T > S, so that the rows past the
# keys (top-left) are far from them, and lengths with the bottom-right diagonal (the offset moves
# per batch item).
DALIBI_CENTRE_CASES = {
    "causal": dict(is_causal=True),
    "left_window": dict(local_window_size=(12, 0)),
    "bottom_right_causal_lengths": dict(is_causal=True, mask_alignment="bottom_right",
                                        query_seq_lengths=np.array([53, 30, 0], np.int32),
                                        key_value_seq_lengths=np.array([37, 20, 37], np.int32)),
}


@pytest.mark.parametrize("return_residual", (False, True), ids=("out", "out_and_lse"))
@pytest.mark.parametrize("name", list(DALIBI_CENTRE_CASES))
def test_dalibi_centre_takes_out_the_delta_residue(monkeypatch, name, return_residual, backend):
  """The mechanism of the slopes' centre, on any backend: a residue δ added to each row's Δ (what
  the forward's rounding of P leaves there on CUDA, made large here) moves the uncentred slopes'
  gradient by δ·Σ_t (the row's P-mean distance to the diagonal), the centred one only by δ times
  the centre's own error, which these one-sided masks make a rounding. Unperturbed, the centre
  changes nothing (against a float32 XLA reference); with a differentiated lse (each row of dS then
  sums to its cotangent) that needs the centre's share Σ C·dlse added back, with the kernels' C
  (t + offset, the lengths' bottom-right offset included). GQA, so that each query head's rows of
  dalibi are its own."""
  attention_lib = sys.modules["jaxflash.attention"]  # (jaxflash.attention is the function)
  keys = jax.random.split(jax.random.key(5), 5)
  B, T, S, N, K, H = 3, 53, 37, 4, 2, 32
  inputs = dict(query=jax.random.normal(keys[0], (B, T, N, H), jnp.float32),
                key=jax.random.normal(keys[1], (B, S, K, H), jnp.float32),
                value=jax.random.normal(keys[2], (B, S, K, H), jnp.float32),
                bias=None, mask=None,
                alibi_slopes=jnp.array([0.3, 0.1, 0.03, 0.01], jnp.float32))
  static = dict(DALIBI_CENTRE_CASES[name])
  for slot in ("query_seq_lengths", "key_value_seq_lengths"):
    inputs[slot] = jnp.asarray(static.pop(slot)) if slot in static else None
  ct = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
  ct_lse = jax.random.normal(keys[4], (B, T, N), jnp.float32)
  cotangent = (ct, ct_lse) if return_residual else ct
  static["return_residual"] = return_residual

  def dslopes():  # precision="highest": float32-exact products on CUDA too (3xTF32)
    _, grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent,
                                           precision="highest", **static)
    return np.asarray(grads["dslopes"], np.float64)

  _, ref_grads = reference.forward_and_grads(reference.reference_attention, inputs, cotangent,
                                             **static)
  expected = np.asarray(ref_grads["dslopes"], np.float64)
  exact = dslopes()
  scale = max(1.0, float(np.max(np.abs(expected))))
  assert np.max(np.abs(exact - expected)) <= 1e-4 * scale, (exact, expected)
  delta = attention_lib._delta
  monkeypatch.setattr(attention_lib, "_delta", lambda *a: delta(*a) + 0.05)
  centred = dslopes()
  mean_keys = attention_lib._mean_keys

  def uncentred_keys(q, k, optional, config):  # E = t + offset: the kernels' centre is then 0
    _, sees_key = mean_keys(q, k, optional, config)
    rows = attention_lib.drop_col(config.layout("o"))
    diagonal = attention_lib._diagonal_keys(config, optional, rows)
    return jnp.broadcast_to(diagonal, sees_key.shape), sees_key

  monkeypatch.setattr(attention_lib, "_mean_keys", uncentred_keys)
  uncentred = dslopes()
  # δ = 0.05 on each of the B·T·N rows, whose mean distances reach tens of positions: the
  # uncentred sum moves by far more than 1.
  assert np.max(np.abs(uncentred - exact)) > 1.0, (uncentred, exact)
  assert np.max(np.abs(centred - exact)) <= 1e-4 * scale + 1e-3, (centred, exact)
