"""The kernel primitives: one custom call per direction, on the arrays one device holds.

``jaxflash_fwd_kernel``: (q, k, v, bias, mask, q_lens, kv_lens, seed,
                          q_segment_ids, kv_segment_ids, alibi_slopes, scale)
                          -> (o, lse, workspace)
``jaxflash_bwd_kernel``: (q, k, v, bias, mask, q_lens, kv_lens, seed,
                          q_segment_ids, kv_segment_ids, alibi_slopes, scale, lse, delta,
                          d_o, dscale_centre, dalibi_centre)
                         -> (dq, dk, dv, dbias, dalibi, dscale, workspace)

lse is in base 2 (log2 of the sum of 2^(log2(e) logit)), as two floats per row, hi and
lo, whose sum is exact (cuda/params.h says why); jaxflash.attention hands its callers
hi ln 2, the natural log.
Absent optional operands are zero-size arrays (flags say which are present);
``seed`` holds the dropout's uint32 seed words (jaxflash/dropout.py), and with
Flag.DROPOUT_OFFSETS the place of the call's block in the whole problem (ring attention's calls:
ring.placed_seed); ``scale``
the float32 scale of a traced scale (Flag.SCALE_OPERAND), one per instance as the
ALiBi slopes are (under vmap, a per-item scale is batched like any operand). ``dalibi`` holds the
ALiBi slopes' gradient per key row of each query head (float32, laid out as delta with a row per
key: delta's instance axes, k's rows), centred on each query row's |E - t - offset| with E from
``dalibi_centre`` (with HAS_DALIBI, else zero-size: each query row's P-mean key position, float32,
laid out as delta; jaxflash/attention.py, _mean_keys), zero-size without HAS_DALIBI;
jaxflash/attention.py sums it over the rows and adds the centre's share back. ``dscale`` holds partial sums of a
traced scale's gradient (float32, laid out as dk without its features: a row per key), zero-size
without HAS_DSCALE; jaxflash/attention.py sums them whole. ``dscale_centre`` (with HAS_DSCALE,
else zero-size) is each query row's centre of that sum, its mean logit Σ P∘(q·kᵀ) (float32, laid
out as delta; jaxflash/attention.py, _dscale_centre).
``workspace`` is the CUDA kernels' scratch (uint8), sized here at abstract evaluation by
the native module so the handler never allocates: the backward's dQ accumulator and row
statistics, the persistent sm_90 forward's tile counter, both directions' per-tile segment-id
ranges (zero-size in a CPU-only build; the CPU kernels ignore it).
Each primitive has an abstract evaluation, a batching rule that folds the
vmapped axis into the kernel's instance space (no transpose or copy of the
operands: the axis becomes a stride), and a lowering to the FFI target of the
platform (cuda/ffi/*_handlers); on CUDA, whose kernels take one head dim, a value head dim
other than the query/key one is zero-padded to it around the call (call_with_one_head_dim).
They are bound by the partitioning stage
(jaxflash/partitioning.py) with the config of one device's shard, and by ring
attention (jaxflash/ring.py), which a shard_map user may vmap.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import ffi
from jax.extend import core
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jaxflash import __version__, native
from jaxflash.contract import (BACKWARD_INPUTS, BACKWARD_RESULTS, DTYPE_CODES, FORWARD_INPUTS,
                               CUDA_MAX_SEQLEN, FORWARD_RESULTS, Flag, KernelConfig)
from jaxflash.layout import COL, insert_axis, lse_layout, role_axis, shape_of, with_cols

_native = native.load(__version__)


def result_aval(q, shape, dtype) -> jax.core.ShapedArray:
  """A result's abstract value. Inside shard_map it varies over the manual mesh axes that the
  query does (ring attention calls the kernels there), so that its type checks."""
  mat = getattr(q, "manual_axis_type", None)
  if mat is None or not mat.varying:
    return jax.core.ShapedArray(shape, dtype)
  return q.update(shape=shape, dtype=dtype, weak_type=False,
                  sharding=NamedSharding(q.sharding.mesh, PartitionSpec()))


def forward_avals(q, config: KernelConfig):
  """(o, lse) of a forward with this config."""
  o_dtype = jnp.float32 if config.has(Flag.OUTPUT_F32) else q.dtype
  return (result_aval(q, shape_of(config.layout("o")), o_dtype),
          result_aval(q, shape_of(config.layout("lse")), jnp.float32))


def gradient_avals(q, k, v, bias, config: KernelConfig):
  """(dq, dk, dv, dbias, dalibi, dscale) of a backward with this config; dbias is zero-size
  without HAS_DBIAS, dalibi without HAS_DALIBI, dscale without HAS_DSCALE."""
  optional_shape = lambda slot, flag: shape_of(config.layout(slot)) if config.has(flag) else (0,)
  # With a scale operand, dq is the scaled query's, in float32 (Flag.SCALE_OPERAND).
  dq_dtype = jnp.float32 if config.has(Flag.SCALE_OPERAND) else q.dtype
  return (result_aval(q, shape_of(config.layout("dq")), dq_dtype),
          result_aval(q, shape_of(config.layout("dk")), k.dtype),
          result_aval(q, shape_of(config.layout("dv")), v.dtype),
          result_aval(q, optional_shape("dbias", Flag.HAS_DBIAS), bias.dtype),
          result_aval(q, optional_shape("dalibi", Flag.HAS_DALIBI), jnp.float32),
          result_aval(q, optional_shape("dscale", Flag.HAS_DSCALE), jnp.float32))


# ---------------------------------------------------------------- batching

def _new_instance_axis(config: KernelConfig, names: Sequence[str], args, dims):
  """The config with a new instance axis for vmap, inserted into each batched operand."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  axis = ((len(config.instance_sizes),), size)
  updates = {}
  for name, d in zip(names, dims):
    if d is None:
      continue
    if config.layout(name) is None:
      raise AssertionError(f"jaxflash internal: absent operand {name} is batched")
    updates[name] = insert_axis(config.layout(name), d, axis)
  config = config.replace(instance_sizes=config.instance_sizes + (size,))
  return config.with_layouts(updates), axis


def forward_batching_rule(primitive, extra_results: int):
  """The batching rule of a primitive that takes FORWARD_INPUTS and returns (o, lse) and
  `extra_results` unbatched results: one call of it, whatever the vmap nesting.
  jaxflash/primitives.py's forward shares it."""
  def rule(args, dims, *, config):
    config, axis = _new_instance_axis(config, FORWARD_INPUTS, args, dims)
    # The output follows q's layout (the vmapped axis where q has it, else in
    # front); lse has the output's rows and instance axes.
    o_dim = dims[0] if dims[0] is not None else 0
    o_layout = insert_axis(config.layout("o"), o_dim, axis)
    lse = lse_layout(o_layout)
    config = config.with_layouts({"o": o_layout, "lse": lse})
    return primitive.bind(*args, config=config), (o_dim, lse.index(axis)) + (None,) * extra_results
  return rule


def backward_batching_rule(primitive, extra_results: int):
  """The batching rule of a primitive that takes BACKWARD_INPUTS and returns (dq, dk, dv,
  dbias, dalibi, dscale) and `extra_results` unbatched results. jaxflash/primitives.py's
  backward shares it."""
  def rule(args, dims, *, config):
    config, axis = _new_instance_axis(config, BACKWARD_INPUTS, args, dims)
    # Every gradient is per vmapped instance, also for an operand that was not
    # batched (JAX sums those afterwards); each lands where its operand had the
    # vmapped axis, else in front.
    updates, out_dims = {}, []
    # dalibi has delta's instance axes (a row per key of each query head): it goes where delta
    # has the axis.
    # dscale is k's instances and rows: where k has the axis, or last if that is past k's
    # features (dscale has none).
    for grad, operand in (("dq", 0), ("dk", 1), ("dv", 2), ("dbias", 3),
                          ("dalibi", BACKWARD_INPUTS.index("delta")), ("dscale", 1)):
      layout = config.layout(grad)
      if layout is None:
        out_dims.append(None)
        continue
      d = min(dims[operand] if dims[operand] is not None else 0, len(layout))
      updates[grad] = insert_axis(layout, d, axis)
      out_dims.append(d)
    config = config.with_layouts(updates)
    return primitive.bind(*args, config=config), tuple(out_dims) + (None,) * extra_results
  return rule


# ---------------------------------------------------------------- primitives

def _workspace_aval(q, config: KernelConfig, bytes_of):
  """The uint8 scratch result, `bytes_of` the native module's size for this direction."""
  # Only the CUDA kernels have a workspace, and they take one head dim: a call with a value
  # head dim Hv other than H runs as a call of head dim max(H, Hv), which sizes its own
  # (call_with_one_head_dim); this one then goes unused.
  T, S, H, _ = config.seq_dims
  size = bytes_of(math.prod(config.instance_sizes), T, S, H, DTYPE_CODES[jnp.dtype(q.dtype).name],
                  config.has(Flag.HAS_SEGMENT_IDS))
  return result_aval(q, (size,), jnp.uint8)


def _forward_kernel_abstract_eval(q, *rest, config):
  del rest
  return forward_avals(q, config) + (_workspace_aval(q, config, _native.forward_workspace_bytes),)


forward_kernel_p = core.Primitive("jaxflash_fwd_kernel")
forward_kernel_p.multiple_results = True
forward_kernel_p.def_abstract_eval(_forward_kernel_abstract_eval)
batching.primitive_batchers[forward_kernel_p] = forward_batching_rule(
    forward_kernel_p, 1)  # the workspace


def _backward_kernel_abstract_eval(q, k, v, bias, *rest, config):
  del rest
  return gradient_avals(q, k, v, bias, config) + (
      _workspace_aval(q, config, _native.backward_workspace_bytes),)


backward_kernel_p = core.Primitive("jaxflash_bwd_kernel")
backward_kernel_p.multiple_results = True
backward_kernel_p.def_abstract_eval(_backward_kernel_abstract_eval)
batching.primitive_batchers[backward_kernel_p] = backward_batching_rule(
    backward_kernel_p, 1)  # the workspace


# ---------------------------------------------------------------- lowering

def _lowering(target: str):
  """Row-major operands and results (the CPU kernels take any strides)."""
  def rule(ctx, *args, config):
    return ffi.ffi_lowering(target)(ctx, *args, **config.ffi_attributes())
  return rule


def _check_cuda_call(config: KernelConfig) -> None:
  """What the CUDA kernels cannot run, refused when the call is lowered for a GPU rather than
  by the kernel at run time: sequences of 2**28 positions or more (positions are 32-bit,
  contract.CUDA_MAX_SEQLEN). A value head dim other than the query/key one is no refusal: the
  CUDA lowering runs it as a call of one head dim (call_with_one_head_dim)."""
  T, S = config.seq_dims[:2]
  for what, n in (("query sequence length (query.shape[-3])", T),
                  ("key/value sequence length (key.shape[-3])", S),
                  ("ring attention's block offset", abs(config.diagonal))):
    if n >= CUDA_MAX_SEQLEN:
      raise ValueError(
          f"jaxflash.attention: the {what} is {n}; the CUDA kernels take fewer than "
          f"2**28 = {CUDA_MAX_SEQLEN} positions (the CPU kernels take any length).")


def _cuda_lowering(target: str, inputs: Sequence[str], results: Sequence[str]):
  """Like _lowering, except that an operand or result whose feature axis is not minor-most
  (vmapped on an axis after the head dim) is given a physical layout with it minor-most, and
  its strides follow that layout: XLA then transposes it around the call, on CUDA only and
  only in that case (the batching rules stay copy-free on every platform)."""
  def rule(ctx, *args, config):
    _check_cuda_call(config)
    orders = config.col_minor_orders()
    if not orders:
      return ffi.ffi_lowering(target)(ctx, *args, **config.ffi_attributes())
    # XLA's layouts are minor to major; None is the default (row-major).
    minor_to_major = lambda slot: tuple(reversed(orders[slot])) if slot in orders else None
    return ffi.ffi_lowering(target, operand_layouts=[minor_to_major(s) for s in inputs],
                            result_layouts=[minor_to_major(s) for s in results])(
                                ctx, *args, **config.ffi_attributes(orders))
  return rule


# The slots whose COL axis is the head dim: H features for q, k, dq and dk, Hv for v, o, d_o and
# dv.
FEATURE_SLOTS = ("q", "k", "v", "o", "d_o", "dq", "dk", "dv")


def call_with_one_head_dim(bind, inputs: Sequence[str], results: Sequence[str], *args,
                           config: KernelConfig, workspace_bytes: int):
  """bind(*args, config=config) for a call whose value head dim Hv differs from its query/key
  head dim H, made as a call of one head dim D = max(H, Hv), for kernels that take only one
  (the CUDA kernels size every tile, and pick their instantiation, by it).

  `bind` binds a kernel primitive whose operands and results are named by `inputs` and
  `results` (FORWARD_INPUTS and FORWARD_RESULTS, or the BACKWARD_ ones). The narrower operands
  get zero features up to D, along the COL axis of their layout wherever that axis lies (vmap
  may put an axis after it): v and d_o when Hv < H, q and k when Hv > H. The wider results are
  sliced back to their own width: o and dv to Hv when Hv < H, dq and dk to H when Hv > H.

  Why the zeros change nothing: a zero column of v gives a zero column of o and of dv, and a
  zero column of v and d_o adds nothing to dO·Vᵀ (Δ = rowsum(dO∘O), an operand, is formed by
  the caller from the Hv real columns); a zero feature of q and k adds nothing to any logit
  q·k, so P, the lse, o and dv are the Hv ≠ H call's, and dq, dk get zero columns past H
  (dropped). The scale is the config's own (its `scale`, 1/sqrt(H) unless given, or the traced
  scale operand), never one derived from D. The uint8 workspace, scratch with undefined
  contents, is cut or zero-extended to `workspace_bytes`, the size the original call's abstract
  evaluation gave it (the D call sizes its own).

  What it costs: a zero-padded copy of each widened operand and a full-width copy of each
  sliced result, D/Hv (or D/H) times their memory and traffic, held for the call (for MLA's
  H = 192, Hv = 128: v and dO padded, o and dv sliced, each at 1.5 times its size), and the
  kernel's work at head dim D: for Hv < H the products with v (P·V, dO·Vᵀ, dV) run over H
  columns, for Hv > H those with q and k (Q·Kᵀ, dQ, dK) over Hv.
  """
  T, S, H, Hv = config.seq_dims
  D = max(H, Hv)
  wide = {slot: with_cols(config.layout(slot), D) for slot in FEATURE_SLOTS
          if config.layout(slot) is not None}
  one_dim = config.replace(seq_dims=(T, S, D, D)).with_layouts(wide)

  operands = []
  for slot, x in zip(inputs, args):
    if slot in wide and x.shape != shape_of(wide[slot]):
      padding = [(0, 0, 0)] * x.ndim
      col = role_axis(config.layout(slot), COL)
      padding[col] = (0, D - x.shape[col], 0)
      x = jax.lax.pad(x, jnp.zeros((), x.dtype), padding)
    operands.append(x)
  outs = []
  for slot, y in zip(results, bind(*operands, config=one_dim)):
    if slot in wide and y.shape != shape_of(config.layout(slot)):
      col = role_axis(config.layout(slot), COL)
      y = jax.lax.slice_in_dim(y, 0, config.layout(slot)[col][1], axis=col)
    elif slot == "workspace" and y.shape != (workspace_bytes,):
      y = (jax.lax.slice(y, (0,), (workspace_bytes,)) if y.shape[0] > workspace_bytes else
           jax.lax.pad(y, jnp.zeros((), y.dtype), [(0, workspace_bytes - y.shape[0], 0)]))
    outs.append(y)
  return outs


def _with_one_head_dim(primitive, inputs: Sequence[str], results: Sequence[str], rule):
  """The lowering `rule` of kernels that take one head dim, extended to a call whose value head
  dim differs from the query/key one: that call is lowered as call_with_one_head_dim (traced
  and lowered in its place: zero padding, one call of one head dim lowered by `rule`, slices).
  Only the lowering changes: abstract evaluation, batching and partitioning see the call as it
  is, and the other platforms' kernels take both head dims natively."""
  def lowering(ctx, *args, config):
    _, _, H, Hv = config.seq_dims
    if Hv == H:
      return rule(ctx, *args, config=config)
    workspace = ctx.avals_out[results.index("workspace")]
    one_dim_call = functools.partial(call_with_one_head_dim, primitive.bind, inputs, results,
                                     workspace_bytes=workspace.shape[0])
    return mlir.lower_fun(one_dim_call, multiple_results=True)(ctx, *args, config=config)
  return lowering


def register_lowerings(platform: str, one_head_dim: bool | None = None) -> None:
  """Registers the forward and backward lowerings for `platform` ("cpu" or "cuda").

  `one_head_dim`: lower a call whose value head dim differs from the query/key one as a call of
  one head dim (call_with_one_head_dim); None, the default, does so for "cuda" only, whose
  kernels need it (the CPU kernels take both head dims). The tests set it for "cpu" to run that
  path on the CPU kernels."""
  if platform == "cuda":
    forward_rule = _cuda_lowering("jaxflash_fwd", FORWARD_INPUTS, FORWARD_RESULTS)
    backward_rule = _cuda_lowering("jaxflash_bwd", BACKWARD_INPUTS, BACKWARD_RESULTS)
  else:
    forward_rule, backward_rule = _lowering("jaxflash_fwd"), _lowering("jaxflash_bwd")
  if one_head_dim is None:
    one_head_dim = platform == "cuda"
  if one_head_dim:
    forward_rule = _with_one_head_dim(forward_kernel_p, FORWARD_INPUTS, FORWARD_RESULTS,
                                      forward_rule)
    backward_rule = _with_one_head_dim(backward_kernel_p, BACKWARD_INPUTS, BACKWARD_RESULTS,
                                       backward_rule)
  mlir.register_lowering(forward_kernel_p, forward_rule, platform=platform)
  mlir.register_lowering(backward_kernel_p, backward_rule, platform=platform)


def _not_built(platform: str):
  """The lowering on a platform this build has no kernels for: a clear error at trace time
  instead of JAX's "MLIR translation rule not found"."""
  def rule(ctx, *args, config):
    raise NotImplementedError(
        f"jaxflash: this build has no {platform.upper()} kernels (it was built without them, "
        f"e.g. on a machine with no GPU visible); reinstall with JAXFLASH_CUDA=ON pip install . "
        f"(or JAXFLASH_CUDA_ARCHITECTURES=90a, say), or run on the CPU (JAX_PLATFORMS=cpu)")
  return rule


def _register() -> tuple[str, ...]:
  """Registers the FFI targets and lowerings this build has; returns the platforms."""
  platforms = []
  for platform, xla_platform, targets in (("cpu", "cpu", _native.cpu_targets()),
                                          ("cuda", "CUDA", _native.cuda_targets())):
    if not targets:
      mlir.register_lowering(forward_kernel_p, _not_built(platform), platform=platform)
      mlir.register_lowering(backward_kernel_p, _not_built(platform), platform=platform)
      continue
    for name, capsule in targets.items():
      ffi.register_ffi_target(name, capsule, platform=xla_platform)
    register_lowerings(platform)
    platforms.append(platform)
  return tuple(platforms)


PLATFORMS = _register()


def build_info() -> dict:
  """What the loaded extension is: the jaxflash version it was built from, the CUDA
  architectures it has kernels for ("" in a CPU-only build), how its CPU kernels were built and
  which of their instruction-set clones this CPU runs, the XLA FFI API version of the headers
  it was built against, and the platforms it has kernels for (jaxflash.backends())."""
  return dict(version=_native.version, cuda_architectures=_native.cuda_architectures,
              cpu_instruction_sets=_native.cpu_instruction_sets,
              ffi_api_version=tuple(_native.ffi_api_version), platforms=PLATFORMS)
