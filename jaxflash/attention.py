"""jaxflash.attention: the public API.

A drop-in for :func:`jax.nn.dot_product_attention`. This file validates the
arguments (every error names the argument, what was given and what is
allowed), describes each operand's axes as a :mod:`jaxflash.layout`, and wires
the forward and backward primitives into a ``jax.custom_vjp``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxflash import dropout as dropout_lib
from jaxflash import kernels
from jaxflash import primitives
from jaxflash import ring as ring_lib
from jaxflash.layout import COL, ROW, Layout, drop_col
from jaxflash.kernels import KernelConfig

SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
MAX_HEAD_DIM = 256


def attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
              is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
              local_window_size: int | tuple[int, int] | None = None,
              implementation: None = None, return_residual: bool = False,
              mask_alignment: Literal["top_left", "bottom_right"] = "top_left",
              precision: str | jax.lax.Precision | None = None, dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None, broadcast_dropout: bool = False):
  r"""Scaled dot-product attention, computed by jaxflash's FlashAttention kernels.

  Same arguments, shapes and semantics as :func:`jax.nn.dot_product_attention`:
  ``softmax(scale * Q·Kᵀ + bias, masked) · V`` per head.

  Args:
    query: ``(B, T, N, H)``, ``(T, N, H)``, or a single head ``(T, H)``.
    key, value: ``(B, S, K, H)``, ``(S, K, H)`` or ``(S, H)``; ``N % K == 0``
      (grouped-query attention; ``K == 1`` is multi-query). float32, float16 or
      bfloat16, all three the same dtype; ``H <= 256``.
    bias: added to the logits; broadcastable to ``(B, N, T, S)`` (to ``(N, T, S)``
      for 3-D inputs, ``(T, S)`` for a single head), at most that rank; leading
      axes are added as in jax.nn. Differentiable.
    mask: boolean, True = attend; broadcastable like ``bias``.
    scale: logit scale, default ``1 / sqrt(H)``.
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

  Returns:
    The attention output, shaped like ``query``; with ``return_residual``, a
    tuple ``(output, logsumexp)``.

  Differences from jax.nn.dot_product_attention: a query row that sees no key
  outputs 0 and has logsumexp ``-inf`` (jax.nn averages V there); the returned
  logsumexp is differentiable (jax.nn stops its gradient); dropout, which
  jax.nn does not have.
  """
  call = _validate(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                   key_value_seq_lengths, local_window_size, implementation, return_residual,
                   mask_alignment, precision, dropout_rate, dropout_rng, broadcast_dropout)
  if call.is_empty:
    out = jnp.zeros(call.q.shape, call.q.dtype)
    lse = jnp.full(call.q.shape[:-1], -jnp.inf, call.q.dtype)
  else:
    out, lse = _flash(call.q, call.k, call.v, call.bias, call.mask, call.q_lens, call.kv_lens,
                      call.seed, call.config)
    lse = lse.astype(call.q.dtype)
  return (out, lse) if return_residual else out


# ---------------------------------------------------------------- validation

@dataclasses.dataclass
class _Call:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  q_lens: jax.Array | None
  kv_lens: jax.Array | None
  seed: jax.Array | None
  config: KernelConfig
  is_empty: bool


def _shape_str(x) -> str:
  return f"shape {tuple(x.shape)}"


def _as_array(x, name: str) -> jax.Array:
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise TypeError(f"jaxflash.attention: {name} must be an array, got {type(x).__name__}") from e


def _validate(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
              key_value_seq_lengths, local_window_size, implementation, return_residual,
              mask_alignment, precision, dropout_rate, dropout_rng, broadcast_dropout) -> _Call:
  if implementation is not None:
    raise ValueError(f"jaxflash.attention: implementation must be None (jaxflash always uses "
                     f"its own kernels), got {implementation!r}")
  if mask_alignment not in ("top_left", "bottom_right"):
    raise ValueError(f"jaxflash.attention: mask_alignment must be 'top_left' or 'bottom_right', "
                     f"got {mask_alignment!r}")
  exact_f32 = _exact_f32(precision)
  for name, flag in (("is_causal", is_causal), ("return_residual", return_residual),
                     ("broadcast_dropout", broadcast_dropout)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"jaxflash.attention: {name} must be a bool, got {flag!r}")

  q, k, v = (_as_array(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
  rank = q.ndim
  if rank not in (2, 3, 4):
    raise ValueError(f"jaxflash.attention: query must have rank 4 (B, T, N, H), 3 (T, N, H) or "
                     f"2 (T, H), got {_shape_str(q)}")
  for name, x in (("key", k), ("value", v)):
    if x.ndim != rank:
      raise ValueError(f"jaxflash.attention: {name} must have the rank of query ({rank}), "
                       f"got {_shape_str(x)}")
  if q.dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"jaxflash.attention: query dtype must be float32, float16 or bfloat16, "
                    f"got {q.dtype}")
  for name, x in (("key", k), ("value", v)):
    if x.dtype != q.dtype:
      raise TypeError(f"jaxflash.attention: {name} dtype must equal the query dtype ({q.dtype}), "
                      f"got {x.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"jaxflash.attention: value must have the shape of key {tuple(k.shape)}, "
                     f"got {_shape_str(v)}")

  # Name the axes (B, T, N, H); a 3-D call has B = 1, a single head also N = 1.
  def named_axes(shape):
    return tuple(shape) if rank == 4 else (1, *shape) if rank == 3 else (1, shape[0], 1, shape[1])
  B, T, N, H = named_axes(q.shape)
  Bk, S, K, Hk = named_axes(k.shape)
  if Bk != B:
    raise ValueError(f"jaxflash.attention: key batch size must equal the query's ({B}), got "
                     f"{_shape_str(k)}")
  if Hk != H:
    raise ValueError(f"jaxflash.attention: key head dim must equal the query's ({H}), got "
                     f"{_shape_str(k)}")
  if H > MAX_HEAD_DIM:
    raise ValueError(f"jaxflash.attention: head dim (query.shape[-1]) must be <= {MAX_HEAD_DIM}, "
                     f"got {H}")
  if K == 0 or N % K != 0:
    raise ValueError(f"jaxflash.attention: the number of query heads ({N}) must be a multiple of "
                     f"the number of key/value heads, got {K}")
  G = N // K

  # Instance axes: 0 = batch, 1 = kv head, 2 = query head within its group. The
  # logical BNTS axes of bias and mask map onto them; each array keeps its own rank.
  if rank == 4:
    instance_sizes = (B, K, G)
    batch_role, head_role, kv_head_role = (0,), (1, 2), (1,)
  elif rank == 3:
    instance_sizes = (K, G)
    batch_role, head_role, kv_head_role = (), (0, 1), (0,)
  else:
    instance_sizes = ()
    batch_role, head_role, kv_head_role = (), (), ()

  def seq_layout(x, heads) -> Layout:
    roles = ((batch_role, ROW, heads, COL) if rank == 4 else
             (ROW, heads, COL) if rank == 3 else (ROW, COL))
    return tuple(zip(roles, x.shape))

  logits_roles = (batch_role, head_role, ROW, COL)[4 - rank:]
  logits_shape = (B, N, T, S)[4 - rank:]
  logits_name = ("(B, N, T, S)", "(N, T, S)", "(T, S)")[4 - rank]

  def logits_operand(x, name: str):
    if x is None:
      return None, None
    x = _as_array(x, name)
    if x.ndim > len(logits_shape):
      raise ValueError(f"jaxflash.attention: {name} must have rank <= {len(logits_shape)} and be "
                       f"broadcastable to {logits_name} = {logits_shape}, got {_shape_str(x)}")
    trailing = logits_shape[len(logits_shape) - x.ndim:]
    if any(n not in (1, m) for n, m in zip(x.shape, trailing)):
      raise ValueError(f"jaxflash.attention: {name} must be broadcastable to {logits_name} = "
                       f"{logits_shape}, got {_shape_str(x)}")
    roles = logits_roles[len(logits_roles) - x.ndim:]
    return x, tuple(zip(roles, x.shape))

  bias, bias_layout = logits_operand(bias, "bias")
  if bias is not None:
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"jaxflash.attention: bias must be a floating-point array, got {bias.dtype}")
    if bias.dtype != q.dtype:
      # The kernels read the bias in the query dtype or in float32; float32
      # holds every other floating dtype's values exactly enough for logits.
      bias = bias.astype(jnp.float32)
  mask, mask_layout = logits_operand(mask, "mask")
  if mask is not None and mask.dtype != jnp.bool_:
    raise TypeError(f"jaxflash.attention: mask must be a boolean array (True = attend), got "
                    f"{mask.dtype}; pass an additive mask as bias")

  def lengths(x, name: str):
    if x is None:
      return None, None
    x = _as_array(x, name)
    allowed = ((B,),) if rank == 4 else ((), (1,))
    if x.shape not in allowed:
      want = f"shape ({B},)" if rank == 4 else "a scalar or shape (1,)"
      raise ValueError(f"jaxflash.attention: {name} must have {want}, got {_shape_str(x)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"jaxflash.attention: {name} must be an int32 array, got {x.dtype}")
    return x.astype(jnp.int32), tuple(zip((batch_role,) * x.ndim, x.shape))

  q_lens, q_lens_layout = lengths(query_seq_lengths, "query_seq_lengths")
  kv_lens, kv_lens_layout = lengths(key_value_seq_lengths, "key_value_seq_lengths")

  window = _window(local_window_size, is_causal)
  scale = _scale(scale, H)

  flags = kernels.BOTTOM_RIGHT if mask_alignment == "bottom_right" else 0
  if exact_f32 and q.dtype == jnp.float32:
    flags |= kernels.EXACT_F32
  layouts = {"q": seq_layout(q, head_role), "k": seq_layout(k, kv_head_role),
             "v": seq_layout(v, kv_head_role)}
  layouts["o"] = layouts["q"]
  layouts["lse"] = drop_col(layouts["q"])
  for name, layout, flag in (("bias", bias_layout, kernels.HAS_BIAS),
                             ("mask", mask_layout, kernels.HAS_MASK),
                             ("q_lens", q_lens_layout, kernels.HAS_Q_LENS),
                             ("kv_lens", kv_lens_layout, kernels.HAS_KV_LENS)):
    if layout is not None:
      layouts[name] = layout
      flags |= flag
  is_empty = 0 in (B, T, S, N, H)

  rate = _dropout_rate(dropout_rate)
  seed, keep_threshold, keep_scale = None, 0, 1.0
  if rate > 0.0:
    if dropout_rng is None:
      raise ValueError(f"jaxflash.attention: dropout_rate={rate} needs a dropout_rng (a "
                       f"jax.random.key), got None")
    keep_threshold, keep_scale = dropout_lib.keep_threshold_and_scale(rate)
    if not is_empty:
      seed = _dropout_seeds(dropout_rng, logits_shape, broadcast_dropout)
      seed_roles = (() if broadcast_dropout else logits_roles[:-2]) + (COL,)
      layouts["seed"] = tuple(zip(seed_roles, seed.shape))
      flags |= kernels.DROPOUT
  config = KernelConfig(instance_sizes=instance_sizes, layouts=tuple(sorted(layouts.items())),
                        seq_dims=(T, S, H), scale=scale, window=window, flags=flags,
                        keep_threshold=keep_threshold, keep_scale=keep_scale)
  return _Call(q, k, v, bias, mask, q_lens, kv_lens, seed, config, is_empty)


def _dropout_rate(dropout_rate) -> float:
  if isinstance(dropout_rate, bool):
    raise TypeError(f"jaxflash.attention: dropout_rate must be a Python float, got {dropout_rate!r}")
  try:
    rate = float(dropout_rate)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(f"jaxflash.attention: dropout_rate must be a Python float (a static value, "
                    f"not a traced array), got {dropout_rate!r}") from e
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"jaxflash.attention: dropout_rate must be in [0, 1), got {dropout_rate!r}")
  return rate


def _dropout_seeds(dropout_rng, logits_shape, broadcast_dropout: bool) -> jax.Array:
  """The seed words from the user's key, with an error that names dropout_rng for anything
  jax.random does not take as a key."""
  try:
    rng = jnp.asarray(dropout_rng)
  except (TypeError, ValueError) as e:
    raise TypeError(f"jaxflash.attention: dropout_rng must be a jax.random key, got "
                    f"{type(dropout_rng).__name__}") from e
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.ndim != 0:
      raise ValueError(f"jaxflash.attention: dropout_rng must be a single key (shape ()), got a "
                       f"key array of shape {tuple(rng.shape)}; split it outside or use jax.vmap")
  else:
    expected = jax.random.key_data(jax.random.key(0)).shape
    if rng.dtype != jnp.uint32 or rng.shape != expected:
      raise TypeError(f"jaxflash.attention: dropout_rng must be a jax.random.key or legacy "
                      f"uint32 key data of shape {expected}, got {rng.dtype} of "
                      f"{_shape_str(rng)}")
  return dropout_lib.seeds(rng, logits_shape, broadcast_dropout)


def _window(local_window_size, is_causal) -> tuple[int, int]:
  left = right = kernels.UNBOUNDED
  if local_window_size is not None:
    if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
      left = right = int(local_window_size)
    elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 and
          all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
              for w in local_window_size)):
      left, right = (int(w) for w in local_window_size)
    else:
      raise TypeError(f"jaxflash.attention: local_window_size must be an int or a (left, right) "
                      f"pair of ints, got {local_window_size!r}")
    if left < 0 or right < 0:
      raise ValueError(f"jaxflash.attention: local_window_size must be >= 0 on both sides, got "
                       f"{local_window_size!r}")
  if is_causal:
    right = 0
  return left, right


# jax.default_matmul_precision's names (and lax.Precision's string aliases). Of these,
# "highest"/"float32" ask for float32-accurate products; the others allow tf32 (or less).
_PRECISION_NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32",
                    "bfloat16_3x", "fastest")
_EXACT_PRECISION_NAMES = ("highest", "float32")
# lax.DotAlgorithmPreset names (also accepted by jax.default_matmul_precision) that are at
# least float32-accurate: what the kernels' 3xTF32 products give.
_EXACT_PRESETS = ("F32_F32_F32", "F64_F64_F64", "TF32_TF32_F32_X3", "BF16_BF16_F32_X6",
                  "BF16_BF16_F32_X9")


def _exact_f32(precision) -> bool:
  """Whether `precision` (None: jax_default_matmul_precision now) asks for float32-accurate
  products. Checked for every dtype, though only float32 inputs use it."""
  given = precision
  if precision is None:
    precision = jax.config.jax_default_matmul_precision  # the trace-time (context) value
    if precision is None:
      return False
  presets = [p.name for p in jax.lax.DotAlgorithmPreset]
  if isinstance(precision, jax.lax.Precision):
    return precision == jax.lax.Precision.HIGHEST
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return precision.name in _EXACT_PRESETS
  if isinstance(precision, str):
    if precision in _PRECISION_NAMES:
      return precision in _EXACT_PRECISION_NAMES
    if precision in presets:
      return precision in _EXACT_PRESETS
  what = "jax_default_matmul_precision" if given is None else "precision"
  raise ValueError(f"jaxflash.attention: {what} must be None, a jax.lax.Precision, a "
                   f"jax.lax.DotAlgorithmPreset or one of the names "
                   f"{', '.join(map(repr, _PRECISION_NAMES))} (or a preset's name), got "
                   f"{precision!r}")


def _scale(scale, head_dim: int) -> float:
  if scale is None:
    return float(1.0 / np.sqrt(head_dim))
  try:
    value = float(scale)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(f"jaxflash.attention: scale must be a Python float (a static value, not a "
                    f"traced array), got {scale!r}") from e
  if not np.isfinite(value):
    raise ValueError(f"jaxflash.attention: scale must be finite, got {scale!r}")
  return value


# ---------------------------------------------------------------- autodiff

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _WantDbias:
  """Whether the backward computes dbias: a static leaf of the residuals."""
  value: bool


def _optional_operands(bias, mask, q_lens, kv_lens, seed, dtype):
  """bias, mask, q_lens, kv_lens, seed with zero-size placeholders for the absent ones."""
  return tuple(kernels.absent(slot, dtype) if x is None else x
               for x, slot in ((bias, "bias"), (mask, "mask"), (q_lens, "q_lens"),
                               (kv_lens, "kv_lens"), (seed, "seed")))


def _bind_forward(q, k, v, bias, mask, q_lens, kv_lens, seed, config):
  return primitives.forward_p.bind(
      q, k, v, *_optional_operands(bias, mask, q_lens, kv_lens, seed, q.dtype), config=config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash(q, k, v, bias, mask, q_lens, kv_lens, seed, config):
  return tuple(_bind_forward(q, k, v, bias, mask, q_lens, kv_lens, seed, config))


def _flash_fwd(q, k, v, bias, mask, q_lens, kv_lens, seed, config):
  values = [x.value if x is not None else None
            for x in (q, k, v, bias, mask, q_lens, kv_lens, seed)]
  # The output stays float32 as the backward's residual (see delta in _flash_bwd).
  out32, lse = _bind_forward(*values, config.replace(flags=config.flags | kernels.OUTPUT_F32))
  want_dbias = bias is not None and bias.perturbed
  return (out32.astype(values[0].dtype), lse), (tuple(values), out32, lse, _WantDbias(want_dbias))


def _flash_bwd(config, residuals, cotangents):
  (q, k, v, bias, mask, q_lens, kv_lens, seed), out32, lse, want_dbias = residuals
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
  closed_form_dbias = want_dbias.value and (bias.ndim == 0 or bias.shape[-1] == 1)
  if want_dbias.value and not closed_form_dbias:
    grad_layouts["dbias"] = config.layout("bias")
    flags |= kernels.HAS_DBIAS
  bwd_config = config.with_layouts(grad_layouts).replace(flags=flags)
  dq, dk, dv, dbias = primitives.backward_p.bind(
      q, k, v, *_optional_operands(bias, mask, q_lens, kv_lens, seed, q.dtype), lse, delta,
      d_out.astype(q.dtype), config=bwd_config)
  if closed_form_dbias:
    dbias = _row_shift_gradient(d_lse, lse, bias)
  return dq, dk, dv, (dbias if want_dbias.value else None), None, None, None, None


def _gradient_layouts(config: KernelConfig) -> dict[str, Layout]:
  """The backward's d_o, delta, dq, dk and dv: laid out as o, lse, q, k and v."""
  return {"d_o": config.layout("o"), "delta": config.layout("lse"), "dq": config.layout("q"),
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
  if d_out.dtype != jnp.float32 or config.has(kernels.EXACT_F32):
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


# ---------------------------------------------------------------- ring attention

def ring_attention(query, key, value, *, axis_name: str | tuple[str, ...], scale: float | None = None,
                   is_causal: bool = False, local_window_size: int | tuple[int, int] | None = None,
                   order: Literal["contiguous", "zigzag"] = "contiguous",
                   precision: str | jax.lax.Precision | None = None, return_residual: bool = False):
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
  window reaches.

  Returns this device's block of the output (and, with ``return_residual``, of the logsumexp).
  Differentiable (the backward is a ring too). Bias, mask, sequence lengths and dropout are not
  supported yet; with ``jax.jit`` on sequence-sharded operands,
  :func:`attention` runs this ring itself (``docs/DESIGN.md``, Multi-device).
  """
  call = _validate(query, key, value, None, None, scale, is_causal, None, None, local_window_size,
                   None, return_residual, "top_left", precision, 0.0, None, False)
  if order not in ("contiguous", "zigzag"):
    raise ValueError(f"jaxflash.ring_attention: order must be 'contiguous' or 'zigzag', got "
                     f"{order!r}")
  if call.q.ndim != 4:
    raise ValueError(f"jaxflash.ring_attention: query must have rank 4 (B, T, N, H), got "
                     f"{_shape_str(call.q)}")
  try:
    jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(f"jaxflash.ring_attention: axis_name must name mesh axes of the enclosing "
                     f"shard_map, got {axis_name!r}") from e
  T, S, _ = call.config.seq_dims
  if order == "zigzag" and call.config.window not in (ring_lib.OPEN, ring_lib.CAUSAL):
    raise ValueError(f"jaxflash.ring_attention: order='zigzag' balances causal attention; with "
                     f"local_window_size={local_window_size!r} use order='contiguous' (a "
                     f"window gives every device about the same work there)")
  if order == "zigzag" and (T % 2 or S % 2):
    raise ValueError(f"jaxflash.ring_attention: order='zigzag' needs even block lengths (two "
                     f"chunks per device), got query block {T} and key block {S}")
  why = ring_lib.unsupported(call.config)
  if why is not None:
    raise ValueError(f"jaxflash.ring_attention: {why}")
  ring = ring_lib.Ring(call.config, axis_name, order)
  if call.is_empty:
    out = jnp.zeros(call.q.shape, call.q.dtype)
    lse = jnp.full(call.q.shape[:-1], -jnp.inf, call.q.dtype)
  else:
    out, lse = _ring(call.q, call.k, call.v, ring)
    lse = lse.astype(call.q.dtype)
  return (out, lse) if return_residual else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, ring: ring_lib.Ring):
  out32, lse = ring_lib.forward(q, k, v, ring)
  return out32.astype(q.dtype), lse


def _ring_fwd(q, k, v, ring):
  out32, lse = ring_lib.forward(q, k, v, ring)
  return (out32.astype(q.dtype), lse), (q, k, v, out32, lse)


def _ring_bwd(ring, residuals, cotangents):
  q, k, v, out32, lse = residuals
  d_out, d_lse = cotangents
  config = ring.config
  delta = _delta(d_out, out32, config)
  delta = delta - d_lse.astype(jnp.float32)
  backward = dataclasses.replace(ring, config=config.with_layouts(_gradient_layouts(config)))
  return ring_lib.backward(q, k, v, lse, delta, d_out.astype(q.dtype), backward)


_ring.defvjp(_ring_fwd, _ring_bwd)
