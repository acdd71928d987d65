"""What Python and the native kernels agree on: the one Python home of the C++ contract.

The FFI handlers (cuda/ffi/decode.h) decode each custom call into the
AttentionParams of cuda/params.h. Everything that decoding reads is defined
here: the flag bits, the window's unbounded sentinel, the dtype codes, the
order of the operand slots in the ``strides`` attribute and the most instance
axes it takes, the kernels' operands and results in call order, the
placeholders of absent operands, and the :class:`KernelConfig` that becomes the
call's attributes. The extension reports its side of the constants
(``jaxflash._native.contract()``) and tests/test_contract.py holds the two equal.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.layout import Layout, col_minor_order, merged_strides


class Flag(enum.IntFlag):
  """Bits of AttentionParams::flags (enum Flags in cuda/params.h)."""
  HAS_BIAS = 1 << 0
  HAS_MASK = 1 << 1
  HAS_Q_LENS = 1 << 2
  HAS_KV_LENS = 1 << 3
  BOTTOM_RIGHT = 1 << 4  # the causal/window diagonal ends at the last query and key
  HAS_DBIAS = 1 << 6  # backward: write dbias
  OUTPUT_F32 = 1 << 7  # forward: o in float32 whatever the dtype (the backward's residual)
  EXACT_F32 = 1 << 8  # float32 inputs: float32-accurate products (3xTF32 on CUDA), not tf32
  DROPOUT = 1 << 9  # attention dropout on P, decided from the seed operand
  HAS_SEGMENT_IDS = 1 << 10  # q_segment_ids and kv_segment_ids: a key is seen from equal ids only
  HAS_ALIBI = 1 << 11  # alibi_slopes: the logits get -slope * |distance to the diagonal|
  # backward: write dalibi, the slopes' gradient per key row of each query head, centred on the
  # dalibi_centre operand's rows
  HAS_DALIBI = 1 << 12
  # The scale is the scale operand's value (a traced scale: one float32 per instance, like the
  # ALiBi slopes), not the attribute; the backward then writes dq in float32 and without the
  # scale factor: the gradient of the scaled query scale·q.
  SCALE_OPERAND = 1 << 13
  # backward: write dscale, the scale operand's gradient per key row, centred on the
  # dscale_centre operand's rows
  HAS_DSCALE = 1 << 14
  # The seed operand's words 2 and 3 are the place of the call's block in the whole problem (the
  # sequence positions of its first query and key), which the dropout's hash adds to its own:
  # ring attention's blocks drop the entries the unsharded call drops (cuda/dropout.h).
  DROPOUT_OFFSETS = 1 << 15


UNBOUNDED = -1  # kUnbounded: an open side of the attention window

# jaxflash::DType, by dtype name.
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

# The operand slots of the "strides" attribute, in the order of enum Slot (decode.h).
SLOTS = ("q", "k", "v", "bias", "mask", "q_lens", "kv_lens", "o", "lse",
         "d_o", "delta", "dq", "dk", "dv", "dbias", "seed", "q_segment_ids", "kv_segment_ids",
         "alibi_slopes", "dalibi", "scale", "dscale", "dscale_centre", "dalibi_centre")

# kMaxInstanceDims. Python merges what it can before lowering; nested vmaps may still need a few.
MAX_INSTANCE_DIMS = 8

# kCudaMaxSeqLen: the CUDA kernels' positions are 32-bit, so T, S and |diagonal| stay below it
# (kernels.py checks when it lowers for CUDA).
CUDA_MAX_SEQLEN = 2**28

# kDropoutResolution: dropout decides each entry from 16 bits of a hash (dropout.py).
DROPOUT_RESOLUTION = 2**16

# The kernel primitives' operands and results, in the order the FFI handlers bind them.
FORWARD_INPUTS = ("q", "k", "v", "bias", "mask", "q_lens", "kv_lens", "seed", "q_segment_ids",
                  "kv_segment_ids", "alibi_slopes", "scale")
# The optional ones, which absent placeholders stand in for (jaxflash/attention.py binds them).
OPTIONAL_INPUTS = FORWARD_INPUTS[3:]
# dscale_centre: with HAS_DSCALE, each query row's centre of dscale's sum, its mean logit
# E = Σ P∘(q·kᵀ) (under a soft-cap times the cap's slope at E; float32, laid out as delta:
# jaxflash/attention.py, _dscale_centre); a zero-size placeholder otherwise. dalibi_centre: with
# HAS_DALIBI, each query row's P-mean key position E = Σ P·s, from which the kernels centre
# dalibi's sum on |E - t - offset| (float32, laid out as delta: jaxflash/attention.py,
# _mean_keys); zero-size otherwise.
BACKWARD_INPUTS = FORWARD_INPUTS + ("lse", "delta", "d_o", "dscale_centre", "dalibi_centre")
FORWARD_RESULTS = ("o", "lse", "workspace")
# dalibi: per key row of each query head (delta's instance axes, a row per key), that key's share
# of the ALiBi slope's gradient; dscale: laid out as dk without its features, partial sums of a
# traced scale's gradient (cuda/params.h).
BACKWARD_RESULTS = ("dq", "dk", "dv", "dbias", "dalibi", "dscale", "workspace")

# The slots whose ROW axis runs along the query positions; the other slots with a
# ROW axis (k, v, dk, dv, kv_segment_ids, dalibi, dscale) run along the key positions
# (view_extent in decode.h).
QUERY_ROW_SLOTS = ("q", "o", "lse", "d_o", "delta", "dq", "bias", "mask", "dbias",
                   "q_segment_ids", "dscale_centre", "dalibi_centre")
# The CUDA kernels copy rows of these in contiguous chunks: their feature (COL)
# axis must be minor-most in memory.
COL_MINOR_SLOTS = ("q", "k", "v", "o", "d_o", "dq", "dk", "dv")
# The element types the handlers expect of the optional operands that are not in the
# query's dtype (XLA's PRED, S32, U32); an absent one is a zero-size array.
ABSENT_DTYPES = {"mask": jnp.bool_, "q_lens": jnp.int32, "kv_lens": jnp.int32, "seed": jnp.uint32,
                 "q_segment_ids": jnp.int32, "kv_segment_ids": jnp.int32,
                 "alibi_slopes": jnp.float32, "scale": jnp.float32,
                 "dscale_centre": jnp.float32, "dalibi_centre": jnp.float32}


def absent(slot: str, dtype) -> jax.Array:
  """The zero-size placeholder for an absent optional operand."""
  return jnp.zeros((0,), ABSENT_DTYPES.get(slot, dtype))


def packed_strides(instance_sizes: Sequence[int], layouts: dict[str, Layout],
                   orders: dict[str, Sequence[int]] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
  """The FFI attributes ``instance_sizes`` and ``strides`` for these layouts.

  ``strides`` holds one row (instance strides..., row stride, col stride) per
  SLOTS entry, over the instance axes that layout.merged_strides leaves; an
  absent slot's row is zeros. `orders`: as for merged_strides.
  """
  sizes, rows = merged_strides(instance_sizes, layouts, orders)
  if len(sizes) > MAX_INSTANCE_DIMS:
    raise NotImplementedError(
        f"jaxflash: this call needs {len(sizes)} batch-like axes after merging (nested vmap?); "
        f"the kernels take at most {MAX_INSTANCE_DIMS}")
  absent_row = [0] * (len(sizes) + 2)
  packed = [rows.get(slot, absent_row) for slot in SLOTS]
  return np.asarray(sizes, np.int64), np.asarray(packed, np.int64).reshape(-1)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Everything static about one attention call; hashable, so a primitive param.

  ``layouts`` maps each present operand/result slot to its layout; slots of
  absent operands are missing. ``window`` is (left, right) with UNBOUNDED for
  an open side; is_causal is a right window of 0. ``diagonal`` shifts the
  window's diagonal: query block row t sits ``diagonal`` positions after key
  block row t (ring attention's blocks of one sequence). ``keep_threshold`` and
  ``keep_scale`` are the dropout's (with Flag.DROPOUT; jaxflash/dropout.py). ``softcap``
  is logits_soft_cap (0: none).
  """
  instance_sizes: tuple[int, ...]
  layouts: tuple[tuple[str, Layout], ...]
  seq_dims: tuple[int, int, int, int]  # T, S, H (q, k), Hv (v, o)
  scale: float
  window: tuple[int, int]
  flags: int
  keep_threshold: int = 0
  keep_scale: float = 1.0
  diagonal: int = 0
  softcap: float = 0.0  # logits_soft_cap, 0 for none

  def layout(self, slot: str) -> Layout | None:
    return dict(self.layouts).get(slot)

  def has(self, flag: Flag) -> bool:
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
    """The FFI attributes (LayoutAttrs in decode.h); `orders`: physical axis orders of the
    non-row-major slots."""
    sizes, strides = packed_strides(self.instance_sizes, dict(self.layouts), orders)
    return dict(instance_sizes=sizes, strides=strides,
                dims=np.asarray(self.seq_dims, np.int64), scale=np.float32(self.scale),
                window_left=np.int64(self.window[0]), window_right=np.int64(self.window[1]),
                diagonal_offset=np.int64(self.diagonal),
                flags=np.int64(self.flags), keep_threshold=np.int64(self.keep_threshold),
                keep_scale=np.float32(self.keep_scale), softcap=np.float32(self.softcap))
