"""Reference attention, input generators and the comparison rule shared by the jaxflash tests.

Every numerical test compares three results computed from the SAME rounded inputs:

  ours      jaxflash.attention in the input dtype;
  reference jax.nn.dot_product_attention(implementation="xla") in float32 at "highest" matmul
            precision, i.e. the best answer we can compute;
  baseline  jax.nn.dot_product_attention's XLA path in the input dtype at default precision,
            i.e. what a user gets from jax.nn today (restated in this module, because jax.nn's
            half-precision gradients do not compile on CPU; see _xla_path_restated). For
            float32 on CUDA at default precision, where the kernels use tf32 tensor cores, it
            is that path with every matmul operand rounded to tf32 (see tf32_dot_general).

and accepts ours when its error is at most twice the baseline's error plus a small atol
(FlashAttention's rule): we must be no worse than the thing we replace, without guessing a
tolerance per dtype and shape.

Only ours runs on the backend under test: the reference and the baseline always run on the CPU
from the same rounded inputs (reference_and_baseline, on_cpu). That makes them independent of
the platform (and of XLA's GPU algebra) and saves the GPU compiles that used to dominate the
CUDA run.

jaxflash differs from jax.nn in two documented ways that the reference applies on top of
jax.nn (README.md, "Differences from jax.nn.dot_product_attention"):
  * a query row with no visible key outputs 0 and has lse = -inf (jax.nn averages V uniformly
    there and gives a large negative finite lse);
  * the returned lse is differentiable (jax.nn stop-gradients it), so the reference computes
    the lse itself.
It also supports mask_alignment="bottom_right", which jax.nn lacks, by building that mask
explicitly and passing it as `mask`, and attention dropout, which jax.nn lacks too: the restated
XLA path multiplies its probabilities by jaxflash.dropout_mask (the kernels' mask, restated in
jnp; test_dropout checks the two agree bit for bit) over 1 - rate. A value head dim other than
the query's, which jax.nn refuses ("value shape should be ..."), has the reference computed by
that restated path too (its einsums, in float32 at "highest" precision).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# atol = ATOL_FACTOR[dtype] * max(1, max|ref|). About a quarter of the dtype's epsilon for the
# half types (one rounding of the result to the dtype is unavoidable; the baseline term covers
# the rest); float32 gets 1e-5 because on CPU the baseline equals the reference up to summation
# order, so the baseline term is ~0 and atol alone has to absorb ours' accumulation order.
# "tensorfloat32" is float32 computed on tf32 tensor cores (compute_name): its baseline models
# the tf32 products, but where a gradient cancels to exactly 0 (one visible key) the baseline's
# autodiff cancels bit for bit while ours keeps float32 accumulation-order residue of dP
# (H products of |dO| |V|): measured up to 5e-5 on an H100, hence 1e-4, a tenth of tf32's
# epsilon (the half types get about a quarter of theirs).
ATOL_FACTOR = {"float32": 1e-5, "tensorfloat32": 1e-4, "float16": 1e-3, "bfloat16": 4e-3}

# Tolerance (rtol, atol) for "the same kernel run two ways" (vmap versus a loop, eager versus
# jit, flax adapters): identical up to summation order, i.e. one rounding in the dtype.
SAME_KERNEL_TOL = {"float32": (1e-5, 1e-6), "float16": (1e-3, 1e-3), "bfloat16": (8e-3, 8e-3),
                   # float32 on tf32 tensor cores (compute_name) when the two runs' shapes differ
                   # (a device's shard against the whole): the CUDA kernels pick their work split
                   # by shape, so sums add in another order, and a value one float32 rounding
                   # away (the forward's O, so delta, so dS) may round to the neighbouring tf32
                   # value before its product: one tf32 rounding (2^-11 relative) of that term.
                   # Seen on 2 H200s: one key row of a GQA dK off by 1.6e-3 relative, 1.7e-4
                   # absolute at |dK| <= 3.1 (2026-11-29).
                   "tensorfloat32": (1e-3, 1e-4)}

GRAD_NAMES = {"query": "dq", "key": "dk", "value": "dv", "bias": "dbias",
              "alibi_slopes": "dslopes", "scale": "dscale"}
# "scale" is differentiable when the inputs hold it (a traced scale: a scalar array), else it is
# a static keyword argument.
DIFFERENTIABLE = ("query", "key", "value", "bias", "alibi_slopes", "scale")
NON_DIFFERENTIABLE = ("mask", "query_seq_lengths", "key_value_seq_lengths", "dropout_rng",
                      "query_segment_ids", "key_value_segment_ids")
# Passed to the attention function under test only where given: not every one takes them.
ONLY_WHERE_GIVEN = ("dropout_rng", "query_segment_ids", "key_value_segment_ids")


def dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def upcast_floats(tree):
  """Floating-point leaves to float32 (bool masks and int lengths unchanged)."""
  return jax.tree.map(
      lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def random_inputs(key, shape_spec: Mapping[str, tuple | None], dtype) -> dict[str, jax.Array]:
  """Standard-normal arrays (one per named shape; None shapes are skipped) rounded to `dtype`.

  Normal values, not zeros or ones: constant inputs hide indexing bugs (every row and every
  key looks the same). The values are rounded once here, and every implementation under test
  receives these same rounded values, so rounding the inputs is not counted as an error.
  """
  names = [name for name, shape in shape_spec.items() if shape is not None]
  keys = jax.random.split(key, max(len(names), 1))
  return {
      name: jax.random.normal(k, tuple(shape_spec[name]), jnp.float32).astype(dtype)
      for k, name in zip(keys, names)
  }


def random_mask(key, shape: tuple, *, p_visible: float = 0.8, masked_row_every: int = 5):
  """A random bool mask (True = attend) in which every `masked_row_every`-th query row (axis -2,
  starting at row 3 so that tiny T keep a visible row) is fully masked, so that the
  no-visible-key path is exercised. When the mask has no query axis (size 1), the first head
  (axis -3, if present and > 1) is fully masked instead."""
  mask = np.array(jax.random.uniform(key, shape) < p_visible)  # a writable copy
  if len(shape) >= 2 and shape[-2] > 1:
    mask[..., 3::masked_row_every, :] = False
  elif len(shape) >= 3 and shape[-3] > 1:
    mask[..., 0, :, :] = False
  return jnp.asarray(mask)


# --------------------------------------------------------------------------------------------
# Shapes: everything is normalised to the 4-D BTNH / BSKH / BNTS form internally.
# --------------------------------------------------------------------------------------------

def _expand_leading(x, rank=4):
  """Adds leading unit axes up to `rank`, as jax.nn does for bias and mask."""
  if x is None:
    return None
  return jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))


def _to_4d(query, key, value, bias, mask):
  """BTNH (4-D), TNH (3-D: batch 1) or TH (2-D: a single head) -> 4-D operands."""
  if query.ndim == 2:  # single head: (T, H), (S, H); bias/mask broadcastable to (T, S)
    query, key, value = query[None, :, None, :], key[None, :, None, :], value[None, :, None, :]
  elif query.ndim == 3:
    query, key, value = query[None], key[None], value[None]
  return query, key, value, _expand_leading(bias), _expand_leading(mask)


def _normalise_window(local_window_size):
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    return (local_window_size, local_window_size)
  return tuple(local_window_size)


def segment_mask(query_segment_ids, key_value_segment_ids, batch: int):
  """Bool (B, 1, T, S): the packed-sequence mask, query and key ids equal; None without ids.
  Ids of 3-D / single-head calls ((T,) or (1, T)) get the batch axis of size 1."""
  if query_segment_ids is None:
    return None
  q_ids = jnp.reshape(jnp.asarray(query_segment_ids), (batch, -1))
  kv_ids = jnp.reshape(jnp.asarray(key_value_segment_ids), (batch, -1))
  return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def diagonal_offset(batch: int, T: int, S: int, query_seq_lengths=None,
                    key_value_seq_lengths=None, mask_alignment="top_left"):
  """int32 (B,): the offset of the diagonal, 0 for "top_left" (jax.nn), kv_len - q_len for
  "bottom_right" (the lengths default to T and S)."""
  q_len = (jnp.full((batch,), T, jnp.int32) if query_seq_lengths is None
           else jnp.asarray(query_seq_lengths, jnp.int32))
  kv_len = (jnp.full((batch,), S, jnp.int32) if key_value_seq_lengths is None
            else jnp.asarray(key_value_seq_lengths, jnp.int32))
  if mask_alignment == "bottom_right":
    return kv_len - q_len
  if mask_alignment == "top_left":
    return jnp.zeros((batch,), jnp.int32)
  raise ValueError(f"unknown mask_alignment {mask_alignment!r}")


def alibi_bias(alibi_slopes, query_shape, key_shape, **alignment):
  """float32 (B, N, T, S): ALiBi as a dense bias, -slope * |s - t - offset| with the diagonal's
  offset (diagonal_offset; `alignment`: its keyword arguments); slopes (N,), (B, N), () or
  (1,)."""
  B, T, N, _ = query_shape
  S = key_shape[1]
  slopes = jnp.asarray(alibi_slopes, jnp.float32)
  slopes = jnp.broadcast_to(slopes.reshape((B, N) if slopes.ndim == 2 else (1, -1)), (B, N))
  offset = diagonal_offset(B, T, S, **alignment)
  distance = jnp.abs(jnp.arange(S)[None, None, :] - jnp.arange(T)[None, :, None] -
                     offset[:, None, None]).astype(jnp.float32)  # (B, T, S)
  return -slopes[:, :, None, None] * distance[:, None]


def visibility(query_shape, key_shape, mask4=None, *, is_causal=False, local_window_size=None,
               query_seq_lengths=None, key_value_seq_lengths=None, mask_alignment="top_left",
               query_segment_ids=None, key_value_segment_ids=None):
  """Bool (B, N, T, S): whether key s is visible from query t, from every masking input.

  Key s is visible from query t iff t < q_len, s < kv_len, the dense mask allows it, the
  segment ids of t and s are equal (when given), and -left <= s - t - offset <= right, where
  causal means right = 0 and offset is 0 for "top_left" (jax.nn) or kv_len - q_len for
  "bottom_right"; q_len and kv_len default to T and S. This is the contract's definition written independently of jax.nn, and in the top-left
  case jax.nn receives the original arguments, so the two definitions check each other.
  """
  B, T, N, _ = query_shape
  S = key_shape[1]
  q_len = (jnp.full((B,), T, jnp.int32) if query_seq_lengths is None
           else jnp.asarray(query_seq_lengths, jnp.int32))
  kv_len = (jnp.full((B,), S, jnp.int32) if key_value_seq_lengths is None
            else jnp.asarray(key_value_seq_lengths, jnp.int32))
  offset = diagonal_offset(B, T, S, query_seq_lengths, key_value_seq_lengths, mask_alignment)
  t = jnp.arange(T)[None, :, None]
  s = jnp.arange(S)[None, None, :]
  diagonal = s - t - offset[:, None, None]  # (B, T, S)
  visible = (t < q_len[:, None, None]) & (s < kv_len[:, None, None])
  if is_causal:
    visible &= diagonal <= 0
  window = _normalise_window(local_window_size)
  if window is not None:
    left, right = window
    visible &= (diagonal >= -left) & (diagonal <= right)
  visible = visible[:, None]  # (B, 1, T, S)
  if mask4 is not None:
    visible = visible & mask4
  segments = segment_mask(query_segment_ids, key_value_segment_ids, B)
  if segments is not None:
    visible = visible & segments
  return jnp.broadcast_to(visible, (B, N, T, S))


def visible_rows(query, key, mask=None, **masking):
  """Bool array of shape query.shape[:-1]: whether each output row has at least one visible key.
  `masking` takes the keyword arguments of jaxflash.attention that mask (is_causal, ...)."""
  q4, k4, _, _, mask4 = _to_4d(query, key, key, None, mask)
  rows = visibility(q4.shape, k4.shape, mask4, **masking).any(axis=-1)  # (B, N, T)
  return jnp.reshape(jnp.transpose(rows, (0, 2, 1)), query.shape[:-1])


# --------------------------------------------------------------------------------------------
# Where the reference and baseline run: always the CPU
# --------------------------------------------------------------------------------------------

def on_cpu(fn, *args, **kwargs):
  """fn(*args, **kwargs) on the CPU: the array leaves of args/kwargs are copied there (the same
  values, already rounded) and the CPU is the default device while fn runs, so everything it
  creates or jits lives there too."""
  cpu = jax.devices("cpu")[0]
  to_cpu = lambda x: jax.device_put(x, cpu) if isinstance(x, (jax.Array, np.ndarray)) else x
  args, kwargs = jax.tree.map(to_cpu, (args, kwargs))
  with jax.default_device(cpu):
    return fn(*args, **kwargs)


def made_on_cpu(device, fn, *args, **kwargs):
  """fn(*args, **kwargs) computed on the CPU (random inputs: the same values on every backend,
  and no GPU compile for them), its array results then placed on `device`."""
  return jax.device_put(on_cpu(fn, *args, **kwargs), device)


def exact_float32(precision) -> bool:
  """Whether jaxflash's `precision` argument asks for float32-accurate products (None: what
  jax_default_matmul_precision says now), as the tests use it."""
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  return precision in ("highest", "float32", jax.lax.Precision.HIGHEST)


def baseline_uses_tf32(backend: str, dtype, precision=None) -> bool:
  """The baseline models float32 on tf32 tensor cores exactly when ours runs there: the CUDA
  kernels at float32 without an exact `precision`."""
  return backend == "cuda" and dtype_name(dtype) == "float32" and not exact_float32(precision)


def compute_name(backend: str, dtype, precision=None) -> str:
  """The dtype name whose tolerance applies: "tensorfloat32" where ours runs float32 on tf32
  tensor cores, else the input dtype."""
  return "tensorfloat32" if baseline_uses_tf32(backend, dtype, precision) else dtype_name(dtype)


# --------------------------------------------------------------------------------------------
# tf32 matmuls (for the float32 baseline on CUDA)
# --------------------------------------------------------------------------------------------

def round_to_tf32(x):
  """float32 values rounded to tf32 (10 mantissa bits; to nearest, ties away from zero, what
  cvt.rna.tf32 does), kept in float32. Other dtypes pass through unchanged."""
  if x.dtype != jnp.float32:
    return x
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _exact_dot(lhs, rhs, dimension_numbers, preferred_element_type):
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _tf32_dot(lhs, rhs, dimension_numbers, preferred_element_type):
  return _exact_dot(round_to_tf32(lhs), round_to_tf32(rhs), dimension_numbers,
                    preferred_element_type)


def _tf32_dot_fwd(lhs, rhs, dimension_numbers, preferred_element_type):
  lhs, rhs = round_to_tf32(lhs), round_to_tf32(rhs)
  return _exact_dot(lhs, rhs, dimension_numbers, preferred_element_type), (lhs, rhs)


def _tf32_dot_bwd(dimension_numbers, preferred_element_type, saved, cotangent):
  # The transposed products (cotangent x the other operand) are matmuls too: their operands
  # are rounded as well.
  lhs, rhs = (round_to_tf32(x) for x in saved)
  _, vjp = jax.vjp(lambda a, b: _exact_dot(a, b, dimension_numbers, preferred_element_type),
                   lhs, rhs)
  return vjp(round_to_tf32(cotangent))


_tf32_dot.defvjp(_tf32_dot_fwd, _tf32_dot_bwd)


def tf32_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                     out_sharding=None):
  """lax.dot_general as float32 runs on tf32 tensor cores: both operands rounded to tf32, the
  products accumulated in float32 (exactly, here); in the VJP the cotangent and the saved
  operands are rounded before the transposed products. `precision` is ignored (that is the
  point). Usable as jnp.einsum's `_dot_general` and as Flax's `dot_general`.

  Why not run jax.nn on the GPU as the baseline instead: XLA's float32 default on GPU is tf32
  for real GEMMs but exact for degenerate ones (contraction length 1, matrix-vector products),
  so the bound would depend on which algebraic rewrites XLA applies to each shape."""
  assert out_sharding is None, out_sharding
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  dimension_numbers = ((tuple(lhs_contract), tuple(rhs_contract)),
                       (tuple(lhs_batch), tuple(rhs_batch)))
  if preferred_element_type is not None:
    preferred_element_type = jnp.dtype(preferred_element_type)
  return _tf32_dot(lhs, rhs, dimension_numbers, preferred_element_type)


def _einsum(spec, a, b, *, tf32=False, **kwargs):
  """jnp.einsum, with tf32 operand rounding (tf32_dot_general) when `tf32`."""
  if tf32:
    kwargs["_dot_general"] = tf32_dot_general
  return jnp.einsum(spec, a, b, **kwargs)


# --------------------------------------------------------------------------------------------
# Reference and baseline
# --------------------------------------------------------------------------------------------

def _logits(q4, k4, bias4, scale, precision, tf32=False, softcap=None):
  """float32 (B, N, T, S) logits = scale * q.k + bias, with head n reading kv head n // G as in
  jax.nn (N is split as (K, G)); with a soft-cap, cap * tanh(scale * q.k / cap) + bias."""
  B, T, N, H = q4.shape
  S, K = k4.shape[1], k4.shape[2]
  grouped = jnp.reshape(q4, (B, T, K, N // K, H))
  logits = _einsum("btkgh,bskh->bkgts", grouped, k4, tf32=tf32, precision=precision,
                   preferred_element_type=jnp.float32)
  logits = jnp.reshape(logits, (B, N, T, S)) * jnp.float32(scale)
  if softcap:
    logits = jnp.float32(softcap) * jnp.tanh(logits / jnp.float32(softcap))
  if bias4 is not None:
    logits = logits + bias4.astype(jnp.float32)
  return logits


def _masked_logsumexp(logits, visible):
  """logsumexp over the visible keys; -inf for rows with none. Differentiable everywhere: the
  rows with no visible key are replaced by zeros before logsumexp (the double-where trick), so
  no -inf - (-inf) reaches the gradient."""
  row_visible = visible.any(axis=-1)
  safe = jnp.where(visible, logits, -jnp.inf)
  safe = jnp.where(row_visible[..., None], safe, 0.0)
  lse = jax.nn.logsumexp(safe, axis=-1)
  return jnp.where(row_visible, lse, -jnp.inf)


def _xla_path_restated(q4, k4, v4, bias4, visible, scale, tf32=False, dropout4=None,
                       softcap=None):
  """jax.nn's XLA path (_dot_product_attention_core) restated for the input dtype: float32
  logits from input-dtype operands, masked with jax.nn's large negative, float32 softmax, P cast
  to the value dtype, PV in the value dtype. With `tf32`, both matmuls (and their transposes in
  the VJP) round their operands to tf32 (tf32_dot_general).

  The baseline cannot call jax.nn itself for float16/bfloat16: jax.nn pins the dot algorithms
  F16_F16_F32 / BF16_BF16_F32, which XLA:CPU rejects when the VJP is compiled ("The precision
  'F16_F16_F32' is not supported by dot_general on CPU"), i.e. jax.nn's half-precision
  gradients do not run on CPU at all. test_reference_is_jax_nn checks that this restatement
  equals jax.nn where both run.

  dropout4: None, or the float32 (B|1, N|1, T, S) multiplier keep / (1 - rate) applied to the
  float32 probabilities (as Flax applies its dropout to the attention weights).
  softcap: None, or the logit soft-cap, applied to the float32 logits (as a model that caps
  them in jnp before its softmax does)."""
  B, T, N, _ = q4.shape
  S, K = k4.shape[1], k4.shape[2]
  logits = _logits(q4, k4, bias4, scale, None, tf32, softcap)
  large_negative = jnp.float32(-0.7 * np.finfo(np.float32).max)
  probs = jax.nn.softmax(jnp.where(visible, logits, large_negative), axis=-1)
  if dropout4 is not None:
    probs = probs * dropout4
  probs = probs.astype(v4.dtype)
  probs = jnp.reshape(probs, (B, K, N // K, T, S))
  out = _einsum("bkgts,bskh->btkgh", probs, v4, tf32=tf32)
  return jnp.reshape(out, (B, T, N, v4.shape[-1]))  # the value's head dim


def _attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
               query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
               return_residual=False, mask_alignment="top_left", compute_dtype=None,
               precision=None, use_jax_nn=True, tf32=False, dropout_rate=0.0, dropout_rng=None,
               broadcast_dropout=False, logits_soft_cap=None, query_segment_ids=None,
               key_value_segment_ids=None, alibi_slopes=None):
  """jax.nn.dot_product_attention's semantics with jaxflash's conventions (module docstring).

  compute_dtype: None computes in the input dtype, else inputs are upcast to it first.
  precision: a jax.default_matmul_precision name, or None for the default.
  use_jax_nn: call jax.nn (XLA implementation) itself, else _xla_path_restated (always, with
    dropout, a soft-cap or a value head dim other than the query's, which jax.nn does not
    take).
  tf32: round every matmul operand to tf32 (only with use_jax_nn=False).
  dropout_rate, dropout_rng, broadcast_dropout, logits_soft_cap, query_segment_ids,
    key_value_segment_ids, alibi_slopes: jaxflash.attention's (jax.nn gets the segment ids as
    part of its boolean mask, and ALiBi as the dense float32 bias alibi_bias builds, added to
    `bias`).
  """
  assert not (tf32 and use_jax_nn), "tf32 applies to the restated path"
  in_dtype = query.dtype
  if compute_dtype is not None:
    query, key, value = (x.astype(compute_dtype) for x in (query, key, value))
    bias = None if bias is None else bias.astype(compute_dtype)
  if logits_soft_cap is not None or value.shape[-1] != query.shape[-1]:
    use_jax_nn = False
  dropout4 = None
  if dropout_rate > 0.0:
    use_jax_nn = False
    keep = jaxflash.dropout_mask(dropout_rng, query.shape, key.shape, dropout_rate,
                                 broadcast_dropout=broadcast_dropout)
    dropout4 = _expand_leading(keep.astype(jnp.float32) / jnp.float32(1.0 - dropout_rate))
  q4, k4, v4, bias4, mask4 = _to_4d(query, key, value, bias, mask)
  if alibi_slopes is not None:
    # ALiBi as the dense float32 bias it stands for (added after the soft-cap, with the bias).
    alibi = alibi_bias(alibi_slopes, q4.shape, k4.shape, query_seq_lengths=query_seq_lengths,
                       key_value_seq_lengths=key_value_seq_lengths, mask_alignment=mask_alignment)
    bias4 = alibi if bias4 is None else bias4.astype(jnp.float32) + alibi
  if scale is None:
    scale = 1.0 / math.sqrt(q4.shape[-1])
  masking = dict(is_causal=is_causal, local_window_size=local_window_size,
                 query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths, mask_alignment=mask_alignment,
                 query_segment_ids=query_segment_ids, key_value_segment_ids=key_value_segment_ids)
  visible = visibility(q4.shape, k4.shape, mask4, **masking)
  row_visible = jnp.transpose(visible.any(axis=-1), (0, 2, 1))  # (B, T, N)

  precision_context = (jax.default_matmul_precision(precision) if precision is not None
                       else contextlib.nullcontext())
  with precision_context:
    if not use_jax_nn:
      out = _xla_path_restated(q4, k4, v4, bias4, visible, scale, tf32, dropout4, logits_soft_cap)
    else:
      if mask_alignment == "bottom_right":
        # jax.nn only knows top-left diagonals: hand it the complete visibility as a mask.
        nn_mask, nn_causal, nn_window = visible, False, None
      else:  # jax.nn's own masking arguments, so that `visibility` is checked against it
        nn_mask, nn_causal, nn_window = mask4, is_causal, local_window_size
        segments = segment_mask(query_segment_ids, key_value_segment_ids, q4.shape[0])
        if segments is not None:  # jax.nn has no segment ids: they join its boolean mask
          nn_mask = segments if nn_mask is None else nn_mask & segments
      out = jax.nn.dot_product_attention(
          q4, k4, v4, bias4, nn_mask, scale=scale, is_causal=nn_causal,
          query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
          local_window_size=nn_window, implementation="xla")
    # Our convention: rows with no visible key are 0. Multiplying (not jnp.where) keeps the
    # gradient of those rows exactly 0 as well.
    out = out * row_visible[..., None].astype(out.dtype)
    out = jnp.reshape(out, query.shape[:-1] + value.shape[-1:])
    if not return_residual:
      return out
    lax_precision = jax.lax.Precision.HIGHEST if precision == "highest" else None
    lse = _masked_logsumexp(_logits(q4, k4, bias4, scale, lax_precision, tf32, logits_soft_cap),
                            visible)
    # jaxflash returns the lse in the query dtype; the reference keeps float32 (its best
    # answer), the baseline rounds to the input dtype like jax.nn does.
    lse = jnp.transpose(lse, (0, 2, 1))
    if compute_dtype is None:
      lse = lse.astype(in_dtype)
    return out, jnp.reshape(lse, query.shape[:-1])


def reference_attention(query, key, value, bias=None, mask=None, **kwargs):
  """The best answer: jax.nn (XLA) in float32 at "highest" precision on the same rounded inputs
  upcast to float32, with jaxflash's conventions. Takes jaxflash.attention's arguments (except
  `implementation`); results are float32. Differentiate it with respect to upcast_floats(...)
  of the inputs, so that its gradients are float32 too (not rounded back to the input dtype by
  the transpose of the upcast)."""
  return _attention(query, key, value, bias, mask, compute_dtype=jnp.float32,
                    precision="highest", **kwargs)


def baseline_attention(query, key, value, bias=None, mask=None, *, tf32=False, **kwargs):
  """What a user gets from jax.nn today: its XLA path in the input dtype at default precision
  (restated, see _xla_path_restated), with jaxflash's conventions (zero rows, lse). `tf32`:
  float32 as on a tf32 GPU (every matmul operand rounded to tf32)."""
  return _attention(query, key, value, bias, mask, use_jax_nn=False, tf32=tf32, **kwargs)


def restated_reference_attention(query, key, value, bias=None, mask=None, **kwargs):
  """reference_attention computed by _xla_path_restated instead of jax.nn (for checking that
  the restatement is jax.nn)."""
  return _attention(query, key, value, bias, mask, compute_dtype=jnp.float32,
                    precision="highest", use_jax_nn=False, **kwargs)


# --------------------------------------------------------------------------------------------
# Running forward + backward
# --------------------------------------------------------------------------------------------

def forward_and_grads(attention_fn: Callable, inputs: Mapping[str, jax.Array | None],
                      cotangent, **static_kwargs):
  """Runs attention_fn(**inputs, **static_kwargs) under jit and its VJP with `cotangent` (the
  output's, or (out, lse) when return_residual). Equivalent to the gradients of
  sum(out * cotangent) (+ sum(lse * lse_cotangent)) but, unlike the sum, well defined when lse
  is -inf. Returns (outputs, {"dq": ..., "dk": ..., "dv": ..., "dbias": ...})."""
  differentiable = {n: inputs[n] for n in DIFFERENTIABLE if inputs.get(n) is not None}
  # (ONLY_WHERE_GIVEN: not every attention_fn under test takes them.)
  fixed = {n: inputs.get(n) for n in NON_DIFFERENTIABLE
           if n not in ONLY_WHERE_GIVEN or inputs.get(n) is not None}

  @jax.jit
  def run(differentiable, fixed, cotangent):
    def f(differentiable):
      return attention_fn(**differentiable, **fixed, **static_kwargs)
    outputs, vjp = jax.vjp(f, differentiable)
    # The same cotangent values for every implementation, in each one's output dtype (the
    # reference's outputs are float32).
    (grads,) = vjp(jax.tree.map(lambda c, o: c.astype(o.dtype), cotangent, outputs))
    return outputs, grads

  outputs, grads = run(differentiable, fixed, cotangent)
  return outputs, {GRAD_NAMES[n]: g for n, g in grads.items()}


def float64_forward_and_grads(inputs: Mapping[str, jax.Array | None], cotangent, *,
                              is_causal: bool = False):
  """forward_and_grads' ((out, lse), grads) of plain attention in float64 with NumPy, from the
  (rounded) inputs, for cotangents (d_out, d_lse): the reference where the float32 one is not
  exact enough to judge against, i.e. logits so large that float32's rounding of them moves the
  probabilities (test_numerics' large logits). 4-D query/key/value with as many key heads as
  query heads, an optional (B, N, T, S) bias, top-left causal masking; every row must see a key.
  """
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  q, k, v = (np.swapaxes(f64(inputs[n]), 1, 2) for n in ("query", "key", "value"))  # BNTH
  d_out, d_lse = np.swapaxes(f64(cotangent[0]), 1, 2), np.swapaxes(f64(cotangent[1]), 1, 2)
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = scale * q @ np.swapaxes(k, -1, -2)
  if inputs.get("bias") is not None:
    logits = logits + f64(inputs["bias"])
  if is_causal:
    T, S = logits.shape[-2:]
    logits = np.where(np.tri(T, S, dtype=bool), logits, -np.inf)
  top = logits.max(axis=-1, keepdims=True)
  unnormalised = np.exp(logits - top)
  total = unnormalised.sum(axis=-1, keepdims=True)
  p = unnormalised / total
  out, lse = p @ v, (top + np.log(total))[..., 0]
  # d logits = P o (dP - rowsum(dO o O)) + P d_lse
  dp = d_out @ np.swapaxes(v, -1, -2)
  ds = p * (dp - (d_out * out).sum(axis=-1, keepdims=True) + d_lse[..., None])
  grads = {"dq": scale * ds @ k, "dk": scale * np.swapaxes(ds, -1, -2) @ q,
           "dv": np.swapaxes(p, -1, -2) @ d_out}
  grads = {name: np.swapaxes(g, 1, 2) for name, g in grads.items()}
  if inputs.get("bias") is not None:
    grads["dbias"] = ds
  return (np.swapaxes(out, 1, 2), np.swapaxes(lse, 1, 2)), grads


def reference_and_baseline(inputs: Mapping[str, jax.Array | None], cotangent, *, backend: str,
                           **static_kwargs):
  """The reference's and the baseline's (outputs, grads) for jaxflash.attention(**inputs,
  **static_kwargs) tested on `backend` (forward_and_grads' results), both computed on the CPU
  from the same values. `static_kwargs` are jaxflash.attention's; its `precision` chooses the
  baseline: tf32 matmuls where the CUDA kernels use tf32 (baseline_uses_tf32), else the plain
  input-dtype one (at float32 on the CPU: exact)."""
  static_kwargs = dict(static_kwargs)
  precision = static_kwargs.pop("precision", None)
  tf32 = baseline_uses_tf32(backend, inputs["query"].dtype, precision)

  def run(inputs, cotangent):
    ref = forward_and_grads(reference_attention, upcast_floats(inputs), cotangent,
                            **static_kwargs)
    base = forward_and_grads(functools.partial(baseline_attention, tf32=tf32), inputs,
                             cotangent, **static_kwargs)
    return ref, base

  return on_cpu(run, inputs, cotangent)


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

def _f32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def assert_close(ours, ref, baseline, dtype, what: str, *, factor: float = 2.0,
                 floor: float = 1.0, summed_terms: int = 1):
  """FlashAttention's rule: max|ours - ref| <= factor * max|baseline - ref| + atol, with
  atol = ATOL_FACTOR[dtype] * max(floor, max|ref|); `dtype` is the compute dtype: the query
  dtype, or "tensorfloat32" (compute_name).

  `summed_terms`: a result that is one float32 sum of that many products of magnitude `floor`
  (the scale's gradient, over every element of q) also carries their accumulation-order noise,
  which grows like the square root of their count: atol adds ATOL_FACTOR["float32"] *
  sqrt(summed_terms) * floor. (Where such a sum cancels to exactly 0, e.g. one visible key, the
  baseline's autodiff cancels bit for bit and ours, summed in another order, does not.)

  `floor` is the magnitude of the terms a result is summed from when the result itself can
  cancel to ~0 (a gradient through a near one-hot softmax, e.g. dk when only one key is
  visible, is exactly 0 while its terms are not): 1 for unit-scale operands, their scale
  otherwise.

  Non-finite values: NaN or +inf in ours always fails; -inf (lse of a row with no visible key)
  must appear in ours exactly where it appears in the reference.
  """
  dtype = dtype if isinstance(dtype, str) and dtype in ATOL_FACTOR else dtype_name(dtype)
  ours, ref, baseline = _f32(ours), _f32(ref), _f32(baseline)
  assert ours.shape == ref.shape, f"{what}: shape {ours.shape}, expected {ref.shape}"
  assert not np.isnan(ref).any() and not np.isposinf(ref).any(), (
      f"{what}: the reference itself is not finite (a test bug)")
  bad = np.isnan(ours) | np.isposinf(ours)
  assert not bad.any(), (
      f"{what}: {int(bad.sum())} NaN/+inf values in ours, first at "
      f"{tuple(int(i) for i in np.argwhere(bad)[0])}")
  neg_inf_ours, neg_inf_ref = np.isneginf(ours), np.isneginf(ref)
  mismatch = neg_inf_ours != neg_inf_ref
  assert not mismatch.any(), (
      f"{what}: -inf pattern differs from the reference at {int(mismatch.sum())} positions, "
      f"first at {tuple(int(i) for i in np.argwhere(mismatch)[0])} "
      f"(ours {ours[tuple(np.argwhere(mismatch)[0])]}, ref {ref[tuple(np.argwhere(mismatch)[0])]})")
  finite = ~neg_inf_ref
  if not finite.any():
    return
  with np.errstate(invalid="ignore"):  # -inf - -inf at the rows excluded by `finite`
    err = np.where(finite, np.abs(ours - ref), 0.0)
    base = np.abs(baseline - ref)
  base_err = float(np.max(np.where(finite & np.isfinite(base), base, 0.0)))
  max_ref = float(np.max(np.abs(ref[finite])))
  atol = ATOL_FACTOR[dtype] * max(floor, max_ref)
  atol += ATOL_FACTOR["float32"] * math.sqrt(summed_terms) * floor if summed_terms > 1 else 0.0
  worst = np.unravel_index(np.argmax(err), err.shape)
  max_err = float(err[worst])
  bound = factor * base_err + atol
  assert max_err <= bound, (
      f"{what} ({dtype}): max|ours-ref| = {max_err:.4g} at {tuple(int(i) for i in worst)} "
      f"(ours {ours[worst]:.6g}, ref {ref[worst]:.6g}) > {factor:g} * max|baseline-ref| "
      f"({base_err:.4g}) + atol ({atol:.4g}) = {bound:.4g}; max|ref| = {max_ref:.4g}")


def assert_rows_zero(x, row_visible, what: str):
  """Rows (all but the last axis) with no visible key must be exactly 0 -- not small, not NaN."""
  x = _f32(x)
  hidden = ~np.asarray(row_visible)
  if not hidden.any():
    return
  rows = x[hidden]
  assert np.all(rows == 0.0), (
      f"{what}: {int(np.sum(np.any(rows != 0.0, axis=-1)))} of {int(hidden.sum())} rows with no "
      f"visible key are not exactly 0 (max |value| {np.nanmax(np.abs(rows)):.4g}, "
      f"NaN: {bool(np.isnan(rows).any())})")


def assert_same_kernel(actual, expected, dtype, what: str):
  """Two ways of running the same kernel agree to one rounding of the dtype.

  The absolute part scales with the array's magnitude: a sum JAX forms outside the kernel
  (the gradient of an operand shared across a vmapped axis) adds in another order than the
  per-item loop, which shows on entries that cancel to nearly 0.
  """
  name = dtype if isinstance(dtype, str) and dtype in SAME_KERNEL_TOL else dtype_name(dtype)
  rtol, atol = SAME_KERNEL_TOL[name]
  expected = _f32(expected)
  finite = np.abs(expected[np.isfinite(expected)])  # -inf lse rows must not make atol infinite
  magnitude = max(1.0, float(finite.max())) if finite.size else 1.0
  np.testing.assert_allclose(_f32(actual), expected, rtol=rtol, atol=atol * magnitude, err_msg=what)


def assert_bitwise_equal(actual, expected, what: str):
  a, e = np.asarray(actual), np.asarray(expected)
  assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
  assert a.tobytes() == e.tobytes(), (
      f"{what}: not bitwise equal; max |difference| "
      f"{np.nanmax(np.abs(a.astype(np.float32) - e.astype(np.float32))):.4g}")


# --------------------------------------------------------------------------------------------
# Compiled HLO inspection
# --------------------------------------------------------------------------------------------

_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# An HLO instruction whose opcode is transpose or copy: "%x = f32[..]{..} transpose(...".
_TRANSPOSE_OR_COPY = re.compile(r"= \S+ (transpose|copy)\(")


def custom_call_targets(hlo_text: str) -> list[str]:
  return _CUSTOM_CALL_TARGET.findall(hlo_text)


def count_custom_calls(hlo_text: str, name: str) -> int:
  """Custom-call instructions whose target contains `name` (metadata that merely mentions the
  name, such as op_name, is not counted)."""
  return sum(name in target for target in custom_call_targets(hlo_text))


def transpose_or_copy_lines(hlo_text: str) -> list[str]:
  return [line.strip() for line in hlo_text.splitlines() if _TRANSPOSE_OR_COPY.search(line)]


def compiled_hlo(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


@contextlib.contextmanager
def one_head_dim_on_cpu():
  """Inside it the CPU kernels are lowered as the CUDA ones are: a call whose value head dim Hv
  differs from the query/key one H runs as a call of one head dim max(H, Hv), zero-padded
  around the kernel (jaxflash.kernels.call_with_one_head_dim); outside it the CPU kernels take
  both head dims natively. JAX's caches are cleared on the way in and out, so that nothing
  compiled one way runs the other. Yields a list that collects (kernel primitive name,
  seq_dims) for each call lowered through the padding."""
  kernels = jaxflash.kernels
  padded_calls = []
  pad = kernels.call_with_one_head_dim

  def recording(bind, *args, config, **kwargs):
    padded_calls.append((bind.__self__.name, config.seq_dims))
    return pad(bind, *args, config=config, **kwargs)

  jax.clear_caches()
  kernels.call_with_one_head_dim = recording
  kernels.register_lowerings("cpu", one_head_dim=True)
  try:
    yield padded_calls
  finally:
    kernels.register_lowerings("cpu")
    kernels.call_with_one_head_dim = pad
    jax.clear_caches()
