"""jaxflash under jit over a device mesh, and ring attention inside shard_map.

The CPU runs these on 8 devices (conftest.py asks JAX for 8 host devices); the GPU machine on
the GPUs it has. Meshes are (n,) over axis "x" and (2, n/2) over ("data", "model"). Every case
checks that the sharded call's outputs and gradients equal the single-device call's (to one
rounding; the ring's merge and partial-gradient sums add in another order, so its cases are
held to the accuracy rule against the reference instead), and, for sharding over batch and
heads, that the compiled program gathers or redistributes none of q, k and v: no all-gather,
no all-to-all (a psum of a partial gradient is allowed). The GQA cases whose query heads split
finer than K/V's (or whose K/V are replicated) run on meshes of their own (ShardCase.mesh),
skipped where JAX sees fewer devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflash
import reference
from jaxflash import kernels, ring as ring_lib
from jaxflash.attention import _delta, _gradient_layouts
from jaxflash.contract import OPTIONAL_INPUTS, UNBOUNDED, Flag, absent
from jaxflash.validation import validate
from reference import assert_close, assert_same_kernel

H = 32


def _devices(backend: str):
  devices = jax.devices(backend)
  if len(devices) < 2:
    pytest.skip(f"needs at least 2 {backend} devices, JAX sees {len(devices)}")
  return devices


def make_mesh(backend: str, two_d: bool, axis_type=AxisType.Auto):
  devices = _devices(backend)
  n = len(devices) if len(devices) % 2 == 0 else len(devices) - 1
  shape, names = ((2, n // 2), ("data", "model")) if two_d else ((n,), ("x",))
  return jax.sharding.Mesh(np.asarray(devices[:n]).reshape(shape), names,
                           axis_types=(axis_type,) * len(shape))


def case_mesh(backend: str, case: ShardCase):
  """The case's own mesh if it names one (skipped without enough devices), else make_mesh's."""
  if not case.mesh:
    return make_mesh(backend, case.two_d)
  names, shape = zip(*case.mesh)
  devices = _devices(backend)
  if len(devices) < math.prod(shape):
    pytest.skip(f"needs {math.prod(shape)} {backend} devices, JAX sees {len(devices)}")
  return jax.sharding.Mesh(np.asarray(devices[:math.prod(shape)]).reshape(shape), names,
                           axis_types=(AxisType.Auto,) * len(shape))


@dataclasses.dataclass(frozen=True)
class ShardCase:
  """Shapes (B, T, S, N, K), the mesh, each operand's PartitionSpec and attention options."""
  two_d: bool
  specs: dict  # operand name -> PartitionSpec; absent names are replicated
  B: int = 8
  T: int = 64
  S: int = 64
  N: int = 4
  K: int = 2
  Hv: int = H  # the value head dim (another than H: on CUDA zero-padded to one head dim)
  bias: tuple | None = None
  mask: tuple | None = None
  lengths: bool = False
  segments: bool = False  # packed sequences: segment ids of documents of 1 to 24 positions
  alibi: tuple | None = None  # the shape of alibi_slopes ((N,) or (B, N)); None: no ALiBi
  traced_scale: bool = False  # scale as a differentiated float32 scalar (replicated)
  options: tuple = ()  # attention keyword arguments, as (name, value) pairs
  local: bool = True   # batch/heads only: no all-gather or all-to-all
  ring: bool = False   # the sequence is sharded and ring attention computes it
  gathered: bool = False  # the sequence is sharded and XLA gathers it (no ring for the call)
  mesh: tuple = ()     # ((axis name, size), ...); () for make_mesh's mesh of all the devices
  # K/V replicated, q's heads sharded over whole kv heads: each device reads its kv heads
  # without communicating, and under Shardy, which gives each gradient its operand's sharding,
  # dk and dv (computed sharded on heads) are gathered to K/V's replicated sharding after the
  # call: the only all-gathers, none in the forward.
  kv_grads_gathered: bool = False
  # The specs are applied inside jit (with_sharding_constraint), not by device_put: for a
  # sharding device_put refuses (heads that do not divide over the devices).
  constrained: bool = False

  def static(self) -> dict:
    return dict(self.options)


CASES = {
    "batch": ShardCase(False, dict(query=P("x"), key=P("x"), value=P("x")),
                       options=(("is_causal", True),)),
    "heads_with_bias": ShardCase(False, dict(query=P(None, None, "x"), key=P(None, None, "x"),
                                             value=P(None, None, "x"), bias=P(None, "x")),
                                 B=2, N=8, K=8, T=37, S=45, bias=(1, 8, 37, 45)),
    "batch_and_gqa_heads": ShardCase(True, dict(query=P("data", None, "model"),
                                                key=P("data", None, "model"),
                                                value=P("data", None, "model")),
                                     B=4, N=16, K=8, T=45, S=45,
                                     options=(("local_window_size", (7, 3)),)),
    # K = 1: each device runs its query heads against the one K/V head, whose gradient is the
    # psum of the devices' partial sums.
    "mqa_heads": ShardCase(False, dict(query=P(None, None, "x")), B=2, N=8, K=1, T=37, S=29),
    # The bias is shared by the batch (replicated): its gradient is a psum over "x".
    "batch_broadcast_bias_mask_lengths": ShardCase(
        False, dict(query=P("x"), key=P("x"), value=P("x"), mask=P("x"),
                    query_seq_lengths=P("x"), key_value_seq_lengths=P("x")),
        T=37, S=45, bias=(1, 4, 37, 45), mask=(8, 1, 37, 45), lengths=True),
    "batch_dropout": ShardCase(False, dict(query=P("x"), key=P("x"), value=P("x")), T=37, S=37,
                               options=(("dropout_rate", 0.2), ("is_causal", True))),
    # A traced scale: its operand replicated beside the batch-sharded q, k and v (nothing
    # gathered), its gradient a psum; and on the automatic ring of a sharded sequence.
    "batch_traced_scale": ShardCase(False, dict(query=P("x"), key=P("x"), value=P("x")), T=37,
                                    S=37, traced_scale=True, options=(("is_causal", True),)),
    "sequence_causal_traced_scale": ShardCase(False, dict(query=P(None, "x"), key=P(None, "x"),
                                                          value=P(None, "x")),
                                              B=2, traced_scale=True,
                                              options=(("is_causal", True),), local=False,
                                              ring=True),
    "sequence_causal_gqa": ShardCase(False, dict(query=P(None, "x"), key=P(None, "x"),
                                                 value=P(None, "x")),
                                     B=2, options=(("is_causal", True),), local=False, ring=True),
    "sequence_cross": ShardCase(False, dict(query=P(None, "x"), key=P(None, "x"),
                                            value=P(None, "x")),
                                B=2, T=64, S=32, local=False, ring=True),
    "batch_and_sequence": ShardCase(True, dict(query=P("data", "model"), key=P("data", "model"),
                                               value=P("data", "model")),
                                    B=4, options=(("is_causal", True),), local=False, ring=True),
    "sequence_and_heads": ShardCase(True, dict(query=P(None, "data", "model"),
                                               key=P(None, "data", "model"),
                                               value=P(None, "data", "model")),
                                    B=2, N=8, K=4, options=(("is_causal", True),), local=False,
                                    ring=True),
    # Sliding windows: the ring runs only as far as the window reaches (test_ring_plan_*).
    "sequence_sliding_window": ShardCase(False, dict(query=P(None, "x"), key=P(None, "x"),
                                                     value=P(None, "x")),
                                         B=2, options=(("local_window_size", (13, 0)),),
                                         local=False, ring=True),
    "sequence_two_sided_window_gqa": ShardCase(False, dict(query=P(None, "x"), key=P(None, "x"),
                                                           value=P(None, "x")),
                                               B=2, N=8, K=2,
                                               options=(("local_window_size", (9, 6)),),
                                               local=False, ring=True),
    # A window over unequal lengths is no ring case: XLA gathers the sequence, the answer
    # stays right.
    "sequence_causal_soft_cap": ShardCase(False, dict(query=P(None, "x"), key=P(None, "x"),
                                                      value=P(None, "x")),
                                          B=2, options=(("is_causal", True),
                                                        ("logits_soft_cap", 2.0)),
                                          local=False, ring=True),
    # Segment ids shard with the batch (nothing gathered), stay replicated beside sharded
    # heads, and with a sharded sequence shard with it: ring attention, the key ids travelling
    # with their K/V block.
    "batch_segment_ids_causal": ShardCase(
        False, dict(query=P("x"), key=P("x"), value=P("x"), query_segment_ids=P("x"),
                    key_value_segment_ids=P("x")),
        T=37, S=37, segments=True, options=(("is_causal", True),)),
    "heads_segment_ids_bias": ShardCase(
        False, dict(query=P(None, None, "x"), key=P(None, None, "x"), value=P(None, None, "x"),
                    bias=P(None, "x")),
        B=2, N=8, K=8, T=45, S=45, bias=(1, 8, 45, 45), segments=True),
    # Causal over blocks that split in two: the zig-zag order (the ids permuted with q, k, v).
    "sequence_segment_ids_causal_zigzag": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x"),
                    query_segment_ids=P(None, "x"), key_value_segment_ids=P(None, "x")),
        B=2, segments=True, options=(("is_causal", True),), local=False, ring=True),
    # Causal over blocks of 5 on 8 devices (odd: the contiguous order), ids replicated.
    "sequence_segment_ids_causal_contiguous": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")),
        B=2, T=40, S=40, segments=True, options=(("is_causal", True),), local=False, ring=True),
    "sequence_segment_ids_full": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x"),
                    query_segment_ids=P(None, "x"), key_value_segment_ids=P(None, "x")),
        B=2, segments=True, local=False, ring=True),
    # Sequence lengths: each kernel call of the ring gets the lengths as its rows see them
    # (clipped to its block's positions; rows past q_len stay 0 / -inf through the merge).
    "sequence_lengths_causal_zigzag": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")),
        B=4, lengths=True, options=(("is_causal", True),), local=False, ring=True),
    "sequence_lengths_causal_contiguous_segment_ids": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x"),
                    query_segment_ids=P(None, "x"), key_value_segment_ids=P(None, "x")),
        B=4, T=40, S=40, lengths=True, segments=True, options=(("is_causal", True),),
        local=False, ring=True),
    "sequence_lengths_sliding_window": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")),
        B=4, lengths=True, options=(("local_window_size", (13, 0)),), local=False, ring=True),
    # (Without a window or causal mask the alignment places nothing: a ring case.)
    "sequence_cross_lengths_bottom_right": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")),
        B=4, T=64, S=32, lengths=True, options=(("mask_alignment", "bottom_right"),),
        local=False, ring=True),
    # Bottom-right alignment with lengths moves the diagonal per batch item: no ring for it
    # yet, XLA gathers the sequence.
    "sequence_lengths_bottom_right_gathered": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")),
        B=4, lengths=True, local=False,
        options=(("is_causal", True), ("mask_alignment", "bottom_right"))),
    # ALiBi slopes shard with the batch and heads they belong to (nothing gathered; the
    # gradient of (N,) slopes shared by a sharded batch is summed across it), and with a
    # sharded sequence are gathered with it (no ring for them yet).
    "batch_alibi_bottom_right_causal": ShardCase(
        False, dict(query=P("x"), key=P("x"), value=P("x"), alibi_slopes=P("x")),
        T=37, S=45, alibi=(8, 4),
        options=(("is_causal", True), ("mask_alignment", "bottom_right"))),
    "batch_shared_alibi_window": ShardCase(
        False, dict(query=P("x"), key=P("x"), value=P("x")), T=37, S=37, alibi=(4,),
        options=(("local_window_size", (9, 3)),)),
    "heads_gqa_alibi": ShardCase(
        False, dict(query=P(None, None, "x"), key=P(None, None, "x"), value=P(None, None, "x"),
                    alibi_slopes=P("x")),
        B=2, N=8, K=8, T=37, S=29, alibi=(8,)),
    "heads_over_more_devices_than_kv_heads_alibi": ShardCase(
        False, dict(query=P(None, None, "x"), alibi_slopes=P("x")), mesh=(("x", 4),), B=2, N=8,
        K=2, T=37, S=29, alibi=(8,), options=(("is_causal", True),)),
    "sequence_alibi_gathered": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")),
        B=2, alibi=(4,), options=(("is_causal", True),), local=False),
    # A value head dim other than the query/key one (its own factor, replicated like h): with
    # batch and GQA heads sharded, MQA heads (dv a psum over the devices), and ring attention,
    # whose merge and travelling dV carry it.
    "batch_and_gqa_heads_value_head_dim": ShardCase(
        True, dict(query=P("data", None, "model"), key=P("data", None, "model"),
                   value=P("data", None, "model")),
        B=4, N=8, K=4, T=37, S=45, Hv=24, options=(("is_causal", True),)),
    "heads_mqa_value_head_dim": ShardCase(False, dict(query=P(None, None, "x")), B=2, N=8, K=1,
                                          T=37, S=29, Hv=48),
    "sequence_causal_value_head_dim": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")), B=2, Hv=24,
        options=(("is_causal", True),), local=False, ring=True),
    "sequence_cross_window_gathered": ShardCase(False, dict(query=P(None, "x"), key=P(None, "x"),
                                                            value=P(None, "x")),
                                                B=2, T=64, S=32,
                                                options=(("local_window_size", (5, 0)),),
                                                local=False),
    # Dropout on the ring draws the unsharded call's mask (each kernel call hashes its rows' and
    # keys' positions in the whole sequence): blocks of 32, zig-zag chunks of 16.
    "sequence_dropout_causal_zigzag": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")), B=2, T=256,
        S=256, options=(("dropout_rate", 0.2), ("is_causal", True)), local=False, ring=True),
    "sequence_dropout_cross_broadcast": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")), B=2, T=256,
        S=128, options=(("dropout_rate", 0.3), ("broadcast_dropout", True)), local=False,
        ring=True),
    # Blocks of 16: zig-zag chunks of 8 would split the mask's pairs of keys, so the causal ring
    # runs in the contiguous order.
    "sequence_dropout_causal_contiguous": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")), B=2, T=128,
        S=128, options=(("dropout_rate", 0.1), ("is_causal", True)), local=False, ring=True),
    # Blocks of 8 (2 devices; of 2 on 8) split them in either order: no ring, XLA gathers the
    # sequence.
    "sequence_dropout_gathered": ShardCase(
        False, dict(query=P(None, "x"), key=P(None, "x"), value=P(None, "x")), B=2, T=16, S=16,
        options=(("dropout_rate", 0.2), ("is_causal", True)), local=False, gathered=True),
    # GQA with q's heads split finer than the kv heads (2 kv heads over 4 devices: JAX's
    # IndivisibleError before): K/V replicated, each device reads the kv head its query heads
    # use, and dk and dv are psums over the devices that share one.
    "gqa_heads_over_more_devices_than_kv_heads": ShardCase(
        False, dict(query=P(None, None, "x")), mesh=(("x", 4),), B=2, N=8, K=2, T=37, S=29,
        options=(("is_causal", True),)),
    # The same with the batch on another axis, and a bias with heads (split like q's; its
    # gradient a psum over the batch it is broadcast over).
    "gqa_heads_over_more_devices_than_kv_heads_with_batch_and_bias": ShardCase(
        True, dict(query=P("data", None, "model"), key=P("data"), value=P("data")), B=4, N=8,
        K=2, T=37, S=45, bias=(1, 8, 37, 45)),
    # K/V sharded compatibly: kv heads on one mesh axis, each kv head's group on another.
    "gqa_kv_heads_and_groups_on_two_axes": ShardCase(
        False, dict(query=P(None, None, ("kv", "group")), key=P(None, None, "kv"),
                    value=P(None, None, "kv")),
        mesh=(("kv", 2), ("group", 2)), B=2, N=8, K=2, T=37, S=45),
    "mqa_heads_over_4_with_batch": ShardCase(
        True, dict(query=P("data", None, "model"), key=P("data"), value=P("data")), B=4, N=8,
        K=1, T=37, S=29, options=(("local_window_size", (5, 2)),)),
    # Whole kv heads per device (K = 4 over 2), K/V sharded alike or replicated.
    "gqa_whole_kv_heads_kv_sharded": ShardCase(
        False, dict(query=P(None, None, "x"), key=P(None, None, "x"), value=P(None, None, "x")),
        mesh=(("x", 2),), B=2, N=8, K=4, T=37, S=45),
    "gqa_whole_kv_heads_kv_replicated": ShardCase(
        False, dict(query=P(None, None, "x")), mesh=(("x", 2),), B=2, N=8, K=4, T=37, S=45,
        local=False, kv_grads_gathered=True),
    # 3 kv heads, 4 devices: a device's 3 query heads may span two kv heads' groups (device 1:
    # heads 3, 4, 5 of kv heads 0, 1, 1); it runs them as 3 heads, each with a copy of its kv
    # head.
    "gqa_kv_heads_not_dividing_devices": ShardCase(
        False, dict(query=P(None, None, "x")), mesh=(("x", 4),), B=2, N=12, K=3, T=37, S=29,
        options=(("is_causal", True),)),
    # 6 kv heads over 4 devices (Shardy gave the kv head a sub-axis: the forward failed too).
    "gqa_kv_heads_sharing_a_factor_with_devices": ShardCase(
        False, dict(query=P(None, None, "x")), mesh=(("x", 4),), B=2, N=12, K=6, T=37, S=29),
    # 8 query heads over 3 devices (an uneven sharding, possible inside jit): no device can
    # take whole heads, so XLA gathers them; the answer stays right.
    "gqa_heads_not_dividing_devices_gathered": ShardCase(
        False, dict(query=P(None, None, "x")), mesh=(("x", 3),), B=2, N=8, K=2, T=37, S=29,
        local=False, constrained=True),
}


def _inputs(case: ShardCase, dtype, device):
  def make():
    key = jax.random.key(0)
    shapes = dict(query=(case.B, case.T, case.N, H), key=(case.B, case.S, case.K, H),
                  value=(case.B, case.S, case.K, case.Hv), bias=case.bias)
    inputs = reference.random_inputs(key, shapes, dtype)
    inputs["mask"] = (reference.random_mask(jax.random.fold_in(key, 1), case.mask)
                      if case.mask else None)
    lengths = lambda n, salt: (jax.random.randint(jax.random.fold_in(key, salt), (case.B,), 1, n + 1)
                               if case.lengths else None)
    inputs["query_seq_lengths"] = lengths(case.T, 2)
    inputs["key_value_seq_lengths"] = lengths(case.S, 3)
    inputs["bias"] = inputs.get("bias")
    inputs["dropout_rng"] = (jax.random.key(7) if dict(case.options).get("dropout_rate") else None)
    if case.segments:
      lengths = np.random.RandomState(5).randint(1, 25, (case.B, max(case.T, case.S)))
      inputs["query_segment_ids"] = jaxflash.segment_ids_from_lengths(lengths, case.T)[0]
      inputs["key_value_segment_ids"] = jaxflash.segment_ids_from_lengths(lengths, case.S)[1]
    inputs["alibi_slopes"] = (jax.random.uniform(jax.random.fold_in(key, 6), case.alibi,
                                                 jnp.float32, 0.05, 1.0) if case.alibi else None)
    if case.traced_scale:
      inputs["scale"] = jnp.asarray(0.3, jnp.float32)
    cotangent = jax.random.normal(jax.random.fold_in(key, 4), (case.B, case.T, case.N, case.Hv),
                                  jnp.float32).astype(dtype)
    return inputs, cotangent
  return reference.made_on_cpu(device, make)


def _shard(inputs, cotangent, case: ShardCase, mesh):
  """The inputs placed on the mesh by the case's specs (the rest, the cotangent, and every
  input of a constrained case, replicated)."""
  specs = {} if case.constrained else case.specs
  place = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
  return ({name: place(x, specs.get(name, P())) for name, x in inputs.items()},
          place(cotangent, P()))


def _attention_fn(case: ShardCase, mesh):
  """jaxflash.attention; for a constrained case, on its inputs constrained to the case's specs."""
  if not case.constrained:
    return jaxflash.attention

  def attention(**kwargs):
    constrain = lambda name, x: (jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, case.specs[name])) if name in case.specs else x)
    return jaxflash.attention(**{name: constrain(name, x) for name, x in kwargs.items()})
  return attention


def _grad_fn(case: ShardCase, attention):
  """jit(vjp) of attention, for HLO inspection."""
  def run(inputs, cotangent):
    differentiable = {n: inputs[n] for n in reference.DIFFERENTIABLE if inputs.get(n) is not None}
    fixed = {n: v for n, v in inputs.items() if n not in differentiable}
    out, vjp = jax.vjp(lambda d: attention(**d, **fixed, **case.static()), differentiable)
    return out, vjp(cotangent)
  return run


# An all-gather's result, one shape or a tuple of them (gathers XLA combined), in compiled HLO:
# "%all-gather.1 = f32[2,37,4,32]{3,1,0,2} all-gather(...", or all-gather-done where async.
_ALL_GATHER = re.compile(r"= (\([^=]*?\)|\S+) all-gather(?:-done)?\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _all_gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
  return [tuple(int(d) for d in dims.split(",") if d)
          for result in _ALL_GATHER.findall(hlo) for dims in _SHAPE.findall(result)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_single_device(name, dtype, backend, device):
  case = CASES[name]
  mesh = case_mesh(backend, case)
  inputs, cotangent = _inputs(case, jnp.dtype(dtype), device)
  static = case.static()
  attention = _attention_fn(case, mesh)

  single, single_grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **static)
  sharded_inputs, sharded_cotangent = _shard(inputs, cotangent, case, mesh)
  ours, ours_grads = reference.forward_and_grads(attention, sharded_inputs, sharded_cotangent,
                                                 **static)

  tolerance = reference.compute_name(backend, dtype)
  if case.ring:
    # Against the reference: the ring adds its partial results in another order.
    (ref, ref_grads), (base, base_grads) = reference.reference_and_baseline(
        inputs, cotangent, backend=backend, **static)
    _assert_ring_close((ours, ours_grads), (ref, ref_grads), (base, base_grads), tolerance)
    if "dropout_rate" in static:  # the unsharded call's mask (the reference's too)
      _assert_ring_close((ours, ours_grads), (single, single_grads), (base, base_grads),
                         tolerance, " (unsharded)")
  else:
    assert_same_kernel(ours, single, tolerance, "out")
    for g in single_grads:
      assert_same_kernel(ours_grads[g], single_grads[g], tolerance, g)

  # The output keeps the query's sharding.
  assert not (case.local or case.ring) or ours.sharding.is_equivalent_to(sharded_inputs["query"].sharding, ours.ndim), (
      f"output sharding {ours.sharding}, query's {sharded_inputs['query'].sharding}")

  hlo = jax.jit(_grad_fn(case, attention)).lower(sharded_inputs,
                                                 sharded_cotangent).compile().as_text()
  if case.local or case.ring:
    for collective in ("all-gather", "all-to-all"):
      assert collective not in hlo, f"the compiled forward+backward has an {collective}"
  if case.gathered:
    assert inputs["query"].shape in _all_gathered_shapes(hlo), "the sequence is not gathered"
  if case.kv_grads_gathered:
    forward_hlo = jax.jit(lambda inputs: attention(**inputs, **static)).lower(
        sharded_inputs).compile().as_text()
    for collective in ("all-gather", "all-to-all"):
      assert collective not in forward_hlo, f"the compiled forward has an {collective}"
    gathered = _all_gathered_shapes(hlo)
    assert len(gathered) <= 2 and set(gathered) <= {inputs["key"].shape}, (
        f"all-gathers of {gathered}: more than dk and dv (shape {inputs['key'].shape})")
  ring_axes = case.specs["query"][1] if case.ring else None
  ring_axes = (ring_axes,) if isinstance(ring_axes, str) else ring_axes or ()
  if np.prod([mesh.shape[a] for a in ring_axes]) > 1:  # (a ring of one device has no permutes)
    assert "collective-permute" in hlo, "ring attention without collective permutes"


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.Hv != H])
def test_sharded_one_head_dim_call_equals_the_native_call(name):
  """The CUDA lowering's zero padding to one head dim (kernels.call_with_one_head_dim) run
  around the CPU kernels of each device's shard, ring attention's blocks inside shard_map
  included: the sharded call and its gradients equal the CPU kernels' native Hv ≠ H call to
  one rounding. On the CPU in every build."""
  case = CASES[name]
  device = jax.devices("cpu")[0]
  mesh = case_mesh("cpu", case)
  inputs, cotangent = _inputs(case, jnp.dtype("float32"), device)
  sharded_inputs, sharded_cotangent = _shard(inputs, cotangent, case, mesh)
  attention, static = _attention_fn(case, mesh), case.static()
  run = lambda: reference.forward_and_grads(attention, sharded_inputs, sharded_cotangent, **static)
  native, native_grads = run()
  with reference.one_head_dim_on_cpu() as padded_calls:
    padded, padded_grads = run()
  assert {kernel for kernel, _ in padded_calls} == {"jaxflash_fwd_kernel", "jaxflash_bwd_kernel"}
  assert_same_kernel(padded, native, "float32", "out")
  assert padded_grads.keys() == native_grads.keys()
  for g in native_grads:
    assert_same_kernel(padded_grads[g], native_grads[g], "float32", g)


def _assert_ring_close(ours, expected, baseline, tolerance, what: str = ""):
  """A ring's (out, grads) against expected ones, by the accuracy rule with the baseline's."""
  (out, grads), (expected_out, expected_grads), (base, base_grads) = ours, expected, baseline
  assert_close(out, expected_out, base, tolerance, "out" + what)
  for g in expected_grads:
    assert_close(grads[g], expected_grads[g], base_grads[g], tolerance, g + what)


GQA_CASES = [name for name in CASES if name.startswith(("gqa_", "mqa_"))]


@pytest.mark.parametrize("name", GQA_CASES)
def test_gqa_heads_under_gspmd(name, backend, device):
  """The GQA and MQA head cases under GSPMD, where this JAX still has it. There is no sharding
  rule then: the Plan alone gives the results' shardings, so the gradients of replicated K/V
  over whole kv heads per device stay sharded (no all-gather in that case either)."""
  case = CASES[name]
  mesh = case_mesh(backend, case)
  inputs, cotangent = _inputs(case, jnp.float32, device)
  static = case.static()
  attention = _attention_fn(case, mesh)
  single, single_grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **static)
  try:
    jax.config.update("jax_use_shardy_partitioner", False)
  except (AttributeError, ValueError):
    pytest.skip("this JAX has Shardy only")
  try:
    sharded_inputs, sharded_cotangent = _shard(inputs, cotangent, case, mesh)
    ours, ours_grads = reference.forward_and_grads(attention, sharded_inputs, sharded_cotangent,
                                                   **static)
    hlo = jax.jit(_grad_fn(case, attention)).lower(sharded_inputs,
                                                   sharded_cotangent).compile().as_text()
  finally:
    jax.config.update("jax_use_shardy_partitioner", True)
  assert_same_kernel(ours, single, jnp.float32, "out (GSPMD)")
  for g in single_grads:
    assert_same_kernel(ours_grads[g], single_grads[g], jnp.float32, f"{g} (GSPMD)")
  if case.local or case.kv_grads_gathered:
    for collective in ("all-gather", "all-to-all"):
      assert collective not in hlo, f"the compiled forward+backward has an {collective} (GSPMD)"


# ---------------------------------------------------------------- ring_attention in shard_map

RING_CASES = {
    "causal_zigzag": dict(is_causal=True, order="zigzag"),
    "causal_contiguous": dict(is_causal=True, order="contiguous"),
    "full_zigzag": dict(is_causal=False, order="zigzag"),
    "full_contiguous": dict(is_causal=False, order="contiguous"),
    # Blocks of 16: two blocks back on 8 devices; the second, one block back and two ahead.
    "causal_sliding_window": dict(is_causal=True, local_window_size=20, order="contiguous"),
    "two_sided_window": dict(is_causal=False, local_window_size=(5, 18), order="contiguous"),
    # The soft-cap is per logit: every block caps its own.
    "causal_zigzag_soft_cap": dict(is_causal=True, order="zigzag", logits_soft_cap=1.5),
    # A traced scale, replicated into the shard_map and differentiated: every block reads it.
    "causal_zigzag_traced_scale": dict(is_causal=True, order="zigzag", traced_scale=0.45),
    # Packed documents: each device's block of the ids (permuted with q, k, v); the key ids
    # travel with their K/V block.
    "segment_ids_causal_zigzag": dict(is_causal=True, order="zigzag", segments=True),
    "segment_ids_full_contiguous": dict(is_causal=False, order="contiguous", segments=True),
    "segment_ids_full_zigzag": dict(is_causal=False, order="zigzag", segments=True),
    # Lengths of the whole sequence, replicated: each kernel call takes them as its rows see
    # them (in the zig-zag order, a block's two chunks lie apart in the sequence).
    "lengths_causal_zigzag": dict(is_causal=True, order="zigzag", lengths=True),
    "lengths_causal_contiguous": dict(is_causal=True, order="contiguous", lengths=True),
    "lengths_two_sided_window": dict(is_causal=False, local_window_size=(5, 18),
                                     order="contiguous", lengths=True),
    "lengths_segment_ids_causal_zigzag": dict(is_causal=True, order="zigzag", lengths=True,
                                              segments=True),
    # A traced scale's gradient centres on each row's mean logit, a ring forward of its own
    # (attention.py, _ring_dscale_centre), which must see the call's ids and lengths too.
    "lengths_segment_ids_traced_scale": dict(is_causal=True, order="zigzag", lengths=True,
                                             segments=True, traced_scale=0.45),
    # Dropout: the same key on every device draws the unsharded call's mask. Blocks of 32 (the
    # zig-zag order's chunks of 16: the mask's pairs of keys start at multiples of 16); in the
    # zig-zag order each step is a kernel call per pair of chunks.
    "dropout_causal_zigzag": dict(is_causal=True, order="zigzag", dropout_rate=0.2, block=32),
    "dropout_causal_contiguous": dict(is_causal=True, order="contiguous", dropout_rate=0.3,
                                      block=32),
    "dropout_full_zigzag": dict(is_causal=False, order="zigzag", dropout_rate=0.1, block=32),
    "dropout_full_contiguous_broadcast": dict(is_causal=False, order="contiguous",
                                              dropout_rate=0.2, broadcast_dropout=True, block=32),
    # A window whose keys start mid-block: the tasks' keys start at the multiple of 16 before.
    "dropout_two_sided_window_lengths": dict(is_causal=False, local_window_size=(21, 37),
                                             order="contiguous", dropout_rate=0.2, block=32,
                                             lengths=True),
    "dropout_segment_ids_traced_scale": dict(is_causal=True, order="zigzag", dropout_rate=0.2,
                                             block=32, segments=True, traced_scale=0.45),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(RING_CASES))
def test_ring_attention_in_shard_map(name, dtype, backend, device):
  options = dict(RING_CASES[name])
  traced_scale = options.pop("traced_scale", None)
  segments, lengths = options.pop("segments", False), options.pop("lengths", False)
  mesh = make_mesh(backend, two_d=False)
  n = mesh.shape["x"]
  B, T, N, K = (4 if lengths else 2), options.pop("block", 16) * n, 4, 2
  case = ShardCase(False, {}, B=B, T=T, S=T, N=N, K=K, segments=segments, lengths=lengths,
                   options=tuple(options.items()))
  inputs, cotangent = _inputs(case, jnp.dtype(dtype), device)
  if traced_scale is not None:
    inputs["scale"] = jax.device_put(jnp.asarray(traced_scale, jnp.float32), device)
  order = (jaxflash.zigzag_order(T, n) if options["order"] == "zigzag" else jnp.arange(T))
  undo = jnp.argsort(order)
  spec = P(None, "x")
  # After q, k and v: the segment ids (blocks, in the ring's order), the lengths (replicated),
  # the traced scale, the dropout's key (replicated), those the case has.
  extra = ((("query_segment_ids", spec), ("key_value_segment_ids", spec)) if segments else ()) + (
      (("query_seq_lengths", P()), ("key_value_seq_lengths", P())) if lengths else ()) + (
      (("scale", P()),) if traced_scale is not None else ()) + (
      (("dropout_rng", P()),) if "dropout_rate" in options else ())
  in_specs = (spec, spec, spec) + tuple(s for _, s in extra)

  def ring_attention(query, key, value, *args):
    return jaxflash.ring_attention(query, key, value, axis_name="x", **options,
                                   **dict(zip((name for name, _ in extra), args)))

  ring = jax.shard_map(ring_attention, mesh=mesh, in_specs=in_specs, out_specs=spec)

  def attention(query, key, value, **given):
    in_order = lambda name, x: x[:, order] if "segment" in name else x
    args = tuple(in_order(name, given[name]) for name, _ in extra)
    return ring(query[:, order], key[:, order], value[:, order], *args)[:, undo]

  ours, ours_grads = reference.forward_and_grads(attention, *_shard(inputs, cotangent, case, mesh))
  static = {name: value for name, value in options.items() if name != "order"}
  (ref, ref_grads), (base, base_grads) = reference.reference_and_baseline(
      inputs, cotangent, backend=backend, **static)
  tolerance = reference.compute_name(backend, dtype)
  _assert_ring_close((ours, ours_grads), (ref, ref_grads), (base, base_grads), tolerance)
  if "dropout_rate" in static:  # the unsharded call's mask (the reference's too)
    single = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **static)
    _assert_ring_close((ours, ours_grads), single, (base, base_grads), tolerance, " (unsharded)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_traced_scale_replicated_in_shard_map(dtype, backend, device):
  """jaxflash.attention inside shard_map on batch shards with one learned scale replicated on
  every device: its gradient is the sum of the devices' parts (as the unsharded call's)."""
  mesh = make_mesh(backend, two_d=False)
  case = ShardCase(False, {}, T=37, S=45, traced_scale=True)
  inputs, cotangent = _inputs(case, jnp.dtype(dtype), device)
  attention = functools.partial(jaxflash.attention, is_causal=True)
  spec = P("x")
  sharded = jax.shard_map(lambda q, k, v, scale: attention(q, k, v, scale=scale), mesh=mesh,
                          in_specs=(spec, spec, spec, P()), out_specs=spec)

  def in_shard_map(query, key, value, scale, **unused):
    del unused
    return sharded(query, key, value, scale)

  ours, ours_grads = reference.forward_and_grads(in_shard_map, *_shard(inputs, cotangent, case,
                                                                        mesh))
  single, single_grads = reference.forward_and_grads(attention, inputs, cotangent)
  tolerance = reference.compute_name(backend, dtype)
  assert_same_kernel(ours, single, tolerance, "out")
  for g in single_grads:
    assert_same_kernel(ours_grads[g], single_grads[g], tolerance, g)


def test_zigzag_order_places_chunks():
  order = np.asarray(jaxflash.zigzag_order(16, 4))  # chunks of 2
  assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  with pytest.raises(ValueError, match="seq_len must be a multiple of 2 \\* num_shards = 8"):
    jaxflash.zigzag_order(12, 4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(axis_name="nope"), "axis_name must name mesh axes"),
    (dict(axis_name="x", order="striped"), "order must be 'contiguous' or 'zigzag'"),
])
def test_ring_attention_errors(kwargs, match):
  mesh = make_mesh("cpu", two_d=False)
  x = jnp.ones((1, 8 * mesh.shape["x"], 2, 8))
  fn = jax.shard_map(functools.partial(jaxflash.ring_attention, **kwargs), mesh=mesh,
                     in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x"))
  with pytest.raises(ValueError, match=match):
    jax.jit(fn).lower(x, x, x)


def test_ring_attention_refuses_what_it_cannot_compute():
  mesh = make_mesh("cpu", two_d=False)
  x = jnp.ones((1, 8 * mesh.shape["x"], 2, 8))
  y = jnp.ones((1, 4 * mesh.shape["x"], 2, 8))
  ring = lambda **kwargs: jax.jit(jax.shard_map(
      functools.partial(jaxflash.ring_attention, axis_name="x", **kwargs), mesh=mesh,
      in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x")))
  with pytest.raises(ValueError, match="causal attention needs equal query and key lengths"):
    ring(is_causal=True).lower(x, y, y)
  with pytest.raises(ValueError, match="a local window needs equal query and key lengths"):
    ring(local_window_size=3).lower(x, y, y)
  with pytest.raises(ValueError, match="order='zigzag' balances causal attention; with "
                                       "local_window_size=3 use order='contiguous'"):
    ring(local_window_size=3, order="zigzag").lower(x, x, x)


def test_ring_unsupported_says_why():
  """What the ring computes (segment ids, lengths, dropout) and what it leaves to a gathered
  call."""
  x = jnp.ones((2, 16, 2, 8))
  lens, ids = jnp.asarray([3, 16], jnp.int32), jnp.zeros((2, 16), jnp.int32)
  why = lambda **kwargs: ring_lib.unsupported(validate(x, x, x, **kwargs).config)
  assert why(is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids,
             query_seq_lengths=lens, key_value_seq_lengths=lens) is None
  assert why(local_window_size=(3, 2), key_value_seq_lengths=lens) is None
  assert why(key_value_seq_lengths=lens, mask_alignment="bottom_right") is None  # no diagonal
  assert why(is_causal=True, mask_alignment="bottom_right") is None  # T == S: top-left's
  assert "mask_alignment='bottom_right' with sequence lengths is not supported yet" in why(
      is_causal=True, query_seq_lengths=lens, mask_alignment="bottom_right")
  assert why(bias=jnp.ones((16, 16))) == "a bias is not supported yet"
  assert why(mask=jnp.ones((16, 16), bool)) == "a mask is not supported yet"
  assert why(alibi_slopes=jnp.ones((2,))) == "alibi_slopes is not supported yet"
  dropout = validate(x, x, x, dropout_rate=0.1, dropout_rng=jax.random.key(0)).config
  assert ring_lib.unsupported(dropout) is None
  # Blocks of 16 positions: the mask's pairs of keys start at multiples of 16.
  assert ring_lib.dropout_misaligned(dropout, "contiguous") is None
  assert ring_lib.dropout_misaligned(dropout, "zigzag") == (
      "dropout needs zig-zag chunks of a multiple of 16 positions (where the mask's hash pairs "
      "its keys), got 8")


def test_ring_attention_refuses_misaligned_dropout():
  mesh = make_mesh("cpu", two_d=False)
  x = jnp.ones((1, 24 * mesh.shape["x"], 2, 8))
  ring = jax.jit(jax.shard_map(
      lambda q, k, v, rng: jaxflash.ring_attention(q, k, v, axis_name="x", dropout_rate=0.1,
                                                   dropout_rng=rng),
      mesh=mesh, in_specs=(P(None, "x"),) * 3 + (P(),), out_specs=P(None, "x")))
  with pytest.raises(ValueError, match="dropout needs key blocks of a multiple of 16 positions"):
    ring.lower(x, x, x, jax.random.key(0))


U = UNBOUNDED


@pytest.mark.parametrize("key_align", [1, 4])
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("window", [(U, U), (U, 0), (13, 0), (9, 6), (3, 3), (0, 0), (2, 20),
                                    (100, 100)])
def test_ring_plan_covers_each_visible_pair_once(window, n, key_align):
  """Over all devices, steps and passes, the tasks of a contiguous ring compute every query-key
  pair the window lets meet exactly once, and no other; their keys start at multiples of
  key_align (dropout's alignment, scaled down to blocks of 8)."""
  T = 8
  positions = np.arange(n * T)
  visible = _in_window(window, positions[None, :] - positions[:, None])
  covered = np.zeros(visible.shape, int)
  for ring_pass in ring_lib.plan((T, T), window, "contiguous", n, key_align):
    for step, (earlier, later) in enumerate(ring_pass.steps):
      for i in range(n):
        src = (i - ring_pass.direction * step) % n
        task = earlier if src < i else later
        if task is None:
          continue
        assert task.k0 % key_align == 0, task
        t, s = np.arange(task.tq)[:, None], np.arange(task.tk)[None, :]
        rows, keys = i * T + task.q0 + t, src * T + task.k0 + s
        np.add.at(covered, (np.broadcast_to(rows, (task.tq, task.tk)),
                            np.broadcast_to(keys, (task.tq, task.tk))),
                  _in_window(task.window, s - t - task.diagonal))
  np.testing.assert_array_equal(covered, visible.astype(int))


@pytest.mark.parametrize("window,steps", [
    ((U, U), [8]), ((U, 0), [8]),
    ((13, 0), [3]),      # two blocks of 8 back: the ring stops after two permutes
    ((9, 6), [3, 2]),    # two back and one ahead: a short pass each way
    ((40, 40), [8]),     # five each way: once round is shorter
])
def test_ring_plan_stops_where_the_window_ends(window, steps):
  assert [len(p.steps) for p in ring_lib.plan((8, 8), window, "contiguous", 8)] == steps


def test_ring_sends_only_the_rows_the_window_reads():
  """A causal window of 5 over blocks of 64: one step, on which 5 key rows travel, 5 query rows
  merge, and the dK/dV of 5 key rows go home."""
  (ring_pass,) = ring_lib.plan((64, 64), (5, 0), "contiguous", 8)
  assert len(ring_pass.steps) == 2
  assert ring_pass.keys_held(1, 64) == (59, 64)
  assert ring_pass.query_span(1) == (0, 5)
  assert ring_pass.keys_touched(1) == (59, 64)
  assert ring_pass.query_span(0) == ring_pass.keys_held(0, 64) == (0, 64)


def _in_window(window, d):
  left, right = window
  return (((left == U) | (d >= -left)) & ((right == U) | (d <= right))).astype(int)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_start,k_start,window", [
    (16, 8, (13, 0)),   # a sliding window, keys behind (diagonal_offset 8)
    (0, 8, (2, 10)),    # keys ahead (diagonal_offset -8)
    (40, 3, (37, 37)),  # every key of the block in the window
])
def test_diagonal_offset_places_blocks_in_one_sequence(q_start, k_start, window, dtype, backend,
                                                       device):
  """The kernels on one device, given query rows [q_start, q_start + T) and key rows
  [k_start, k_start + S) of one sequence as the ring gives them (diagonal_offset = q_start -
  k_start), equal attention under the window of the whole sequence's positions."""
  T, S, N, K = 29, 21, 4, 2
  case = ShardCase(False, {}, B=2, T=T, S=S, N=N, K=K)
  inputs, cotangent = _inputs(case, jnp.dtype(dtype), device)
  d = (k_start + np.arange(S))[None, :] - (q_start + np.arange(T))[:, None]
  inputs["mask"] = jax.device_put(jnp.asarray((d >= -window[0]) & (d <= window[1]))[None, None],
                                  device)
  absent_operands = lambda dtype: [absent(slot, dtype) for slot in OPTIONAL_INPUTS]

  @jax.jit
  def placed(q, k, v, d_o):
    config = validate(q, k, v, local_window_size=window).config.replace(
        diagonal=q_start - k_start)
    o32, lse, _ = kernels.forward_kernel_p.bind(
        q, k, v, *absent_operands(q.dtype),
        config=config.replace(flags=config.flags | Flag.OUTPUT_F32))
    delta = _delta(d_o, o32, config)
    dq, dk, dv, *_ = kernels.backward_kernel_p.bind(
        q, k, v, *absent_operands(q.dtype), lse, delta, d_o, absent("dscale_centre", q.dtype),
        absent("dalibi_centre", q.dtype), config=config.with_layouts(_gradient_layouts(config)))
    return o32.astype(q.dtype), dict(dq=dq, dk=dk, dv=dv)

  ours, ours_grads = placed(inputs["query"], inputs["key"], inputs["value"], cotangent)
  (ref, ref_grads), (base, base_grads) = reference.reference_and_baseline(
      {n: inputs[n] for n in ("query", "key", "value", "mask")}, cotangent, backend=backend)
  tolerance = reference.compute_name(backend, dtype)
  assert_close(ours, ref, base, tolerance, "out")
  for g in ref_grads:
    assert_close(ours_grads[g], ref_grads[g], base_grads[g], tolerance, g)


def test_explicit_mesh_and_gspmd(backend, device):
  """A mesh of explicit axes, and (where this JAX still has it) the GSPMD partitioner."""
  case = CASES["batch_and_gqa_heads"]
  inputs, cotangent = _inputs(case, jnp.float32, device)
  single, _ = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **case.static())
  mesh = make_mesh(backend, True, AxisType.Explicit)
  with jax.set_mesh(mesh):
    out, _ = reference.forward_and_grads(jaxflash.attention, *_shard(inputs, cotangent, case, mesh),
                                         **case.static())
  assert_same_kernel(out, single, jnp.float32, "out (explicit mesh)")
  try:
    jax.config.update("jax_use_shardy_partitioner", False)
  except (AttributeError, ValueError):
    return  # this JAX has Shardy only
  try:
    mesh = make_mesh(backend, True)
    out, _ = reference.forward_and_grads(jaxflash.attention, *_shard(inputs, cotangent, case, mesh),
                                         **case.static())
    assert_same_kernel(out, single, jnp.float32, "out (GSPMD)")
  finally:
    jax.config.update("jax_use_shardy_partitioner", True)
