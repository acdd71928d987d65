"""The checks of jaxflash's public API: every argument of jaxflash.attention and
jaxflash.ring_attention, checked at trace time, and turned into what the kernels take.

Every error names the argument, what was given and what is allowed. validate() describes
each operand's axes as a jaxflash.layout and builds the call's contract.KernelConfig;
validate_ring() adds ring_attention's own arguments.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import dropout as dropout_lib
from jaxflash import ring as ring_lib
from jaxflash.contract import UNBOUNDED, Flag, KernelConfig
from jaxflash.layout import COL, ROW, Layout, lse_layout

SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
MAX_HEAD_DIM = 256


@dataclasses.dataclass
class Call:
  """A validated call: the operands as the kernels take them (None: absent; the bias in the
  query dtype or float32, the lengths and segment ids in int32, the dropout's seed words, the
  ALiBi slopes in float32, a traced scale as the float32 (1,) scale operand: None when the scale
  is static, config.scale then), the static config, and whether the result is empty (a zero-size
  axis), which the kernels are not called for."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  q_lens: jax.Array | None
  kv_lens: jax.Array | None
  seed: jax.Array | None
  q_segment_ids: jax.Array | None
  kv_segment_ids: jax.Array | None
  alibi_slopes: jax.Array | None
  scale: jax.Array | None
  config: KernelConfig
  is_empty: bool

  def optional_operands(self) -> tuple[jax.Array | None, ...]:
    """The optional operands in the kernels' order (contract.OPTIONAL_INPUTS)."""
    return (self.bias, self.mask, self.q_lens, self.kv_lens, self.seed, self.q_segment_ids,
            self.kv_segment_ids, self.alibi_slopes, self.scale)


def _shape_str(x) -> str:
  return f"shape {tuple(x.shape)}"


def _as_array(x, name: str) -> jax.Array:
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise TypeError(f"jaxflash.attention: {name} must be an array, got {type(x).__name__}") from e


def validate(query, key, value, *, bias=None, mask=None, scale=None, is_causal=False,
             query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
             implementation=None, return_residual=False, mask_alignment="top_left",
             precision=None, dropout_rate=0.0, dropout_rng=None, broadcast_dropout=False,
             logits_soft_cap=None, query_segment_ids=None, key_value_segment_ids=None,
             alibi_slopes=None) -> Call:
  """jaxflash.attention's arguments (the defaults are its own) checked and turned into a Call.
  Raises TypeError or ValueError naming the argument, what was given and what is allowed."""
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
  # The value head dim may differ from the query/key one (attention only contracts q with k);
  # every other axis is key's.
  if v.shape[:-1] != k.shape[:-1]:
    raise ValueError(f"jaxflash.attention: value must have the shape of key {tuple(k.shape)} "
                     f"except in its last axis (the value head dim, which may differ from the "
                     f"key's), got {_shape_str(v)}")

  # Name the axes (B, T, N, H); a 3-D call has B = 1, a single head also N = 1.
  def named_axes(shape):
    return tuple(shape) if rank == 4 else (1, *shape) if rank == 3 else (1, shape[0], 1, shape[1])
  B, T, N, H = named_axes(q.shape)
  Bk, S, K, Hk = named_axes(k.shape)
  Hv = v.shape[-1]
  if Bk != B:
    raise ValueError(f"jaxflash.attention: key batch size must equal the query's ({B}), got "
                     f"{_shape_str(k)}")
  if Hk != H:
    raise ValueError(f"jaxflash.attention: key head dim must equal the query's ({H}), got "
                     f"{_shape_str(k)}")
  if H > MAX_HEAD_DIM:
    raise ValueError(f"jaxflash.attention: head dim (query.shape[-1]) must be <= {MAX_HEAD_DIM}, "
                     f"got {H}")
  if Hv > MAX_HEAD_DIM:
    raise ValueError(f"jaxflash.attention: value head dim (value.shape[-1]) must be <= "
                     f"{MAX_HEAD_DIM}, got {Hv}")
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

  def seq_layout(shape, heads) -> Layout:
    roles = ((batch_role, ROW, heads, COL) if rank == 4 else
             (ROW, heads, COL) if rank == 3 else (ROW, COL))
    return tuple(zip(roles, shape))

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
    given_as_jax = isinstance(x, jax.Array)
    if not given_as_jax:
      _check_int32_values(x, name)
    x = _as_array(x, name)
    allowed = ((B,),) if rank == 4 else ((), (1,))
    if x.shape not in allowed:
      want = f"shape ({B},)" if rank == 4 else "a scalar or shape (1,)"
      raise ValueError(f"jaxflash.attention: {name} must have {want}, got {_shape_str(x)}")
    # A JAX array may be traced, so its values cannot be checked: like jax.nn, only int32
    # is taken (a wider or unsigned one could hold lengths that int32 would wrap).
    if not jnp.issubdtype(x.dtype, jnp.integer) or (given_as_jax and x.dtype != jnp.int32):
      raise TypeError(f"jaxflash.attention: {name} must be an int32 array, got {x.dtype}")
    return x.astype(jnp.int32), tuple(zip((batch_role,) * x.ndim, x.shape))

  q_lens, q_lens_layout = lengths(query_seq_lengths, "query_seq_lengths")
  kv_lens, kv_lens_layout = lengths(key_value_seq_lengths, "key_value_seq_lengths")

  if (query_segment_ids is None) != (key_value_segment_ids is None):
    given, missing = (("query_segment_ids", "key_value_segment_ids")
                      if key_value_segment_ids is None else
                      ("key_value_segment_ids", "query_segment_ids"))
    raise ValueError(f"jaxflash.attention: {given} was given without {missing}; pass both (a "
                     f"query sees a key only where their ids are equal; for self-attention pass "
                     f"the same array twice)")

  def segment_ids(x, name: str, length: int, length_name: str):
    if x is None:
      return None, None
    x = _segment_id_array(x, name)
    allowed = ((B, length),) if rank == 4 else ((length,), (1, length))
    if x.shape not in allowed:
      want = (f"shape ({B}, {length}) (batch, {length_name})" if rank == 4 else
              f"shape ({length},) or (1, {length}) ({length_name})")
      raise ValueError(f"jaxflash.attention: {name} must have {want}, got {_shape_str(x)}")
    roles = ((batch_role, ROW) if rank == 4 else (((), ROW) if x.ndim == 2 else (ROW,)))
    return x, tuple(zip(roles, x.shape))

  q_ids, q_ids_layout = segment_ids(query_segment_ids, "query_segment_ids", T, "T")
  kv_ids, kv_ids_layout = segment_ids(key_value_segment_ids, "key_value_segment_ids", S, "S")

  slopes, slopes_layout = _alibi_slopes(alibi_slopes, rank, B, N, batch_role, head_role)

  window = _window(local_window_size, is_causal)
  scale, traced_scale = _scale(scale, H)
  scale_operand = scale_layout = None
  if traced_scale is not None:
    # One scale shared by every instance: a size-1 axis of no instance axis (stride 0 along
    # all of them), into which vmap's batching rule inserts the mapped axis.
    scale_operand, scale_layout = jnp.reshape(traced_scale.astype(jnp.float32), (1,)), (((), 1),)
  softcap = _soft_cap(logits_soft_cap)

  flags = Flag.BOTTOM_RIGHT if mask_alignment == "bottom_right" else Flag(0)
  if exact_f32 and q.dtype == jnp.float32:
    flags |= Flag.EXACT_F32
  layouts = {"q": seq_layout(q.shape, head_role), "k": seq_layout(k.shape, kv_head_role),
             "v": seq_layout(v.shape, kv_head_role),
             "o": seq_layout(q.shape[:-1] + (Hv,), head_role)}  # q's rows, v's features
  layouts["lse"] = lse_layout(layouts["q"])
  for name, layout, flag in (("bias", bias_layout, Flag.HAS_BIAS),
                             ("mask", mask_layout, Flag.HAS_MASK),
                             ("q_lens", q_lens_layout, Flag.HAS_Q_LENS),
                             ("kv_lens", kv_lens_layout, Flag.HAS_KV_LENS),
                             ("q_segment_ids", q_ids_layout, Flag.HAS_SEGMENT_IDS),
                             ("kv_segment_ids", kv_ids_layout, Flag.HAS_SEGMENT_IDS),
                             ("alibi_slopes", slopes_layout, Flag.HAS_ALIBI),
                             ("scale", scale_layout, Flag.SCALE_OPERAND)):
    if layout is not None:
      layouts[name] = layout
      flags |= flag
  is_empty = 0 in (B, T, S, N, H, Hv)

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
      flags |= Flag.DROPOUT
  config = KernelConfig(instance_sizes=instance_sizes, layouts=tuple(sorted(layouts.items())),
                        seq_dims=(T, S, H, Hv), scale=scale, window=window, flags=flags,
                        keep_threshold=keep_threshold, keep_scale=keep_scale, softcap=softcap)
  return Call(q, k, v, bias, mask, q_lens, kv_lens, seed, q_ids, kv_ids, slopes, scale_operand,
              config, is_empty)


def validate_ring(query, key, value, *, axis_name, scale, is_causal, local_window_size, order,
                  precision, return_residual, logits_soft_cap, query_seq_lengths=None,
                  key_value_seq_lengths=None, query_segment_ids=None,
                  key_value_segment_ids=None, dropout_rate=0.0, dropout_rng=None,
                  broadcast_dropout=False) -> Call:
  """jaxflash.ring_attention's arguments: those it shares with jaxflash.attention (checked as
  there), then the ring's own; also refuses what ring attention cannot compute."""
  call = validate(query, key, value, scale=scale, is_causal=is_causal,
                  local_window_size=local_window_size, precision=precision,
                  return_residual=return_residual, logits_soft_cap=logits_soft_cap,
                  query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths,
                  query_segment_ids=query_segment_ids,
                  key_value_segment_ids=key_value_segment_ids, dropout_rate=dropout_rate,
                  dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout)
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
  T, S = call.config.seq_dims[:2]
  if order == "zigzag" and call.config.window not in (ring_lib.OPEN, ring_lib.CAUSAL):
    raise ValueError(f"jaxflash.ring_attention: order='zigzag' balances causal attention; with "
                     f"local_window_size={local_window_size!r} use order='contiguous' (a "
                     f"window gives every device about the same work there)")
  if order == "zigzag" and (T % 2 or S % 2):
    raise ValueError(f"jaxflash.ring_attention: order='zigzag' needs even block lengths (two "
                     f"chunks per device), got query block {T} and key block {S}")
  why = ring_lib.unsupported(call.config) or ring_lib.dropout_misaligned(call.config, order)
  if why is not None:
    raise ValueError(f"jaxflash.ring_attention: {why}")
  return call


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


_INT32_LIMIT = 2**31


def _check_int32_values(x, name: str) -> None:
  """Concrete lengths or segment ids (NumPy arrays, Python ints or lists) of any integer type
  are taken when their values fit in int32; jnp.asarray would otherwise wrap them silently (2**32 + 5 -> 5)."""
  try:
    values = np.asarray(x)
  except (OverflowError, TypeError, ValueError):
    values = np.asarray(x, dtype=object)
  if values.dtype.kind not in "iuO" or values.size == 0:
    return  # floats and other types: refused below with the dtype
  if values.dtype.kind == "O" and not all(isinstance(v, numbers.Integral) for v in values.flat):
    return
  low, high = int(values.min()), int(values.max())
  if low < -_INT32_LIMIT or high >= _INT32_LIMIT:
    raise ValueError(f"jaxflash.attention: {name} must fit in int32 (as jax.nn requires), "
                     f"got values from {low} to {high}")


# Integer dtypes whose every value int32 holds, so that casting keeps distinct ids distinct.
_NARROW_INTS = (jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16)


def _segment_id_array(x, name: str) -> jax.Array:
  """Segment ids as int32. Any integer dtype that int32 holds is cast; a wider one (int64 under
  x64, uint32) is taken when its values can be checked here (a NumPy array, a list, a JAX
  array that is not traced) and fit, since a wrapping cast could make two different ids
  equal. Floats and bools are refused: ids are compared for equality."""
  if isinstance(x, jax.core.Tracer):
    if x.dtype not in _NARROW_INTS and jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"jaxflash.attention: {name} must be int32 (or a narrower integer type) "
                      f"when traced, got {x.dtype}: a traced array's values cannot be checked "
                      f"to fit in int32; cast it with .astype(jnp.int32) if they do")
  elif isinstance(x, jax.Array):
    if x.dtype not in _NARROW_INTS:
      _check_int32_values(np.asarray(x), name)
  else:  # host values: checked before jnp.asarray could wrap them
    _check_int32_values(x, name)
  x = _as_array(x, name)
  if x.dtype == jnp.bool_ or not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"jaxflash.attention: {name} must be an integer array (int32; ids are "
                    f"compared for equality), got {x.dtype}")
  return x.astype(jnp.int32)


def _alibi_slopes(alibi_slopes, rank: int, B: int, N: int, batch_role, head_role):
  """alibi_slopes as the kernels take them (float32) and their layout: one slope per query head,
  (N,) or (B, N) for 4-D inputs, (N,) for 3-D ones, a scalar or (1,) for a single head.
  Concrete slopes must be finite (a NaN or inf slope would turn whole rows into NaN); traced
  ones cannot be checked."""
  if alibi_slopes is None:
    return None, None
  x = _as_array(alibi_slopes, "alibi_slopes")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"jaxflash.attention: alibi_slopes must be a floating-point array (float32, "
                    f"one slope per query head), got {x.dtype}")
  if rank == 4:
    allowed = {(N,): (head_role,), (B, N): (batch_role, head_role)}
    want = f"({N},) or ({B}, {N}) (heads, or batch and heads)"
  elif rank == 3:
    allowed, want = {(N,): (head_role,)}, f"({N},) (heads)"
  else:
    allowed, want = {(): (), (1,): ((),)}, "() or (1,) (a single head)"
  if x.shape not in allowed:
    raise ValueError(f"jaxflash.attention: alibi_slopes must have shape {want}, got "
                     f"{_shape_str(x)}")
  if not isinstance(x, jax.core.Tracer):
    values = np.asarray(x, np.float32)
    if not np.all(np.isfinite(values)):
      raise ValueError(f"jaxflash.attention: alibi_slopes must be finite, got "
                       f"{values[~np.isfinite(values)][:4].tolist()}")
  return x.astype(jnp.float32), tuple(zip(allowed[x.shape], x.shape))


def _window(local_window_size, is_causal) -> tuple[int, int]:
  left = right = UNBOUNDED
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
    # As jax.nn: windows are int32. A wider one also says no more than 2**31 - 1 would, since
    # the kernels take at most 2**31 positions, and keeps every position sum in int64.
    if left >= _INT32_LIMIT or right >= _INT32_LIMIT:
      raise ValueError(f"jaxflash.attention: local_window_size must be below 2**31 on both "
                       f"sides, got {local_window_size!r}")
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


def _soft_cap(logits_soft_cap) -> float:
  """logits_soft_cap as the kernels' float (0 for None)."""
  if logits_soft_cap is None:
    return 0.0
  if isinstance(logits_soft_cap, (bool, str, bytes)):
    raise TypeError(f"jaxflash.attention: logits_soft_cap must be None or a Python float, got "
                    f"{logits_soft_cap!r}")
  try:
    cap = float(logits_soft_cap)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(f"jaxflash.attention: logits_soft_cap must be None or a Python float (a "
                    f"static value, not a traced array), got {logits_soft_cap!r}") from e
  if not (np.isfinite(cap) and cap > 0.0):
    raise ValueError(f"jaxflash.attention: logits_soft_cap must be a finite float > 0 (or None "
                     f"for no cap), got {logits_soft_cap!r}")
  return cap


def _scale(scale, head_dim: int) -> tuple[float, jax.Array | None]:
  """scale as (the kernels' static scale, the traced scale or None).

  A Python or NumPy number, or an array that is not traced (a concrete jnp scalar), is a static
  value: the kernels take it as their attribute, as always. A traced scalar (a learned
  temperature under jit or grad) cannot be an attribute: the kernels read it from an operand
  (contract.Flag.SCALE_OPERAND; docs/DESIGN.md, "A traced scale")."""
  if scale is None:
    return float(1.0 / np.sqrt(head_dim)), None
  if isinstance(scale, (jax.Array, np.ndarray)):
    if scale.ndim != 0:
      raise ValueError(f"jaxflash.attention: scale must be a scalar (a float, or an array of "
                       f"shape ()), got an array of {_shape_str(scale)}")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
      raise TypeError(f"jaxflash.attention: scale must be a float or a floating-point scalar "
                      f"array (float32, float16, bfloat16, ...), got a {scale.dtype} array")
    if isinstance(scale, jax.core.Tracer):
      # Its value is unknown here, so it is not checked to be finite: a NaN or infinite
      # traced scale gives NaN outputs (README, the scale argument).
      return 1.0, scale  # the attribute is then unused
  try:
    value = float(scale)
  except (TypeError, ValueError) as e:
    raise TypeError(f"jaxflash.attention: scale must be a float or a floating-point scalar "
                    f"array, got {scale!r}") from e
  if not np.isfinite(value):
    raise ValueError(f"jaxflash.attention: scale must be finite, got {scale!r}")
  return value, None
