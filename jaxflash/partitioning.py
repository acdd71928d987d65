"""How a jaxflash call splits over the devices its operands are sharded on.

The forward and backward primitives (jaxflash/primitives.py) lower through
``jax.experimental.custom_partitioning``: XLA's partitioner (Shardy, or GSPMD
where JAX still uses it) sees one op with a sharding rule, decides how its
operands are sharded, and asks the partition callbacks here for the program one
device runs: the kernel primitives (jaxflash/kernels.py) on the device's shard,
with a config whose sizes are the shard's.

The rule is written in *factors*, named from the config's layouts:

  i0, i1, ...  the instance axes (batch, kv head, query group, vmapped axes);
               q's head axis is the compound (kv head, group), k's the kv head
  t, s         the query and key sequence positions
  h            the feature (head dim)

An instance factor may be sharded on any mesh axes that divide it: each device
runs its own batch items and heads, and nothing is communicated except a psum
of a gradient whose operand does not carry a sharded factor (dk and dv of a
query group split over devices; dbias of a bias broadcast over a sharded batch
or head axis). t and s are sharded together, on the mesh axes of q's (else k's)
sequence, when ring attention (jaxflash/ring.py) can compute the call; otherwise
they stay replicated, as h always does, and XLA gathers a sequence- or
feature-sharded operand before the call.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

from jaxflash import kernels
from jaxflash import ring as ring_lib
from jaxflash.contract import (BACKWARD_INPUTS, BACKWARD_RESULTS, FORWARD_INPUTS, FORWARD_RESULTS,
                               QUERY_ROW_SLOTS, Flag, KernelConfig, absent)
from jaxflash.layout import COL, ROW, Axis, role_axis

# The kernels' workspaces stay inside the partition.
OUTPUTS = FORWARD_RESULTS[:2]
GRADIENTS = BACKWARD_RESULTS[:4]

# The factor of each slot's COL axis (the seed's COL axis, its two words, has none: never
# sharded); a ROW axis is t for QUERY_ROW_SLOTS, else s.
COL_FACTOR = {**dict.fromkeys(("q", "k", "v", "o", "d_o", "dq", "dk", "dv"), "h"),
              **dict.fromkeys(("bias", "mask", "dbias"), "s")}
SEQUENCE_FACTORS = ("t", "s")  # sharded together, by ring attention
REPLICATED_FACTORS = ("h",)

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


def factor_sizes(config: KernelConfig) -> dict[str, int]:
  T, S, H = config.seq_dims
  sizes = {_instance_factor(i): n for i, n in enumerate(config.instance_sizes)}
  sizes.update(t=T, s=S, h=H)
  return sizes


# ---------------------------------------------------------------- the Shardy rule

def _sharding_rule(slots: Sequence[str], results: Sequence[str]):
  def rule(config: KernelConfig, mesh, operand_types, result_types) -> SdyShardingRule:
    del mesh, operand_types, result_types
    unique = (f"u{n}" for n in range(10**6))  # a factor of its own: an axis never sharded
    whole, in_compound, order = set(), set(), []  # order: of first appearance

    def mapping(slot: str) -> ArrayMapping:
      layout = config.layout(slot)
      if layout is None:  # an absent operand: a zero-size placeholder
        return ArrayMapping(next(unique))
      dims = []
      for axis in layout:
        factors = axis_factors(config, slot, axis)
        order.extend(f for f in factors if f not in order)
        if len(factors) == 1:
          whole.add(factors[0])
          dims.append(factors[0])
        elif factors:
          in_compound.update(factors)
          dims.append(CompoundFactor(*factors))
        else:
          dims.append(next(unique))
      return ArrayMapping(*dims)

    operands = tuple(mapping(slot) for slot in slots)
    outputs = tuple(mapping(slot) for slot in results)
    sizes = factor_sizes(config)
    return SdyShardingRule(
        operands, outputs,  # Shardy wants the special factors in the rule's order
        need_replication_factors=tuple(f for f in order if f in REPLICATED_FACTORS),
        **{f: sizes[f] for f in in_compound - whole})
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
  shardings, the config of one device's shard, and the psums of partial gradients."""

  def __init__(self, config: KernelConfig, mesh, slots: Sequence[str], arg_shapes):
    self.config, self.mesh = config, mesh
    self.sizes = factor_sizes(config)
    self.axes: dict[str, MeshAxes] = {}
    if not mesh.empty:
      specs = {slot: _spec(shape) for slot, shape in zip(slots, arg_shapes)}
      for slot, layout in config.layouts:
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
    T, S, _ = self.config.seq_dims
    taken = {a for axes in self.axes.values() for a in axes}
    if (ring_lib.unsupported(self.config) is None and T % n == 0 and S % n == 0 and
        not taken.intersection(mesh_axes)):
      self.axes.update(t=mesh_axes, s=mesh_axes)

  @property
  def ring(self) -> ring_lib.Ring | None:
    """The ring of a sequence-sharded call, over the local blocks; None if not sharded."""
    axes = self.axes.get("t")
    if not axes:
      return None
    n = self._mesh_size(axes)
    T, S, _ = self.config.seq_dims
    # Zig-zag balances causal attention (a window balances itself); it needs each block to
    # split into two chunks.
    order = "zigzag" if self.config.window == ring_lib.CAUSAL and T % (2 * n) == 0 else "contiguous"
    return ring_lib.Ring(self.local_config(), axes if len(axes) > 1 else axes[0], order)

  def _mesh_size(self, mesh_axes: MeshAxes) -> int:
    return math.prod(self.mesh.shape[a] for a in mesh_axes)

  def _adopt(self, factors: tuple[str, ...], mesh_axes: MeshAxes) -> None:
    """Takes an operand dim's sharding for its factors, if they are free to shard and its mesh
    axes split over them as a contiguous chunking does: each factor but the last to get axes is
    sharded whole (one element per shard), the last one evenly."""
    if (not factors or not mesh_axes or any(f in self.axes for f in factors) or
        any(f in REPLICATED_FACTORS + SEQUENCE_FACTORS for f in factors) or
        any(a in taken for taken in self.axes.values() for a in mesh_axes)):
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
    return sum((self.axes.get(f, ()) for f in axis_factors(self.config, slot, axis)), ())

  def sharding(self, slot: str) -> NamedSharding:
    layout = self.config.layout(slot)
    if layout is None:
      return NamedSharding(self.mesh, PartitionSpec())
    spec = [self.dim_axes(slot, axis) or None for axis in layout]
    return NamedSharding(self.mesh, PartitionSpec(*spec))

  def local_config(self) -> KernelConfig:
    """The config of one device's shard."""
    local = tuple(n // self._mesh_size(self.axes.get(_instance_factor(i), ()))
                  for i, n in enumerate(self.config.instance_sizes))

    def local_axis(slot: str, axis: Axis) -> Axis:
      role, size = axis
      return (role, size // self._mesh_size(self.dim_axes(slot, axis)))

    layouts = {slot: tuple(local_axis(slot, axis) for axis in layout)
               for slot, layout in self.config.layouts}
    T, S, H = self.config.seq_dims
    seq_shards = self._mesh_size(self.axes.get("t", ()))
    return self.config.replace(instance_sizes=local, seq_dims=(T // seq_shards, S // seq_shards, H)
                               ).with_layouts(layouts)

  def reduced_axes(self, slot: str) -> MeshAxes:
    """The mesh axes a result's local value is a partial sum over: those of the sharded
    factors it does not carry (the kernel summed them within the shard). The sequence factors
    are the ring's, which sums its own partials."""
    carried = {f for axis in self.config.layout(slot) for f in axis_factors(self.config, slot, axis)}
    return tuple(a for f, axes in sorted(self.axes.items())
                 if f not in carried and f not in SEQUENCE_FACTORS for a in axes)

  def finish(self, slot: str, value):
    """A result of one device: summed over the devices that hold the rest of its partial sums."""
    if self.config.layout(slot) is None:
      return value
    axes = self.reduced_axes(slot)
    return jax.lax.psum(value, axes) if axes else value


def _shardings(plan: Plan, slots: Sequence[str]) -> tuple[NamedSharding, ...]:
  return tuple(plan.sharding(slot) for slot in slots)


def _partition(inputs: Sequence[str], results: Sequence[str], local_call, ring_call):
  """The partition callback: the Plan's shardings, and the per-device program that runs
  local_call(*operands, local config), or ring_call(ring, *operands) on a sharded sequence."""
  def partition(config, mesh, arg_shapes, result_shape):
    del result_shape
    plan = Plan(config, mesh, inputs, arg_shapes)
    local, ring = plan.local_config(), plan.ring

    def run(*args):
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


def _ring_forward(ring: ring_lib.Ring, q, k, v, *absent):
  """Ring attention on contiguous sequence shards (permuted to zig-zag order and back)."""
  del absent  # bias, mask, q_lens, kv_lens, seed, segment ids: ring_lib.unsupported
  q, k, v = (_reorder(ring, x, slot, ring_lib.to_zigzag) for x, slot in ((q, "q"), (k, "k"), (v, "v")))
  o32, lse = ring_lib.forward(q, k, v, ring)
  o = o32 if ring.config.has(Flag.OUTPUT_F32) else o32.astype(q.dtype)
  return (_reorder(ring, o, "o", ring_lib.from_zigzag),
          _reorder(ring, lse, "lse", ring_lib.from_zigzag))


def _ring_backward(ring: ring_lib.Ring, q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids,
                   kv_segment_ids, lse, delta, d_o):
  # absent: ring_lib.unsupported
  del bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids
  operands = [_reorder(ring, x, slot, ring_lib.to_zigzag) for x, slot in
              ((q, "q"), (k, "k"), (v, "v"), (lse, "lse"), (delta, "delta"), (d_o, "d_o"))]
  grads = ring_lib.backward(*operands, ring)
  return tuple(_reorder(ring, g, slot, ring_lib.from_zigzag)
               for g, slot in zip(grads, ("dq", "dk", "dv"))) + (absent("dbias", q.dtype),)


def _infer(slots: Sequence[str], results: Sequence[str]):
  """GSPMD's propagation callback: the results' shardings from the operands'."""
  def infer(config, mesh, arg_shapes, result_shape):
    plan = Plan(config, mesh, slots, arg_shapes)
    del result_shape
    return _shardings(plan, results)
  return infer


def _forward(q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, config):
  o, lse, _workspace = kernels.forward_kernel_p.bind(q, k, v, bias, mask, q_lens, kv_lens, seed,
                                                     q_segment_ids, kv_segment_ids, config=config)
  return o, lse


def _backward(q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, lse,
              delta, d_o, config):
  *grads, _workspace = kernels.backward_kernel_p.bind(
      q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, lse, delta, d_o,
      config=config)
  return tuple(grads)


forward = custom_partitioning(_forward, static_argnums=(len(FORWARD_INPUTS),))
forward.def_partition(partition=_partition(FORWARD_INPUTS, OUTPUTS, _forward, _ring_forward),
                      infer_sharding_from_operands=_infer(FORWARD_INPUTS, OUTPUTS),
                      sharding_rule=_sharding_rule(FORWARD_INPUTS, OUTPUTS))
backward = custom_partitioning(_backward, static_argnums=(len(BACKWARD_INPUTS),))
backward.def_partition(partition=_partition(BACKWARD_INPUTS, GRADIENTS, _backward, _ring_backward),
                       infer_sharding_from_operands=_infer(BACKWARD_INPUTS, GRADIENTS),
                       sharding_rule=_sharding_rule(BACKWARD_INPUTS, GRADIENTS))
