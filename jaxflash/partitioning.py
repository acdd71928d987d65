"""How a jaxflash call splits over the devices its operands are sharded on.

The forward and backward primitives (jaxflash/primitives.py) lower through
``jax.experimental.custom_partitioning``: XLA's partitioner (Shardy, or GSPMD
where JAX still uses it) sees one op with a sharding rule, decides how its
operands are sharded, and asks the partition callbacks here for the program one
device runs: the kernel primitives (jaxflash/kernels.py) on the device's shard,
with a config whose sizes are the shard's.

The rule is written in *factors*, named from the config's layouts:

  i0, i1, ...  the instance axes (batch, kv head, query group, vmapped axes);
               k's head axis is the kv head
  n            q's head axis when it flattens two of them (kv head, group: GQA
               with more than one kv head); otherwise q's heads are that one factor
  t, s         the query and key sequence positions
  h, hv        the features (head dims) of q and k, and of v and o (jax.nn has them equal;
               jaxflash's CPU kernels take them different)

An instance factor may be sharded on any mesh axes that divide it: each device
runs its own batch items and heads, and nothing is communicated except a psum
of a gradient whose operand does not carry a sharded factor (dk and dv of a
query group split over devices; dbias of a bias broadcast over a sharded batch
or head axis). q's heads split over more devices than a whole number of kv heads
per device (K = 2 kv heads over 4 devices) take K/V replicated: each device
reads the kv heads its query heads need from its copy, and psums its partial
dk and dv (Plan.head_axes). t and s are sharded together, on the mesh axes of
q's (else k's) sequence, when ring attention (jaxflash/ring.py) can compute the
call (with dropout: when the key blocks start where the mask's hash pairs keys, at multiples
of 16 positions); otherwise they stay replicated, as h and hv always do, and XLA gathers a
sequence- or feature-sharded operand before the call.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxflash import kernels
from jaxflash import ring as ring_lib
from jaxflash.contract import (BACKWARD_INPUTS, BACKWARD_RESULTS, FORWARD_INPUTS, FORWARD_RESULTS,
                               OPTIONAL_INPUTS, QUERY_ROW_SLOTS, Flag, KernelConfig, absent)
from jaxflash.layout import COL, ROW, Axis, role_axis

# The kernels' workspaces stay inside the partition.
OUTPUTS = FORWARD_RESULTS[:-1]
GRADIENTS = BACKWARD_RESULTS[:-1]

# The factor of each slot's COL axis (the seed's COL axis, its two words, has none: never
# sharded); a ROW axis is t for QUERY_ROW_SLOTS, else s.
COL_FACTOR = {**dict.fromkeys(("q", "k", "dq", "dk"), "h"),
              **dict.fromkeys(("v", "o", "d_o", "dv"), "hv"),
              **dict.fromkeys(("bias", "mask", "dbias"), "s")}
SEQUENCE_FACTORS = ("t", "s")  # sharded together, by ring attention
REPLICATED_FACTORS = ("h", "hv")
QUERY_HEADS = "n"  # the rule's one factor for a head axis of two factors (q's: kv head, group)

MeshAxes = tuple[str, ...]


def _instance_factor(i: int) -> str:
  return f"i{i}"


def axis_factors(config: KernelConfig, slot: str, axis: Axis) -> tuple[str, ...]:
  """The factors an array axis spans, major first; () for an axis that is never sharded
  (size 1, i.e. broadcast, or the seed's words)."""
  role, size = axis
  if size == 1:
    return ()
  if role == ROW:
    return ("t" if slot in QUERY_ROW_SLOTS else "s",)
  if role == COL:
    return (COL_FACTOR[slot],) if slot in COL_FACTOR else ()
  return tuple(_instance_factor(i) for i in role if config.instance_sizes[i] != 1)


def query_head_factors(config: KernelConfig) -> tuple[str, ...]:
  """The factors (kv head, group) of q's head axis under GQA with several kv heads; () when
  q's heads are one factor (the kv heads, or the group) or there is no head axis."""
  for axis in config.layout("q"):
    factors = axis_factors(config, "q", axis)
    if len(factors) > 1:
      return factors
  return ()


def factor_sizes(config: KernelConfig) -> dict[str, int]:
  T, S, H, Hv = config.seq_dims
  sizes = {_instance_factor(i): n for i, n in enumerate(config.instance_sizes)}
  sizes.update(t=T, s=S, h=H, hv=Hv)
  return sizes


# ---------------------------------------------------------------- the Shardy rule

def _sharding_rule(slots: Sequence[str], results: Sequence[str]):
  def rule(config: KernelConfig, mesh, operand_types, result_types) -> SdyShardingRule:
    del mesh, operand_types, result_types
    unique = (f"u{n}" for n in range(10**6))  # a factor of its own: an axis never sharded
    order = []  # the factors, in order of first appearance

    def factor(slot: str, axis: Axis) -> str:
      factors = axis_factors(config, slot, axis)
      # q's heads (kv head, group) are one factor, not a CompoundFactor of the two: Shardy
      # shards a compound over a mesh axis that splits inside the kv heads (4 devices, 2 kv
      # heads) with the kv head on a sub-axis, which k then gets too, and custom_partitioning
      # cannot hand the partition callback a sub-axis (IndivisibleError). So Shardy gives k
      # and v's gradients k's and v's own sharding, q-like arrays q's, and the Plan relates
      # q's heads to k's.
      name = QUERY_HEADS if len(factors) > 1 else factors[0] if factors else next(unique)
      if name not in order:
        order.append(name)
      return name

    def mapping(slot: str) -> ArrayMapping:
      layout = config.layout(slot)
      if layout is None:  # an absent operand: a zero-size placeholder
        return ArrayMapping(next(unique))
      return ArrayMapping(*(factor(slot, axis) for axis in layout))

    operands = tuple(mapping(slot) for slot in slots)
    outputs = tuple(mapping(slot) for slot in results)
    return SdyShardingRule(
        operands, outputs,  # Shardy wants the special factors in the rule's order
        need_replication_factors=tuple(f for f in order if f in REPLICATED_FACTORS))
  return rule


# ---------------------------------------------------------------- the partition

def _spec(shape) -> tuple[MeshAxes, ...]:
  """The mesh axes of each dim of an operand (() where it is not sharded)."""
  sharding = getattr(shape, "sharding", None)
  spec = sharding.spec if isinstance(sharding, NamedSharding) else ()
  spec = tuple(spec) + (None,) * (len(shape.shape) - len(spec))
  return tuple(() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec)


class Plan:
  """Which mesh axes shard each factor, and what follows: the operands' and results'
  shardings, the config of one device's shard, the kv heads a device reads, and the psums of
  partial gradients."""

  def __init__(self, config: KernelConfig, mesh, slots: Sequence[str], arg_shapes):
    self.config, self.mesh = config, mesh
    self.sizes = factor_sizes(config)
    self.axes: dict[str, MeshAxes] = {}
    self.query_head_factors = query_head_factors(config)
    # The mesh axes q's head axis is split on as one flat axis, when no split of (kv head,
    # group) fits them (_adopt); () otherwise.
    self.head_axes: MeshAxes = ()
    if not mesh.empty:
      specs = {slot: _spec(shape) for slot, shape in zip(slots, arg_shapes)}
      # q first: the output keeps q's sharding, and k and v follow q's heads, not q theirs.
      for slot, layout in sorted(config.layouts, key=lambda item: item[0] != "q"):
        if slot in specs:
          for axis, mesh_axes in zip(layout, specs[slot]):
            self._adopt(axis_factors(config, slot, axis), mesh_axes)
      self._drop_unrepresentable()
      self._adopt_ring(specs)

  def _adopt_ring(self, specs) -> None:
    """Shards t and s together (ring attention) on the mesh axes of q's sequence, else of k's,
    if ring attention can compute the call on them; otherwise XLA gathers the sequence."""
    for slot in ("q", "k"):
      mesh_axes = specs[slot][role_axis(self.config.layout(slot), ROW)]
      if mesh_axes:
        break
    else:
      return
    n = self._mesh_size(mesh_axes)
    T, S = self.config.seq_dims[:2]
    if (ring_lib.unsupported(self.config) is None and T % n == 0 and S % n == 0 and
        self._free(mesh_axes) and self._ring_order(n) is not None):
      self.axes.update(t=mesh_axes, s=mesh_axes)

  def _ring_order(self, n: int) -> ring_lib.Order | None:
    """The order of a ring of n devices: zig-zag balances causal attention (a window balances
    itself) where each block splits into two chunks; with dropout, only an order whose key
    pieces start where the mask's pairs do (ring_lib.dropout_misaligned). None if none fits."""
    T, S, *head_dims = self.config.seq_dims
    local = self.config.replace(seq_dims=(T // n, S // n, *head_dims))
    orders = ("zigzag",) if self.config.window == ring_lib.CAUSAL and T % (2 * n) == 0 else ()
    return next((order for order in orders + ("contiguous",)
                 if ring_lib.dropout_misaligned(local, order) is None), None)

  @property
  def ring(self) -> ring_lib.Ring | None:
    """The ring of a sequence-sharded call, over the local blocks; None if not sharded."""
    axes = self.axes.get("t")
    if not axes:
      return None
    return ring_lib.Ring(self.local_config(), axes if len(axes) > 1 else axes[0],
                         self._ring_order(self._mesh_size(axes)))

  def _mesh_size(self, mesh_axes: MeshAxes) -> int:
    return math.prod(self.mesh.shape[a] for a in mesh_axes)

  def _free(self, mesh_axes: MeshAxes) -> bool:
    """Whether no factor is sharded on any of these mesh axes yet."""
    taken = {a for axes in (*self.axes.values(), self.head_axes) for a in axes}
    return taken.isdisjoint(mesh_axes)

  def _adopt(self, factors: tuple[str, ...], mesh_axes: MeshAxes) -> None:
    """Takes an operand dim's sharding for its factors, if they are free to shard and its mesh
    axes split over them as a contiguous chunking does: each factor but the last to get axes is
    sharded whole (one element per shard), the last one evenly. q's heads that no such split
    fits (2 kv heads over a mesh axis of 4) are split flat, if the mesh axes divide them."""
    if (not factors or not mesh_axes or any(f in self.axes for f in factors) or
        (self.head_axes and not set(factors).isdisjoint(self.query_head_factors)) or
        any(f in REPLICATED_FACTORS + SEQUENCE_FACTORS for f in factors) or
        not self._free(mesh_axes)):
      return
    split, rest = {}, list(mesh_axes)
    for f in factors:
      if not rest:
        break
      got: list[str] = []
      while rest and self.sizes[f] % (self._mesh_size(tuple(got)) * self.mesh.shape[rest[0]]) == 0:
        got.append(rest.pop(0))
      split[f] = tuple(got)
      if self._mesh_size(tuple(got)) != self.sizes[f]:
        break
    if not rest:
      self.axes.update({f: a for f, a in split.items() if a})
    elif (factors == self.query_head_factors and
          math.prod(self.sizes[f] for f in factors) % self._mesh_size(mesh_axes) == 0):
      self.head_axes = mesh_axes

  def _drop_unrepresentable(self) -> None:
    """A compound dim (q's heads: kv head, group) is one contiguous chunk per device only if
    each of its factors before a sharded one is sharded whole; unshard the later ones if not."""
    changed = True
    while changed:
      changed = False
      for slot, layout in self.config.layouts:
        for axis in layout:
          factors = axis_factors(self.config, slot, axis)
          for j, f in enumerate(factors[:-1]):
            if self._mesh_size(self.axes.get(f, ())) != self.sizes[f]:
              for later in factors[j + 1:]:
                changed |= self.axes.pop(later, None) is not None
              break

  def dim_axes(self, slot: str, axis: Axis) -> MeshAxes:
    factors = axis_factors(self.config, slot, axis)
    if self.head_axes and factors == self.query_head_factors:
      return self.head_axes
    return sum((self.axes.get(f, ()) for f in factors), ())

  def sharding(self, slot: str) -> NamedSharding:
    layout = self.config.layout(slot)
    if layout is None:
      return NamedSharding(self.mesh, PartitionSpec())
    spec = [self.dim_axes(slot, axis) or None for axis in layout]
    return NamedSharding(self.mesh, PartitionSpec(*spec))

  def _local_sizes(self) -> dict[str, int]:
    """Each instance factor's size on one device.

    With q's heads split flat, a device holds `heads` contiguous query heads. Cut into blocks
    of g = gcd(heads, G) (G: the group size), each block starts at a multiple of g, which
    divides G, so it lies within one kv head's group: the device runs heads / g kv heads (one
    per block, a kv head repeated where blocks share it) of g query heads each. That is one kv
    head when the kv heads divide the devices (g = heads); repeats only when neither of K and
    the device count divides the other."""
    local = {_instance_factor(i): n // self._mesh_size(self.axes.get(_instance_factor(i), ()))
             for i, n in enumerate(self.config.instance_sizes)}
    if self.head_axes:
      kv_head, group = self.query_head_factors
      heads = self.sizes[kv_head] * self.sizes[group] // self._mesh_size(self.head_axes)
      local[group] = math.gcd(heads, self.sizes[group])
      local[kv_head] = heads // local[group]
    return local

  def local_config(self) -> KernelConfig:
    """The config of one device's shard."""
    local = self._local_sizes()

    def local_axis(slot: str, axis: Axis) -> Axis:
      role, size = axis
      if isinstance(role, str) or size == 1:
        return (role, size // self._mesh_size(self.dim_axes(slot, axis)))
      return (role, math.prod(local[_instance_factor(i)] for i in role))

    layouts = {slot: tuple(local_axis(slot, axis) for axis in layout)
               for slot, layout in self.config.layouts}
    T, S, *head_dims = self.config.seq_dims
    seq_shards = self._mesh_size(self.axes.get("t", ()))
    instance_sizes = tuple(local[_instance_factor(i)]
                           for i in range(len(self.config.instance_sizes)))
    return self.config.replace(instance_sizes=instance_sizes,
                               seq_dims=(T // seq_shards, S // seq_shards, *head_dims)).with_layouts(layouts)

  def _kv_head_dim(self, slot: str) -> int | None:
    """With q's heads split flat: the position of the kv-head axis in k, v, dk or dv (the
    slots whose head axis is the kv head alone); None for other slots, or without the split."""
    layout = self.config.layout(slot)
    if not self.head_axes or layout is None:
      return None
    kv_head = self.query_head_factors[0]
    return next((d for d, axis in enumerate(layout)
                 if axis_factors(self.config, slot, axis) == (kv_head,)), None)

  def _at_kv_heads_read(self, dim: int) -> tuple:
    """The index, on the kv-head axis at `dim`, of the kv head of each block of this device's
    query heads (_local_sizes), in order."""
    kv_head, group = self.query_head_factors
    local = self._local_sizes()
    first_head = jax.lax.axis_index(self.head_axes) * local[kv_head] * local[group]
    kv_heads = (first_head + jnp.arange(local[kv_head]) * local[group]) // self.sizes[group]
    return (slice(None),) * dim + (kv_heads,)

  def start(self, slot: str, value):
    """An operand of one device as its kernels take it: with q's heads split flat, k and v
    (replicated on heads) cut to the kv heads this device's query heads read; no communication."""
    dim = self._kv_head_dim(slot)
    if dim is None:
      return value
    return value.at[self._at_kv_heads_read(dim)].get(mode="promise_in_bounds")

  def reduced_axes(self, slot: str) -> MeshAxes:
    """The mesh axes a result's local value is a partial sum over: those of the sharded
    factors it does not carry (the kernel summed them within the shard), and those of q's
    heads split flat for a result without q's heads. The sequence factors are the ring's,
    which sums its own partials."""
    carried = {f for axis in self.config.layout(slot) for f in axis_factors(self.config, slot, axis)}
    axes = tuple(a for f, axes in sorted(self.axes.items())
                 if f not in carried and f not in SEQUENCE_FACTORS for a in axes)
    if self.head_axes and not carried.issuperset(self.query_head_factors):
      axes += self.head_axes
    return axes

  def finish(self, slot: str, value):
    """A result of one device: summed over the devices that hold the rest of its partial sums.

    With q's heads split flat, dk and dv first go back to K kv heads: the device's partials
    added at the kv heads it read, zeros elsewhere. K/V came replicated, so their gradients
    leave replicated, and the psum of these over the head axes is one all-reduce of a dk-sized
    array per gradient. Summing only within the devices that share a kv head and then
    gathering would move less (for 2 kv heads over 4 devices: dk's size per device instead of
    1.5 times it), but needs a reduction over part of a mesh axis (psum's axis_index_groups,
    which JAX does not implement under shard_map)."""
    if self.config.layout(slot) is None:
      return value
    dim = self._kv_head_dim(slot)
    if dim is not None:
      shape = list(value.shape)
      shape[dim] = self.sizes[self.query_head_factors[0]]
      value = jnp.zeros(shape, value.dtype).at[self._at_kv_heads_read(dim)].add(
          value, mode="promise_in_bounds")
    axes = self.reduced_axes(slot)
    return jax.lax.psum(value, axes) if axes else value


def _shardings(plan: Plan, slots: Sequence[str]) -> tuple[NamedSharding, ...]:
  return tuple(plan.sharding(slot) for slot in slots)


def _partition(inputs: Sequence[str], results: Sequence[str], local_call, ring_call):
  """The partition callback: the Plan's shardings, and the per-device program that runs
  local_call(*operands, local config), or ring_call(ring, *operands) on a sharded sequence,
  on the operands as Plan.start gives them."""
  def partition(config, mesh, arg_shapes, result_shape):
    del result_shape
    plan = Plan(config, mesh, inputs, arg_shapes)
    local, ring = plan.local_config(), plan.ring

    def run(*args):
      args = tuple(plan.start(slot, x) for slot, x in zip(inputs, args))
      outs = local_call(*args, local) if ring is None else ring_call(ring, *args)
      return tuple(plan.finish(slot, x) for slot, x in zip(results, outs))

    return mesh, run, _shardings(plan, results), _shardings(plan, inputs)
  return partition


def _reorder(ring: ring_lib.Ring, x, slot: str, permute):
  """x (of `slot`) through permute (to_zigzag or from_zigzag) when the ring runs in zig-zag
  order; the contiguous order needs none."""
  if ring.order != "zigzag":
    return x
  return permute(x, role_axis(ring.config.layout(slot), ROW), ring.axis_name)


def _ring_scale(ring: ring_lib.Ring, scale):
  """The scale operand for ring_lib, None when the scale is static (a placeholder here)."""
  return scale if ring.config.has(Flag.SCALE_OPERAND) else None


def _ring_operands(ring: ring_lib.Ring, given: dict) -> dict:
  """The present ones of ring_lib.RING_OPERANDS among the optional operands `given` by slot:
  the segment ids in the ring's order, the lengths and the seed words (not sharded on the
  sequence) as they are."""
  return {slot: _reorder(ring, given[slot], slot, ring_lib.to_zigzag) if "segment" in slot
          else given[slot]
          for slot in ring_lib.RING_OPERANDS if ring.config.layout(slot) is not None}


def _ring_forward(ring: ring_lib.Ring, q, k, v, *optional):
  """Ring attention on contiguous sequence shards (permuted to zig-zag order and back)."""
  # Of the optional operands only the scale, the lengths, the seed words and the segment ids can
  # be present (ring_lib.unsupported).
  scale = _ring_scale(ring, optional[-1])
  operands = _ring_operands(ring, dict(zip(OPTIONAL_INPUTS, optional)))
  q, k, v = (_reorder(ring, x, slot, ring_lib.to_zigzag) for x, slot in ((q, "q"), (k, "k"), (v, "v")))
  o32, lse = ring_lib.forward(q, k, v, ring, scale, operands)
  o = o32 if ring.config.has(Flag.OUTPUT_F32) else o32.astype(q.dtype)
  return (_reorder(ring, o, "o", ring_lib.from_zigzag),
          _reorder(ring, lse, "lse", ring_lib.from_zigzag))


def _ring_backward(ring: ring_lib.Ring, q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids,
                   kv_segment_ids, alibi_slopes, scale, lse, delta, d_o, dscale_centre,
                   dalibi_centre):
  del bias, mask, alibi_slopes, dalibi_centre  # absent: ring_lib.unsupported
  optional = _ring_operands(ring, dict(q_lens=q_lens, kv_lens=kv_lens, seed=seed,
                                       q_segment_ids=q_segment_ids,
                                       kv_segment_ids=kv_segment_ids))
  operands = [_reorder(ring, x, slot, ring_lib.to_zigzag) for x, slot in
              ((q, "q"), (k, "k"), (v, "v"), (lse, "lse"), (delta, "delta"), (d_o, "d_o"))]
  # The centre is per query row, as delta: it travels with the query block.
  centre = (_reorder(ring, dscale_centre, "dscale_centre", ring_lib.to_zigzag)
            if ring.config.has(Flag.HAS_DSCALE) else None)
  dq, dk, dv, dscale = ring_lib.backward(*operands, ring, _ring_scale(ring, scale), centre, optional)
  dq, dk, dv = (_reorder(ring, g, slot, ring_lib.from_zigzag)
                for g, slot in zip((dq, dk, dv), ("dq", "dk", "dv")))
  dscale = (absent("dscale", jnp.float32) if dscale is None else
            _reorder(ring, dscale, "dscale", ring_lib.from_zigzag))
  return dq, dk, dv, absent("dbias", q.dtype), absent("dalibi", jnp.float32), dscale


def _infer(slots: Sequence[str], results: Sequence[str]):
  """GSPMD's propagation callback: the results' shardings from the operands'."""
  def infer(config, mesh, arg_shapes, result_shape):
    plan = Plan(config, mesh, slots, arg_shapes)
    del result_shape
    return _shardings(plan, results)
  return infer


def _forward(q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids,
             alibi_slopes, scale, config):
  o, lse, _workspace = kernels.forward_kernel_p.bind(q, k, v, bias, mask, q_lens, kv_lens, seed,
                                                     q_segment_ids, kv_segment_ids, alibi_slopes,
                                                     scale, config=config)
  return o, lse


def _backward(q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids,
              alibi_slopes, scale, lse, delta, d_o, dscale_centre, dalibi_centre, config):
  *grads, _workspace = kernels.backward_kernel_p.bind(
      q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, alibi_slopes,
      scale, lse, delta, d_o, dscale_centre, dalibi_centre, config=config)
  return tuple(grads)


forward = custom_partitioning(_forward, static_argnums=(len(FORWARD_INPUTS),))
forward.def_partition(partition=_partition(FORWARD_INPUTS, OUTPUTS, _forward, _ring_forward),
                      infer_sharding_from_operands=_infer(FORWARD_INPUTS, OUTPUTS),
                      sharding_rule=_sharding_rule(FORWARD_INPUTS, OUTPUTS))
backward = custom_partitioning(_backward, static_argnums=(len(BACKWARD_INPUTS),))
backward.def_partition(partition=_partition(BACKWARD_INPUTS, GRADIENTS, _backward, _ring_backward),
                       infer_sharding_from_operands=_infer(BACKWARD_INPUTS, GRADIENTS),
                       sharding_rule=_sharding_rule(BACKWARD_INPUTS, GRADIENTS))
