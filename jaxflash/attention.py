"""jaxflash.attention and jaxflash.ring_attention: the public API.

A drop-in for :func:`jax.nn.dot_product_attention`. Each call is checked and
described for the kernels by jaxflash/validation.py; this file wires the
forward and backward primitives (jaxflash/primitives.py) into a
``jax.custom_vjp``, and ring attention's forward and backward
(jaxflash/ring.py) into another.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxflash import primitives
from jaxflash import ring as ring_lib
from jaxflash.contract import OPTIONAL_INPUTS, Flag, KernelConfig, absent
from jaxflash.layout import COL, ROW, Layout, drop_col, role_axis, with_cols, with_rows
from jaxflash.validation import validate, validate_ring


def attention(query, key, value, bias=None, mask=None, *, scale: float | jax.Array | None = None,
              is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
              local_window_size: int | tuple[int, int] | None = None,
              implementation: None = None, return_residual: bool = False,
              mask_alignment: Literal["top_left", "bottom_right"] = "top_left",
              precision: str | jax.lax.Precision | None = None, dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None, broadcast_dropout: bool = False,
              logits_soft_cap: float | None = None, query_segment_ids=None,
              key_value_segment_ids=None, alibi_slopes=None):
  r"""Scaled dot-product attention, computed by jaxflash's FlashAttention kernels.

  Same arguments, shapes and semantics as :func:`jax.nn.dot_product_attention`:
  ``softmax(scale * Q·Kᵀ + bias, masked) · V`` per head.

  Args:
    query: ``(B, T, N, H)``, ``(T, N, H)``, or a single head ``(T, H)``.
    key, value: ``(B, S, K, H)``, ``(S, K, H)`` or ``(S, H)``; ``N % K == 0``
      (grouped-query attention; ``K == 1`` is multi-query). float32, float16 or
      bfloat16, all three the same dtype; ``H <= 256``. ``value``'s head dim ``Hv``
      (``<= 256``) may differ from ``H`` (jax.nn's may not), e.g. MLA's ``(192, 128)``; on
      a GPU the call then runs zero-padded to ``max(H, Hv)`` features around the CUDA kernels
      (which take one head dim), its results sliced back.
    bias: added to the logits; broadcastable to ``(B, N, T, S)`` (to ``(N, T, S)``
      for 3-D inputs, ``(T, S)`` for a single head), at most that rank; leading
      axes are added as in jax.nn. Differentiable.
    mask: boolean, True = attend; broadcastable like ``bias``.
    scale: logit scale, default ``1 / sqrt(H)``: a Python float, or a floating-point array of
      shape ``()``, which may be traced (a learned temperature, differentiable; under vmap
      each item may have its own). A NaN or infinite traced scale cannot be refused and gives
      NaN.
    is_causal: key ``s`` is visible from query ``t`` only if ``s <= t``
      (top-left aligned, as jax.nn; see ``mask_alignment``).
    query_seq_lengths, key_value_seq_lengths: int32 ``(B,)`` (a scalar for a
      single head); queries ``t >= q_len`` output 0, keys ``s >= kv_len`` are
      never visible.
    local_window_size: ``w`` or ``(left, right)``: query ``t`` sees keys
      ``t - left <= s <= t + right``.
    implementation: must be None; jaxflash always runs its own kernels.
    return_residual: also return the logsumexp of the logits, shape
      ``(B, T, N)`` (``(T, N)``, ``(T,)``) in the query dtype.
    mask_alignment: ``"top_left"`` (jax.nn) or ``"bottom_right"``: the causal
      and window diagonal ends at the last query and key (offset
      ``kv_len - q_len``), as FlashAttention >= 2.1 does for ``T != S``.
    precision: the products' precision for float32 inputs, as for
      :func:`jax.numpy.matmul`: None (``jax.config.jax_default_matmul_precision``
      at trace time, so ``with jax.default_matmul_precision("highest"):``
      applies), a name that :func:`jax.default_matmul_precision` takes
      (``"default"``, ``"high"``, ``"highest"``, ``"tensorfloat32"``,
      ``"float32"``, ...) or a :class:`jax.lax.Precision`. ``"highest"`` /
      ``"float32"`` (and any algorithm at least float32-accurate) give
      float32-accurate products; everything else lets the CUDA kernels use
      tf32 tensor cores, like XLA's own float32 default on Ampere and later.
      The CPU kernels are always float32-exact; 16-bit inputs are unaffected.
    dropout_rate: attention dropout, a Python float in ``[0, 1)``: each entry of
      the softmax is dropped with this probability and the kept ones are scaled
      by ``1 / (1 - dropout_rate)``; the normaliser (and the logsumexp) are the
      undropped softmax's. 0 turns dropout off.
    dropout_rng: a :func:`jax.random.key` (or legacy ``PRNGKey``), required when
      ``dropout_rate > 0``. The same key gives the same mask; the backward
      regenerates it, nothing ``T×S`` is stored. :func:`jaxflash.dropout_mask`
      returns it.
    broadcast_dropout: one mask for every batch item and head (Flax's
      ``broadcast_dropout=True``) rather than one per (batch item, head).
    logits_soft_cap: ``cap``, a Python float > 0, or None: the scaled logits
      become ``cap * tanh(scale * q·k / cap)`` before the bias is added and the
      masks apply (Gemma 2's soft-capping; FlashAttention's ``softcap``,
      tokamax's ``logits_soft_cap``). On CUDA the forward runs it in the general
      kernels; on Hopper the 16-bit backward at head dims 64 / 128 in its wgmma
      kernel (without dropout).
    query_segment_ids, key_value_segment_ids: packed sequences: int32 ``(B, T)`` and
      ``(B, S)`` (``(T,)`` and ``(S,)`` for 3-D inputs and a single head); query ``t`` sees key
      ``s`` only if ``query_segment_ids[b, t] == key_value_segment_ids[b, s]``, on top of every
      other mask (as a boolean mask would combine with them in jax.nn). Both or neither; for
      self-attention pass the same array twice. Ids are any int32 values (not necessarily
      sorted or contiguous), but key tiles are skipped only where the ids' ranges do not meet,
      so documents numbered in order along the row are fastest.
      :func:`jaxflash.segment_ids_from_lengths` builds them from document lengths. Pallas
      splash attention's and Transformer Engine's name; FlashAttention's varlen
      ``cu_seqlens`` are the cumulative document lengths of the same packing.
    alibi_slopes: ALiBi, float32 ``(N,)`` or ``(B, N)`` (``(N,)`` for 3-D inputs, a scalar or
      ``(1,)`` for a single head), one slope per query head (GQA: per query head, not per kv
      head): the logit of query ``t`` and key ``s`` gets ``-slope * |s - t - offset|``, the
      distance to the diagonal that ``is_causal`` and windows use: ``offset`` is 0 with
      ``mask_alignment="top_left"``, ``kv_len - q_len`` with ``"bottom_right"`` (the lengths
      after ``query_seq_lengths`` / ``key_value_seq_lengths``), which is FlashAttention's
      ``alibi_slopes`` exactly (``|i + seqlen_k - seqlen_q - j|``). Added after
      ``logits_soft_cap`` (uncapped), with ``bias``, as FlashAttention adds it; computed in the
      kernel (no ``T×S`` array). Differentiable on every backend: the kernels sum the slopes'
      gradient per key row of each query head, centred on each query row's mean distance to
      the diagonal, which one more forward call gives (made only when the slopes are
      differentiated); on CUDA the backward then runs its general (mma.sync) kernels, on
      Hopper too. Concrete slopes must be finite.

  Returns:
    The attention output, shaped like ``query`` with ``value``'s head dim (``(B, T, N, Hv)``);
    with ``return_residual``, a tuple ``(output, logsumexp)``.

  Differences from jax.nn.dot_product_attention: a query row that sees no key
  outputs 0 and has logsumexp ``-inf`` (jax.nn averages V there); the returned
  logsumexp is differentiable (jax.nn stops its gradient); dropout, the
  logit soft-cap, ALiBi and a value head dim other than the query's, which
  jax.nn does not have.
  """
  call = validate(query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                  query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths,
                  local_window_size=local_window_size, implementation=implementation,
                  return_residual=return_residual, mask_alignment=mask_alignment,
                  precision=precision, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                  broadcast_dropout=broadcast_dropout, logits_soft_cap=logits_soft_cap,
                  query_segment_ids=query_segment_ids,
                  key_value_segment_ids=key_value_segment_ids, alibi_slopes=alibi_slopes)
  if call.is_empty:
    out = jnp.zeros(_output_shape(call), call.q.dtype)
    lse = jnp.full(call.q.shape[:-1], -jnp.inf, call.q.dtype)
  else:
    out, lse = _flash(call.q, call.k, call.v, call.optional_operands(), call.config)
    lse = lse.astype(call.q.dtype)
  return (out, lse) if return_residual else out


def _output_shape(call) -> tuple[int, ...]:
  """The output's shape: the query's, with the value's head dim."""
  return call.q.shape[:-1] + call.v.shape[-1:]


# ---------------------------------------------------------------- autodiff

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
  """Which optional gradients the backward computes (those of the operands being
  differentiated): a static leaf of the residuals."""
  dbias: bool
  dslopes: bool
  dscale: bool


def _with_placeholders(optional, dtype):
  """The optional operands (contract.OPTIONAL_INPUTS order) with zero-size placeholders for the
  absent ones."""
  return tuple(absent(slot, dtype) if x is None else x for x, slot in zip(optional, OPTIONAL_INPUTS))


def _bind_forward(q, k, v, optional, config):
  return primitives.forward_p.bind(q, k, v, *_with_placeholders(optional, q.dtype), config=config)


def _natural(lse2):
  """The kernels' lse (base 2, hi and lo on the last axis: cuda/params.h says why) as the
  natural log callers get: hi ln 2 (lo is below hi's rounding). Only the returned value
  converts; the backward gets the kernels' own pair."""
  return lse2[..., 0] * np.float32(np.log(2.0))


# The differentiable ones among the optional operands.
_BIAS, _SLOPES, _SCALE = (OPTIONAL_INPUTS.index(slot) for slot in ("bias", "alibi_slopes", "scale"))


# `optional`: the OPTIONAL_INPUTS (bias, mask, lengths, dropout seed, segment ids, ALiBi slopes,
# scale), None where absent. The bias, the slopes and the scale among them are differentiable;
# the others get no cotangent (None).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, optional, config):
  out, lse2 = _bind_forward(q, k, v, optional, config)
  return out, _natural(lse2)


def _flash_fwd(q, k, v, optional, config):
  values = [x.value for x in (q, k, v)]
  optional_values = tuple(x.value if x is not None else None for x in optional)
  out32, lse2 = _forward_f32(values, optional_values, config)
  return ((out32.astype(values[0].dtype), _natural(lse2)),
          ((*values, optional_values), out32, lse2, _wanted(optional)))


def _forward_f32(qkv, optional, config: KernelConfig):
  """The forward under differentiation: the output stays float32 as the backward's residual (see
  delta in _flash_bwd)."""
  return _bind_forward(*qkv, optional, config.replace(flags=config.flags | Flag.OUTPUT_F32))


def _wanted(optional) -> _Wanted:
  """Which optional gradients to compute: only those of operands being differentiated
  (custom_vjp's `perturbed`; `optional` holds its CustomVJPPrimal wrappers), so that a call that
  does not differentiate the slopes never asks the kernels for their gradient."""
  bias, slopes, scale = optional[_BIAS], optional[_SLOPES], optional[_SCALE]
  return _Wanted(dbias=bias is not None and bias.perturbed,
                 dslopes=slopes is not None and slopes.perturbed,
                 dscale=scale is not None and scale.perturbed)


def _flash_bwd(config, residuals, cotangents):
  (q, k, v, optional), out32, lse2, wanted = residuals
  bias, slopes = optional[_BIAS], optional[_SLOPES]
  d_out, d_lse = cotangents
  if isinstance(d_out, SymbolicZero):
    d_out = jnp.zeros(out32.shape, q.dtype)
  delta = _delta(d_out, out32, config)
  if not isinstance(d_lse, SymbolicZero):
    delta = delta - d_lse.astype(jnp.float32)
  grad_layouts = _gradient_layouts(config)
  flags = config.flags
  # A bias constant along the keys shifts each row's logits by a constant, which the softmax
  # ignores: its gradient is the lse's cotangent on rows that see a key, in closed form. The
  # kernel's sum of dS over the keys would carry Δ's rounding instead of 0 (Δ comes from O, whose
  # P·V product rounds P to the input dtype), several times jax.nn's error for such a bias.
  closed_form_dbias = wanted.dbias and (bias.ndim == 0 or bias.shape[-1] == 1)
  if wanted.dbias and not closed_form_dbias:
    grad_layouts["dbias"] = config.layout("bias")
    flags |= Flag.HAS_DBIAS
  mean_key = None
  if wanted.dslopes:
    # Per key row of each query head: delta's instance axes, a row per key (cuda/params.h).
    grad_layouts["dalibi"] = with_rows(grad_layouts["delta"], config.seq_dims[1])
    grad_layouts["dalibi_centre"] = grad_layouts["delta"]
    flags |= Flag.HAS_DALIBI
    mean_key, sees_key = _mean_keys(q, k, optional, config)
  bwd_config = config.with_layouts(grad_layouts).replace(flags=flags)
  centre = None
  if wanted.dscale:
    bwd_config = _wanting_dscale(bwd_config)
    centre = _dscale_centre(q, k, optional, config)
  dq, dk, dv, dbias, dalibi, dscale = primitives.backward_p.bind(
      q, k, v, *_with_placeholders(optional, q.dtype), lse2, delta, d_out.astype(q.dtype),
      absent("dscale_centre", jnp.float32) if centre is None else centre,
      absent("dalibi_centre", jnp.float32) if mean_key is None else mean_key,
      config=bwd_config)
  if closed_form_dbias:
    dbias = _row_shift_gradient(d_lse, lse2[..., 0], bias)
  d_optional = [None] * len(optional)
  if wanted.dbias:
    d_optional[_BIAS] = dbias
  if wanted.dslopes:
    differentiated_lse = not isinstance(d_lse, SymbolicZero)
    centre = _alibi_centres(mean_key, sees_key, optional, config) if differentiated_lse else None
    d_optional[_SLOPES] = _slopes_gradient(dalibi, bwd_config.layout("dalibi"), slopes, centre,
                                           d_lse)
  if config.has(Flag.SCALE_OPERAND):
    dq = _query_gradient(q, dq, optional[_SCALE])
  if wanted.dscale:
    d_optional[_SCALE] = _scale_gradient(dscale, optional[_SCALE], centre, d_lse)
  return dq, dk, dv, tuple(d_optional)


def _slopes_gradient(dalibi, layout: Layout, slopes, centre=None, d_lse=None):
  """The ALiBi slopes' gradient from the kernel's per-key-row shares (dalibi, laid out as delta
  with a row per key: (B, S, N) / (S, N) / (S,)), -Σ dS·(|d| - C) with C the rows' centres
  (_mean_keys): summed over the rows, less Σ_t C_t·d_lse_t where the lse is differentiated (`centre`,
  _alibi_centres: what the centre took out of rows whose dS sums to the lse's cotangent d_lse, the
  natural lse's: dlse/dlogit = P), then summed over the batch where the slopes are shared by it
  ((N,) slopes of 4-D inputs). Under vmap this rule runs batched: each mapped item's slopes get
  their own sum."""
  g = jnp.sum(dalibi, axis=role_axis(layout, ROW))
  if centre is not None:
    # The centre and d_lse are laid out as delta, which has dalibi's axes (rows of queries).
    g = g - jnp.sum(centre * d_lse.astype(jnp.float32), axis=role_axis(layout, ROW))
  g = jnp.sum(g, axis=tuple(range(g.ndim - slopes.ndim)))
  return g.reshape(slopes.shape).astype(slopes.dtype)


def _query_gradient(q, d_scaled_q, scale):
  """dq from the backward's dq with Flag.SCALE_OPERAND, the float32 gradient g of the scaled
  query scale·q (the logits are (scale·q)·kᵀ): scale·g, rounded once to q's dtype."""
  return (d_scaled_q * scale[0]).astype(q.dtype)


def _wanting_dscale(config: KernelConfig) -> KernelConfig:
  """The backward's config that also asks for dscale (Flag.HAS_DSCALE), laid out as dk without
  its features (the kernels sum it over the axes dk sums over), and takes the rows' centres
  (dscale_centre, _dscale_centre) laid out as delta."""
  return config.with_layouts({"dscale": drop_col(config.layout("dk")),
                              "dscale_centre": config.layout("delta")}).replace(
      flags=config.flags | Flag.HAS_DSCALE)


def _centre_config(config: KernelConfig, v_layout: Layout | None = None) -> KernelConfig:
  """The forward config of attention(q, k, v=k) with `config`'s logits (bias, masks, lengths,
  window, segment ids, ALiBi, the scale), without dropout and with o in float32: its output row
  i is Σⱼ Pᵢⱼ kⱼ, P the softmax that the backward recomputes (before dropout). `v_layout`: v's
  own layout where v is not k (with k's head dim: _mean_keys' key positions)."""
  T, S, H, _ = config.seq_dims
  layouts = {slot: layout for slot, layout in config.layouts if slot != "seed"}
  layouts.update(v=layouts["k"] if v_layout is None else v_layout, o=with_cols(layouts["o"], H))
  return config.replace(layouts=tuple(sorted(layouts.items())), seq_dims=(T, S, H, H),
                        flags=(config.flags | Flag.OUTPUT_F32) & ~Flag.DROPOUT,
                        keep_threshold=0, keep_scale=1.0)


def _centre_rows(q, out32, scale, config: KernelConfig):
  """The rows' centres from out = attention(q, k, v=k) (float32): Eᵢ = qᵢ·outᵢ, q unscaled (the
  q·kᵀ that dscale's sum multiplies), and under a soft-cap f(Eᵢ) (_dscale_centre)."""
  e = jnp.sum(q.astype(jnp.float32) * out32, axis=-1)
  if not config.softcap:
    return e
  return e * _cap_slope(scale[0] * e / np.float32(config.softcap))


def _cap_slope(y):
  """d tanh(y) / dy = 1 − tanh²(y), as (1 + t)(1 − t) (the kernels' and jax's form)."""
  t = jnp.tanh(y)
  return (1.0 + t) * (1.0 - t)


def _dscale_centre(q, k, optional, config: KernelConfig):
  """The rows' centres of a traced scale's gradient (float32, laid out as delta): the kernels sum
  Σ dS∘(∂logit/∂scale − Cᵢ), dS of the logits and ∂logit/∂scale = q·kᵀ (times the soft-cap's slope
  1 − tanh²(scale·q·k/cap)). In exact arithmetic each row of dS sums to the lse's cotangent, which
  _scale_gradient adds back, so any C gives the same gradient; but Δ comes from the forward's O,
  whose P·V product rounds P to the input dtype, and the residue δᵢ that leaves in each row of the
  kernels' dS is multiplied by the row's P-mean of ∂logit/∂scale minus Cᵢ (docs/DESIGN.md, A
  traced scale). So C is that mean: without a soft-cap Eᵢ = Σⱼ Pᵢⱼ (qᵢ·kⱼ) = qᵢ·attention(q, k,
  v=k)ᵢ, one more forward call (P before dropout, the P that δ multiplies), only for calls that
  differentiate a traced scale. With a soft-cap the mean of slope·q·k is no forward's output, and
  Eᵢ itself would be a poor centre where the cap bites (P weights the largest q·k, whose slope is
  smallest); C = f(Eᵢ), f(x) = x·(1 − tanh²(scale·x/cap)), the mean moved inside the slope, is
  closer to it for loose and tight caps alike (measured in float64 with δ from P rounded to
  bf16, RMS over draws: 1.6–820× below the error of C = 0 and 1.2–41× below that of C = E, in
  every setting tried; docs/DESIGN.md)."""
  optional = tuple(None if slot == "seed" else x for x, slot in zip(optional, OPTIONAL_INPUTS))
  out32, _lse2 = _bind_forward(q, k, k, optional, _centre_config(config))
  return _centre_rows(q, out32, optional[_SCALE], config)


def _mean_keys(q, k, optional, config: KernelConfig):
  """The rows' P-mean key positions E_t[s] (the backward's dalibi_centre operand) and whether each
  row sees a key (1 or 0), float32, laid out as delta. The kernels sum dS·(|d| - C_t) per key row,
  d = s - t - offset the distance to the diagonal and C_t = |E_t[s] - t - offset| (they know t and
  offset), and _slopes_gradient adds Σ_t C_t·dlse_t back (_alibi_centres), so any E gives the same
  gradient in exact arithmetic. But the forward's P·V rounds P to the input dtype (CUDA), so each
  row of the kernels' dS sums to a residue δ_t besides dlse_t, which the uncentred sum multiplies by
  the row's P-mean distance E_t|d|: as large as T for the rows of T > S past the keys (top-left),
  where it came to 3-35x the tests' accuracy bar in a float64 emulation of the CUDA kernels
  (docs/DESIGN.md, Autodiff). C_t equals E_t|d| wherever the row's visible keys lie on one side of
  the diagonal (causal masking, rows past the keys), and is close where ALiBi concentrates P near
  it. E_t[s] = attention(q, k, v = key positions)_t: one more forward call with the call's logits
  (bias, masks, lengths, window, segment ids, ALiBi, soft-cap, scale), no dropout (the P that δ
  multiplies is the undropped one) and the float32 output, made only when the slopes are
  differentiated. The positions go in as an (S, H) operand shared by every instance (stride 0),
  scaled by a power of two into float16's range. Rows that see no key get E = 0 (their dS is 0)."""
  T, S, H, _ = config.seq_dims
  shift = max(0, (S - 1).bit_length() - 15)  # positions * 2**-shift < 2**15: float16 holds them
  positions = jnp.arange(S, dtype=jnp.float32) * np.float32(2.0 ** -shift)
  v = jnp.broadcast_to(positions[:, None], (S, H)).astype(q.dtype)
  optional = tuple(None if slot == "seed" else x for x, slot in zip(optional, OPTIONAL_INPUTS))
  # v: an (S, H) array shared by every instance (no instance axes: stride 0).
  out32, lse2 = _bind_forward(q, k, v, optional, _centre_config(config, ((ROW, S), (COL, H))))
  # Every feature holds the same mean. Reductions over the features rather than out32[..., 0],
  # whose batching rule moves a vmapped axis to the front (a transpose in the compiled program);
  # lse2's pair is (-inf, 0) on the rows that see no key.
  mean_key = jnp.max(out32, axis=-1) * np.float32(2.0 ** shift)
  return mean_key, (jnp.min(lse2, axis=-1) > -jnp.inf).astype(jnp.float32)


def _alibi_centres(mean_key, sees_key, optional, config: KernelConfig):
  """The kernels' centres C_t = |E_t[s] - (t + offset)| (float32, laid out as delta, computed as
  the kernels compute them: t + offset an exact integer below 2**24), 0 on the rows that see no key
  (whose dS sums to 0, not to dlse). Needed only where the lse is differentiated."""
  rows = drop_col(config.layout("o"))  # delta's layout
  return jnp.abs(mean_key - _diagonal_keys(config, optional, rows)) * sees_key


def _diagonal_keys(config: KernelConfig, optional, rows: Layout):
  """Float32, broadcastable to arrays laid out as `rows` (delta's): t + offset for each query row
  t, the key on its diagonal (cuda/params.h, instance_bounds): offset = config.diagonal, plus
  kv_len - q_len with Flag.BOTTOM_RIGHT, the lengths clamped to [0, T] and [0, S] as the kernels
  clamp them."""
  T, S = config.seq_dims[:2]
  shape = [1] * len(rows)
  shape[role_axis(rows, ROW)] = T
  t = jnp.reshape(jnp.arange(T, dtype=jnp.float32), shape) + np.float32(config.diagonal)
  if not config.has(Flag.BOTTOM_RIGHT):
    return t
  lengths = dict(zip(OPTIONAL_INPUTS, optional))

  def length(slot, full):
    x = lengths[slot]
    if x is None:
      return np.float32(full)
    return _by_instance(jnp.clip(x, 0, full).astype(jnp.float32), config.layout(slot), rows)

  return t + (length("kv_lens", S) - length("q_lens", T))


def _by_instance(x, layout: Layout, rows: Layout):
  """An operand with instance axes only (a sequence length, laid out as `layout`) reshaped to
  broadcast against arrays laid out as `rows`: each of its axes of size > 1 goes where `rows`
  has that axis (the same instance axes), in the same order."""
  shape = [1] * len(rows)
  for role, size in layout:
    if size != 1:
      shape[next(i for i, (r, _) in enumerate(rows) if r == role)] = size
  return jnp.reshape(x, shape)


def _scale_gradient(dscale_parts, scale, centre=None, d_lse=None):
  """A traced scale's gradient from the backward's dscale, partial sums of Σ dS∘(∂logit/∂scale − C)
  in float32 (cuda/params.h), C the rows' `centre` (_dscale_centre): their sum over the axes the
  scale is shared along, every axis of this call's dscale, the scale being one scalar per call,
  plus Σᵢ Cᵢ·d_lseᵢ, what the centre took out of rows whose dS sums to the lse's cotangent
  (d_lse, the natural lse's: dlse/dlogit = P). Under vmap this rule runs batched, so the
  sum stays per mapped item and each item's scale gets its own gradient (the kernels read each
  item's scale from the operand's stride along the mapped axis). Nothing divides by the scale, so
  scale = 0 has its gradient too. Inside shard_map, a scale replicated over mesh axes that the
  keys vary over (one learned temperature, sharded activations) gets the sum of every device's
  part."""
  dscale = jnp.sum(dscale_parts)
  if centre is not None and d_lse is not None and not isinstance(d_lse, SymbolicZero):
    dscale = dscale + jnp.sum(centre * d_lse.astype(jnp.float32))
  dscale = jnp.reshape(dscale, (1,))
  summed_axes = tuple(sorted(ring_lib.varying_axes(dscale) - ring_lib.varying_axes(scale)))
  return jax.lax.psum(dscale, summed_axes) if summed_axes else dscale


def _gradient_layouts(config: KernelConfig) -> dict[str, Layout]:
  """The backward's d_o, delta, dq, dk and dv: laid out as o, o's rows, q, k and v."""
  return {"d_o": config.layout("o"), "delta": drop_col(config.layout("o")), "dq": config.layout("q"),
          "dk": config.layout("k"), "dv": config.layout("v")}


def _delta(d_out, out32, config: KernelConfig):
  """Δ = rowsum(dO ∘ O) before the lse's cotangent, from the float32 output: from the output
  rounded to 16 bits, the gradients of sharply peaked attention come out several times worse
  than jax.nn's.

  With tf32 products (float32 on CUDA, default precision), dO is rounded to tf32 first, as the
  kernel's dP = dO·Vᵀ rounds it: Δ must equal Σ P∘dP of the kernel's own dP, or dS = P∘(dP - Δ)
  keeps a rounding residue where it cancels to 0 exactly (one visible key: dk and dbias are 0).
  The CPU kernels are float32-exact, so only the CUDA lowering rounds. (d_out, the output's
  cotangent, has the query's dtype.)"""
  exact = lambda d_out, out32: jnp.sum(d_out.astype(jnp.float32) * out32, axis=-1)
  if d_out.dtype != jnp.float32 or config.has(Flag.EXACT_F32):
    return exact(d_out, out32)
  rounded = lambda d_out, out32: exact(_round_to_tf32(d_out.astype(jnp.float32)), out32)
  return jax.lax.platform_dependent(d_out, out32, cuda=rounded, default=exact)


def _round_to_tf32(x):
  """float32 to the nearest tf32 value (10 mantissa bits, ties away from zero: cvt.rna)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
  return jax.lax.bitcast_convert_type(rounded, jnp.float32)


def _row_shift_gradient(d_lse, lse, bias):
  """The gradient of a bias that is constant along the keys: d_lse on rows that see a key
  (finite lse), 0 elsewhere, summed over the bias's broadcast axes. lse is (B, T, N) / (T, N) /
  (T,); the bias is broadcastable to (B, N, T, 1) / (N, T, 1) / (T, 1)."""
  if isinstance(d_lse, SymbolicZero):
    return jnp.zeros(bias.shape, bias.dtype)
  g = jnp.where(jnp.isfinite(lse), d_lse.astype(jnp.float32), 0.0)
  if g.ndim >= 2:  # (..., T, N) -> (..., N, T), the logits' order
    g = jnp.swapaxes(g, -1, -2)
  g = g[..., None]
  lead = g.ndim - bias.ndim
  g = jnp.sum(g, axis=tuple(range(lead)))
  g = jnp.sum(g, axis=tuple(i for i, n in enumerate(bias.shape) if n == 1 and g.shape[i] != 1),
              keepdims=True)
  return g.astype(bias.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------- one call of several

def attention_switch(index, query, key, value, bias=None, *, candidates, **arguments):
  """``attention(query, key, value, bias, **arguments, **candidates[index])`` for a traced
  ``index`` (clamped as lax.switch clamps it): one call picked on the device among candidates
  that differ only in how the logits are masked (each candidate a dict of ``mask``,
  ``is_causal``, ``query_seq_lengths`` / ``key_value_seq_lengths``, ``query_segment_ids`` /
  ``key_value_segment_ids``), as one differentiable unit. Internal: jaxflash.flax_attention's
  entry, whose candidates are the kernel calls a mask shared by the heads can run as.

  Not a lax.switch over attention() calls: under differentiation JAX's partial evaluation of a
  conditional makes the union of its branches' residuals (merged by type, zero-filled where a
  branch has none) outputs of the conditional, and an attention() call's residuals include its
  inputs, so the conditional would write copies of q, k and v, the dense candidate's T×S mask
  and the ids besides the float32 output (and a nested switch all of it again). Here the switch
  is inside one custom_vjp (_flash_switch): its forward is a switch over the candidates' forward
  kernels alone, each giving the same (out32, lse2); its residuals are one set (q, k, v, the
  candidates' operands, the index, out32, lse2); its backward a switch over the candidates'
  _flash_bwd, each with its own config and operands rebuilt from that set. Results are bit for
  bit the picked attention() call's, forward and gradients.

  Every candidate is validated at trace time (attention()'s checks and errors); one runs (under
  vmap of a batched index the switches become selects and all run). Multi-device calls are split
  where each kernel primitive lowers (partitioning.py: per-device shards, or ring attention for
  sequence-sharded operands), so each branch runs as its attention() call would. attention()'s
  one path that is not _flash, a zero-size call (no kernel: zeros), keeps the switch over
  attention() calls."""
  unknown = {name for candidate in candidates for name in candidate} - _MASKING_ARGUMENTS
  if unknown:
    raise ValueError(f"attention_switch: candidates may set {sorted(_MASKING_ARGUMENTS)} only, "
                     f"got {sorted(unknown)}")
  calls = [validate(query, key, value, bias=bias, **arguments, **candidate)
           for candidate in candidates]
  if calls[0].is_empty:  # the candidates share every shape
    return jax.lax.switch(index, [functools.partial(attention, query, key, value, bias,
                                                    **arguments, **candidate)
                                  for candidate in candidates])
  operands, branches = _shared_operands(calls, candidates)
  call = calls[0]
  out, _lse = _flash_switch(jnp.asarray(index, jnp.int32), call.q, call.k, call.v, operands,
                            branches)
  return out


# What attention_switch's candidates may set.
_MASKING_ARGUMENTS = frozenset({"mask", "is_causal", "query_seq_lengths", "key_value_seq_lengths",
                                "query_segment_ids", "key_value_segment_ids"})
# The attention() argument each optional operand (contract.OPTIONAL_INPUTS) comes from.
_ARGUMENT_OF_SLOT = {"bias": "bias", "mask": "mask", "q_lens": "query_seq_lengths",
                     "kv_lens": "key_value_seq_lengths", "seed": "dropout_rng",
                     "q_segment_ids": "query_segment_ids",
                     "kv_segment_ids": "key_value_segment_ids", "alibi_slopes": "alibi_slopes",
                     "scale": "scale"}


@dataclasses.dataclass(frozen=True)
class _Branch:
  """One candidate of _flash_switch: its config and, per optional operand slot
  (contract.OPTIONAL_INPUTS order), the index of its operand among the shared ones (None:
  absent)."""
  config: KernelConfig
  slots: tuple[int | None, ...]

  def optional(self, operands):
    return tuple(None if i is None else operands[i] for i in self.slots)


def _shared_operands(calls, candidates):
  """The validated candidates' optional operands as one tuple, each once, and each candidate's
  _Branch. An operand of an argument that the candidates share (the bias, the dropout seed, the
  ALiBi slopes, a traced scale, the caller's segment ids) is the first candidate's: each
  validate() derives the same values anew (a cast, the seed words). One of a candidate's own
  argument is one operand per argument object and slot (the two padding candidates' lengths
  are one pair)."""
  operands, index, branches = [], {}, []
  for call, candidate in zip(calls, candidates):
    slots = []
    for slot, x in zip(OPTIONAL_INPUTS, call.optional_operands()):
      if x is None:
        slots.append(None)
        continue
      argument = _ARGUMENT_OF_SLOT[slot]
      source = (slot, id(candidate[argument]) if argument in candidate else None)
      if source not in index:
        index[source] = len(operands)
        operands.append(x)
      slots.append(index[source])
    branches.append(_Branch(call.config, tuple(slots)))
  return tuple(operands), tuple(branches)


# `operands`: every candidate's optional operands, each once; `branches`: per candidate, its
# config and which operands fill its optional slots (_Branch). Differentiable: q, k, v and the
# floating operands (bias, ALiBi slopes, scale), which every candidate shares.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_switch(index, q, k, v, operands, branches):
  forwards = [functools.partial(_bind_forward, q, k, v, branch.optional(operands), branch.config)
              for branch in branches]
  out, lse2 = jax.lax.switch(index, forwards)
  return out, _natural(lse2)


def _flash_switch_fwd(index, q, k, v, operands, branches):
  values = tuple(x.value for x in (q, k, v))
  operand_values = tuple(x.value for x in operands)
  # The one conditional of the forward, whose outputs are (out32, lse2) whichever runs.
  forwards = [functools.partial(_forward_f32, values, branch.optional(operand_values),
                                branch.config) for branch in branches]
  out32, lse2 = jax.lax.switch(index.value, forwards)
  wanted = tuple(_wanted(branch.optional(operands)) for branch in branches)
  return ((out32.astype(values[0].dtype), _natural(lse2)),
          (index.value, values, operand_values, out32, lse2, wanted))


def _flash_switch_bwd(branches, residuals, cotangents):
  index, (q, k, v), operands, out32, lse2, wanted = residuals
  # The operands that some candidate differentiates; every branch returns a cotangent for each
  # (zeros where it has none, which cannot happen while they are shared), so that the switch's
  # branches agree.
  differentiated = sorted({branch.slots[slot] for branch, w in zip(branches, wanted)
                           for slot, on in ((_BIAS, w.dbias), (_SLOPES, w.dslopes),
                                            (_SCALE, w.dscale)) if on})

  def backward(branch, wanted):
    residuals = ((q, k, v, branch.optional(operands)), out32, lse2, wanted)
    dq, dk, dv, d_optional = _flash_bwd(branch.config, residuals, cotangents)
    given = {i: d for i, d in zip(branch.slots, d_optional) if d is not None}
    return dq, dk, dv, [given[i] if i in given else jnp.zeros_like(operands[i])
                        for i in differentiated]

  dq, dk, dv, d_differentiated = jax.lax.switch(
      index, [functools.partial(backward, b, w) for b, w in zip(branches, wanted)])
  d_operands = dict(zip(differentiated, d_differentiated))
  return None, dq, dk, dv, tuple(d_operands.get(i) for i in range(len(operands)))


_flash_switch.defvjp(_flash_switch_fwd, _flash_switch_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------- ring attention

def ring_attention(query, key, value, *, axis_name: str | tuple[str, ...],
                   scale: float | jax.Array | None = None,
                   is_causal: bool = False, local_window_size: int | tuple[int, int] | None = None,
                   order: Literal["contiguous", "zigzag"] = "contiguous",
                   precision: str | jax.lax.Precision | None = None, return_residual: bool = False,
                   logits_soft_cap: float | None = None, query_seq_lengths=None,
                   key_value_seq_lengths=None, query_segment_ids=None,
                   key_value_segment_ids=None, dropout_rate: float = 0.0,
                   dropout_rng: jax.Array | None = None, broadcast_dropout: bool = False):
  """Attention over a sequence sharded along the mesh axis ``axis_name``, for use inside
  :func:`jax.shard_map`: ring attention (K/V blocks travel round the devices of the axis by
  collective permutes; each device merges its queries' partial results by their logsumexp).

  ``query``, ``key`` and ``value`` are this device's blocks, ``(B, T/n, N, H)`` etc. as for
  :func:`attention`, of a sequence split over the ``n`` devices of ``axis_name`` (a name or a
  tuple of names) in ``order``:

  * ``"contiguous"``: device ``i`` holds positions ``[i T/n, (i+1) T/n)``, what
    ``PartitionSpec(None, axis_name)`` gives;
  * ``"zigzag"``: the sequence cut into ``2n`` chunks, device ``i`` holds chunks ``i`` and
    ``2n - 1 - i`` (lay a global array out so with ``x[:, jaxflash.zigzag_order(T, n)]``). Causal
    attention then costs every device the same; in the contiguous order the last device does
    ``n`` blocks of work and the first one.

  ``local_window_size`` is :func:`attention`'s, in positions of the whole sequence (query and
  key blocks of equal length, the contiguous order); the ring then runs only as far as the
  window reaches. ``scale``, ``precision`` and ``logits_soft_cap`` are :func:`attention`'s.

  ``query_segment_ids`` and ``key_value_segment_ids`` are this device's blocks ``(B, T/n)`` and
  ``(B, S/n)`` of :func:`attention`'s, in the same order as the sequence; the key ids travel
  round the ring with their K/V block. ``query_seq_lengths`` and ``key_value_seq_lengths`` are
  :func:`attention`'s ``(B,)``, the same on every device: lengths of the whole sequence, in
  its positions (top-left aligned), whatever the order.

  ``dropout_rate``, ``dropout_rng`` and ``broadcast_dropout`` are :func:`attention`'s. With the
  same key on every device (replicated into the shard_map), the ring drops exactly the entries
  that :func:`attention` drops on the whole sequence for that key (:func:`jaxflash.dropout_mask`):
  each kernel call hashes the positions of its rows and keys in the whole sequence. The hash
  pairs keys from multiples of 16, so key blocks (``"zigzag"``: chunks, ``S/(2n)``) must be a
  multiple of 16 long; in the zig-zag order each step runs as two kernel calls of a chunk each.

  Returns this device's block of the output (and, with ``return_residual``, of the logsumexp).
  Differentiable (the backward is a ring too). Bias, mask and ALiBi are not supported
  yet; with ``jax.jit`` on sequence-sharded operands,
  :func:`attention` runs this ring itself (``docs/DESIGN.md``, Multi-device).
  """
  call = validate_ring(query, key, value, axis_name=axis_name, scale=scale, is_causal=is_causal,
                       local_window_size=local_window_size, order=order, precision=precision,
                       return_residual=return_residual, logits_soft_cap=logits_soft_cap,
                       query_seq_lengths=query_seq_lengths,
                       key_value_seq_lengths=key_value_seq_lengths,
                       query_segment_ids=query_segment_ids,
                       key_value_segment_ids=key_value_segment_ids, dropout_rate=dropout_rate,
                       dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout)
  ring = ring_lib.Ring(call.config, axis_name, order)
  if call.is_empty:
    out = jnp.zeros(_output_shape(call), call.q.dtype)
    lse = jnp.full(call.q.shape[:-1], -jnp.inf, call.q.dtype)
  else:
    given = dict(zip(OPTIONAL_INPUTS, call.optional_operands()))
    operands = {slot: given[slot] for slot in ring_lib.RING_OPERANDS if given[slot] is not None}
    out, lse = _ring(call.q, call.k, call.v, call.scale, operands, ring)
    lse = lse.astype(call.q.dtype)
  return (out, lse) if return_residual else out


# `scale`: the scale operand (validation.Call), None for a static scale; `operands`: the
# present ones of ring_lib.RING_OPERANDS by slot (integers and seed words: no cotangent).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, scale, operands, ring: ring_lib.Ring):
  out32, lse2 = ring_lib.forward(q, k, v, ring, scale, operands)
  return out32.astype(q.dtype), _natural(lse2)


def _ring_fwd(q, k, v, scale, operands, ring):
  out32, lse2 = ring_lib.forward(q, k, v, ring, scale, operands)
  return (out32.astype(q.dtype), _natural(lse2)), (q, k, v, scale, operands, out32, lse2)


def _ring_bwd(ring, residuals, cotangents):
  q, k, v, scale, operands, out32, lse2 = residuals
  d_out, d_lse = cotangents
  config = ring.config
  delta = _delta(d_out, out32, config)
  delta = delta - d_lse.astype(jnp.float32)
  bwd_config = config.with_layouts(_gradient_layouts(config))
  centre = None
  if scale is not None:
    bwd_config = _wanting_dscale(bwd_config)
    centre = _ring_dscale_centre(q, k, scale, operands, ring)
  dq, dk, dv, dscale = ring_lib.backward(q, k, v, lse2, delta, d_out.astype(q.dtype),
                                         dataclasses.replace(ring, config=bwd_config), scale,
                                         centre, operands)
  if scale is not None:
    dq = _query_gradient(q, dq, scale)
    dscale = _scale_gradient(dscale, scale, centre, d_lse)
  return dq, dk, dv, dscale, {slot: None for slot in operands}


def _ring_dscale_centre(q, k, scale, operands, ring: ring_lib.Ring):
  """_dscale_centre's E for this device's query block: a ring forward of attention(q, k, v=k)
  over the whole sequence, with the call's ring operands (lengths, segment ids; no dropout)."""
  operands = {slot: x for slot, x in operands.items() if slot != "seed"}
  out32, _lse2 = ring_lib.forward(q, k, k, dataclasses.replace(ring, config=_centre_config(ring.config)),
                                  scale, operands)
  return _centre_rows(q, out32, scale, ring.config)


_ring.defvjp(_ring_fwd, _ring_bwd)
