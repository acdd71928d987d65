"""The kernel primitives: one custom call per direction, on the arrays one device holds.

``jaxflash_fwd_kernel``: (q, k, v, bias, mask, q_lens, kv_lens, seed) -> (o, lse)
``jaxflash_bwd_kernel``: (q, k, v, bias, mask, q_lens, kv_lens, seed, lse, delta, d_o)
                         -> (dq, dk, dv, dbias, workspace)

Absent optional operands are zero-size arrays (flags say which are present);
``seed`` holds the dropout's uint32 seed words (jaxflash/dropout.py).
``workspace`` is the CUDA backward's scratch (uint8), sized here at abstract
evaluation by the native module so the handler never allocates.
Each primitive has an abstract evaluation and a lowering to the FFI target of
the platform (cuda/ffi/*_handlers). They are bound by the partitioning stage
(jaxflash/partitioning.py) with the config of one device's shard, after vmap
has been folded into the config by the batching rules of jaxflash/primitives.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import ffi
from jax.extend import core
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jaxflash import __version__, native
from jaxflash.layout import Layout, col_minor_order, packed_strides, shape_of

_native = native.load(__version__)

# Bits of AttentionParams::flags (cuda/params.h).
HAS_BIAS = 1 << 0
HAS_MASK = 1 << 1
HAS_Q_LENS = 1 << 2
HAS_KV_LENS = 1 << 3
BOTTOM_RIGHT = 1 << 4
HAS_DBIAS = 1 << 6
OUTPUT_F32 = 1 << 7
EXACT_F32 = 1 << 8  # float32 inputs: float32-accurate products (3xTF32 on CUDA), not tf32
DROPOUT = 1 << 9  # attention dropout on P, decided from the seed operand
UNBOUNDED = -1

FORWARD_INPUTS = ("q", "k", "v", "bias", "mask", "q_lens", "kv_lens", "seed")
BACKWARD_INPUTS = FORWARD_INPUTS + ("lse", "delta", "d_o")
FORWARD_RESULTS = ("o", "lse")
BACKWARD_RESULTS = ("dq", "dk", "dv", "dbias", "workspace")
# The slots whose ROW axis runs along the query positions; the other slots with a
# ROW axis (k, v, dk, dv) run along the key positions.
QUERY_ROW_SLOTS = ("q", "o", "lse", "d_o", "delta", "dq", "bias", "mask", "dbias")
# The CUDA kernels copy rows of these in contiguous chunks: their feature (COL)
# axis must be minor-most in memory.
COL_MINOR_SLOTS = ("q", "k", "v", "o", "d_o", "dq", "dk", "dv")
ABSENT_DTYPES = {"mask": jnp.bool_, "q_lens": jnp.int32, "kv_lens": jnp.int32, "seed": jnp.uint32}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Everything static about one attention call; hashable, so a primitive param.

  ``layouts`` maps each present operand/result slot to its layout; slots of
  absent operands are missing. ``window`` is (left, right) with UNBOUNDED for
  an open side; is_causal is a right window of 0. ``diagonal`` shifts the
  window's diagonal: query block row t sits ``diagonal`` positions after key
  block row t (ring attention's blocks of one sequence). ``keep_threshold`` and
  ``keep_scale`` are the dropout's (with the DROPOUT flag; jaxflash/dropout.py).
  """
  instance_sizes: tuple[int, ...]
  layouts: tuple[tuple[str, Layout], ...]
  seq_dims: tuple[int, int, int]  # T, S, H
  scale: float
  window: tuple[int, int]
  flags: int
  keep_threshold: int = 0
  keep_scale: float = 1.0
  diagonal: int = 0

  def layout(self, slot: str) -> Layout | None:
    return dict(self.layouts).get(slot)

  def has(self, flag: int) -> bool:
    return bool(self.flags & flag)

  def replace(self, **changes) -> KernelConfig:
    return dataclasses.replace(self, **changes)

  def with_layouts(self, updates: dict[str, Layout]) -> KernelConfig:
    merged = dict(self.layouts)
    merged.update(updates)
    return self.replace(layouts=tuple(sorted(merged.items())))

  def col_minor_orders(self) -> dict[str, tuple[int, ...]]:
    """Physical axis orders (major to minor) that put the feature axis of each
    COL_MINOR_SLOTS slot minor-most, for the slots where row-major does not."""
    orders = {}
    for slot in COL_MINOR_SLOTS:
      layout = self.layout(slot)
      order = col_minor_order(layout) if layout is not None else None
      if order is not None:
        orders[slot] = order
    return orders

  def ffi_attributes(self, orders: dict[str, tuple[int, ...]] | None = None) -> dict:
    """The FFI attributes; `orders`: physical axis orders of the non-row-major slots."""
    sizes, strides = packed_strides(self.instance_sizes, dict(self.layouts), orders)
    return dict(instance_sizes=sizes, strides=strides,
                dims=np.asarray(self.seq_dims, np.int64), scale=np.float32(self.scale),
                window_left=np.int64(self.window[0]), window_right=np.int64(self.window[1]),
                diagonal_offset=np.int64(self.diagonal),
                flags=np.int64(self.flags), keep_threshold=np.int64(self.keep_threshold),
                keep_scale=np.float32(self.keep_scale))


def absent(slot: str, dtype) -> jax.Array:
  """The zero-size placeholder for an absent optional operand."""
  return jnp.zeros((0,), ABSENT_DTYPES.get(slot, dtype))


# ---------------------------------------------------------------- primitives

DTYPE_CODES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.float16): 1,
               jnp.dtype(jnp.bfloat16): 2}  # jaxflash::DType


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
  o_dtype = jnp.float32 if config.has(OUTPUT_F32) else q.dtype
  return (result_aval(q, shape_of(config.layout("o")), o_dtype),
          result_aval(q, shape_of(config.layout("lse")), jnp.float32))


def gradient_avals(q, k, v, bias, config: KernelConfig):
  """(dq, dk, dv, dbias) of a backward with this config; dbias is zero-size without HAS_DBIAS."""
  dbias_shape = shape_of(config.layout("dbias")) if config.has(HAS_DBIAS) else (0,)
  return (result_aval(q, shape_of(config.layout("dq")), q.dtype),
          result_aval(q, shape_of(config.layout("dk")), k.dtype),
          result_aval(q, shape_of(config.layout("dv")), v.dtype),
          result_aval(q, dbias_shape, bias.dtype))


forward_kernel_p = core.Primitive("jaxflash_fwd_kernel")
forward_kernel_p.multiple_results = True
forward_kernel_p.def_abstract_eval(
    lambda q, *rest, config: forward_avals(q, config))


def _backward_kernel_abstract_eval(q, k, v, bias, *rest, config):
  del rest
  T, S, H = config.seq_dims
  workspace_bytes = _native.backward_workspace_bytes(
      math.prod(config.instance_sizes), T, S, H, DTYPE_CODES[jnp.dtype(q.dtype)])
  return gradient_avals(q, k, v, bias, config) + (
      result_aval(q, (workspace_bytes,), jnp.uint8),)


backward_kernel_p = core.Primitive("jaxflash_bwd_kernel")
backward_kernel_p.multiple_results = True
backward_kernel_p.def_abstract_eval(_backward_kernel_abstract_eval)


# ---------------------------------------------------------------- lowering

def _lowering(target: str):
  """Row-major operands and results (the CPU kernels take any strides)."""
  def rule(ctx, *args, config):
    return ffi.ffi_lowering(target)(ctx, *args, **config.ffi_attributes())
  return rule


def _cuda_lowering(target: str, inputs: Sequence[str], results: Sequence[str]):
  """Like _lowering, except that an operand or result whose feature axis is not minor-most
  (vmapped on an axis after the head dim) is given a physical layout with it minor-most, and
  its strides follow that layout: XLA then transposes it around the call, on CUDA only and
  only in that case (the batching rules stay copy-free on every platform)."""
  def rule(ctx, *args, config):
    orders = config.col_minor_orders()
    if not orders:
      return ffi.ffi_lowering(target)(ctx, *args, **config.ffi_attributes())
    # XLA's layouts are minor to major; None is the default (row-major).
    minor_to_major = lambda slot: tuple(reversed(orders[slot])) if slot in orders else None
    return ffi.ffi_lowering(target, operand_layouts=[minor_to_major(s) for s in inputs],
                            result_layouts=[minor_to_major(s) for s in results])(
                                ctx, *args, **config.ffi_attributes(orders))
  return rule


def register_lowerings(platform: str) -> None:
  """Registers the forward and backward lowerings for `platform` ("cpu" or "cuda")."""
  if platform == "cuda":
    forward_rule = _cuda_lowering("jaxflash_fwd", FORWARD_INPUTS, FORWARD_RESULTS)
    backward_rule = _cuda_lowering("jaxflash_bwd", BACKWARD_INPUTS, BACKWARD_RESULTS)
  else:
    forward_rule, backward_rule = _lowering("jaxflash_fwd"), _lowering("jaxflash_bwd")
  mlir.register_lowering(forward_kernel_p, forward_rule, platform=platform)
  mlir.register_lowering(backward_kernel_p, backward_rule, platform=platform)


def _register() -> tuple[str, ...]:
  """Registers the FFI targets and lowerings this build has; returns the platforms."""
  platforms = []
  for platform, xla_platform, targets in (("cpu", "cpu", _native.cpu_targets()),
                                          ("cuda", "CUDA", _native.cuda_targets())):
    if not targets:
      continue
    for name, capsule in targets.items():
      ffi.register_ffi_target(name, capsule, platform=xla_platform)
    register_lowerings(platform)
    platforms.append(platform)
  return tuple(platforms)


PLATFORMS = _register()
