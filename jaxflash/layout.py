"""How each kernel operand's axes map onto the kernel's index space.

The kernels index every array as ``[instance..., row, col]``: the *instance*
axes are the batch-like ones (batch, kv-head, query group, and any axis that
``jax.vmap`` adds), ``row`` is the sequence position and ``col`` the feature
(or, for bias and mask, the key position). An array's :data:`Layout` names the
role of each of its axes, with the axis size. Strides are derived from the
layout, so an axis that vmap inserts anywhere becomes a stride rather than a
transpose, and an operand that does not vary along an instance axis (K/V shared
by a GQA group, a bias without a batch axis, an unbatched operand under vmap)
simply has stride 0 there.
"""

from __future__ import annotations

import math
from typing import Sequence

ROW = "row"
COL = "col"

# An axis role: ROW, COL, or the instance axes (outer to inner) that the array
# axis flattens, row-major. An axis of size 1 is broadcast whatever its role.
Role = str | tuple[int, ...]
Axis = tuple[Role, int]  # (role, size)
Layout = tuple[Axis, ...]


def shape_of(layout: Layout) -> tuple[int, ...]:
  return tuple(size for _, size in layout)


def insert_axis(layout: Layout, position: int, axis: Axis) -> Layout:
  return layout[:position] + (axis,) + layout[position:]


def role_axis(layout: Layout, role: str) -> int:
  """The position of the ROW or COL axis."""
  return next(i for i, (r, _) in enumerate(layout) if r == role)


def with_rows(layout: Layout, rows: int) -> Layout:
  """The layout with its ROW axis resized to `rows` (a block of the sequence)."""
  return tuple((role, rows if role == ROW else size) for role, size in layout)


def with_cols(layout: Layout, cols: int) -> Layout:
  """The layout with its COL axis resized to `cols` (another head dim)."""
  return tuple((role, cols if role == COL else size) for role, size in layout)


def drop_col(layout: Layout) -> Layout:
  return tuple(axis for axis in layout if axis[0] != COL)


def lse_layout(o_layout: Layout) -> Layout:
  """The kernels' lse for an output laid out as `o_layout`: its rows, and as the COL axis
  (last) the lse's two floats, hi and lo (cuda/params.h says why two)."""
  return drop_col(o_layout) + ((COL, 2),)


def col_minor_order(layout: Layout) -> tuple[int, ...] | None:
  """A physical axis order (major to minor) in which the COL axis is minor-most.

  None when the row-major layout already gives COL a unit stride (or the array
  has no COL axis, or COL has size 1); otherwise the axes in their logical
  order with COL moved last. The CUDA lowering asks XLA for that order for the
  operands whose rows the kernels copy in contiguous chunks.
  """
  cols = [i for i, (role, _) in enumerate(layout) if role == COL]
  if not cols:
    return None
  c = cols[0]
  if layout[c][1] == 1 or all(size == 1 for _, size in layout[c + 1:]):
    return None
  return tuple(i for i in range(len(layout)) if i != c) + (c,)


def strides_of(layout: Layout, instance_sizes: Sequence[int],
               order: Sequence[int] | None = None) -> tuple[list[int], int, int]:
  """Element strides of a dense array with this layout.

  `order` is the physical order of the array's axes, major to minor (None:
  row-major, i.e. 0, 1, ..., n-1). Returns (instance strides, row stride,
  col stride); 0 where the array does not vary along that axis.
  """
  if order is None:
    order = range(len(layout))
  elif sorted(order) != list(range(len(layout))):
    raise AssertionError(f"jaxflash internal: {tuple(order)} is not an order of {len(layout)} axes")
  inst = [0] * len(instance_sizes)
  row = col = 0
  stride = 1
  for role, size in (layout[a] for a in reversed(order)):
    if size != 1:
      if role == ROW:
        row = stride
      elif role == COL:
        col = stride
      else:
        expected = math.prod(instance_sizes[i] for i in role)
        if size != expected:
          raise AssertionError(f"jaxflash internal: axis of size {size} flattens instance axes "
                               f"{role} of total size {expected}")
        inner = stride
        for i in reversed(role):
          inst[i] = inner
          inner *= instance_sizes[i]
    stride *= size
  return inst, row, col


def merged_strides(instance_sizes: Sequence[int], layouts: dict[str, Layout],
                   orders: dict[str, Sequence[int]] | None = None
                   ) -> tuple[list[int], dict[str, list[int]]]:
  """The instance axes the kernels walk, and each layout's strides over them.

  `orders` gives the physical axis order (major to minor) of the arrays that are
  not row-major (see col_minor_order). Instance axes of size 1 are dropped and
  neighbours that every array walks contiguously are merged, so the kernels
  see as few axes as possible (at least one, since XLA's attribute decoding
  wants non-empty arrays). Returns (the merged instance sizes, per layout its
  instance strides followed by its row and col strides).
  """
  orders = orders or {}
  per_slot = {name: strides_of(layout, instance_sizes, orders.get(name))
              for name, layout in layouts.items()}
  sizes = list(instance_sizes)
  inst = {name: list(s[0]) for name, s in per_slot.items()}

  keep = [d for d, n in enumerate(sizes) if n != 1]
  sizes = [sizes[d] for d in keep]
  inst = {name: [st[d] for d in keep] for name, st in inst.items()}
  d = 0
  while d + 1 < len(sizes):
    if all(st[d] == st[d + 1] * sizes[d + 1] for st in inst.values()):
      sizes[d] *= sizes[d + 1]
      del sizes[d + 1]
      for st in inst.values():
        st[d] = st[d + 1]
        del st[d + 1]
    else:
      d += 1
  if not sizes:
    sizes = [1]
    inst = {name: [0] for name in inst}
  return sizes, {name: inst[name] + [row, col] for name, (_, row, col) in per_slot.items()}
