"""jaxflash.attention under JAX transformations: jit, eval_shape, checkpoint, vmap (every way the
contract intends it to be called: vmapping a single-head (T, H) call over heads and batch), the
compiled HLO of vmapped calls (one kernel, no layout copies), determinism, and the
differentiation modes that are not supported (which must raise, never return zeros).

vmap results are compared with a Python loop of per-item calls (`loop_vmap`), i.e. the same
kernel on the same data; only the summation order may differ, so the tolerance is one rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import reference
from jaxflash.contract import SLOTS, packed_strides
from jaxflash.layout import COL, ROW, col_minor_order, strides_of
from reference import assert_bitwise_equal, assert_same_kernel

T, S, H = 40, 72, 32  # small, ragged (not multiples of a tile) and T != S
HV = 20  # a value head dim below H, not a multiple of 16
HV_WIDE = 48  # a value head dim above H
B, N, E = 2, 4, 3  # batch, heads, an extra leading axis


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def loop_vmap(fn, in_axes=0, out_axes=0):
  """jax.vmap semantics by a Python loop: call `fn` on each slice and stack the results.
  `out_axes` is one axis for every output leaf, or a tuple with one axis per element of a
  tuple-valued `fn`. Each call is jitted, as the vmapped one is, so that a scale slice stays a
  traced operand (eagerly it would be a concrete scalar, which jaxflash takes as the static
  attribute: another kernel variant, whose float32 rounding differs)."""
  fn = jax.jit(fn)

  def looped(*args):
    axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    sizes = {leaf.shape[axis] for x, axis in zip(args, axes) if axis is not None
             for leaf in jax.tree.leaves(x)}
    assert len(sizes) == 1, sizes

    def item(i):
      return fn(*(x if axis is None else jax.tree.map(lambda a: jnp.take(a, i, axis=axis), x)
                  for x, axis in zip(args, axes)))

    items = [item(i) for i in range(sizes.pop())]
    if isinstance(out_axes, (tuple, list)):
      return tuple(jnp.stack([it[j] for it in items], axis=axis)
                   for j, axis in enumerate(out_axes))
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=out_axes), *items)

  return looped


def attention_of(names, **static):
  """jaxflash.attention taking the operands named in `names` positionally (so that vmap's
  in_axes can address each of them)."""
  return lambda *operands: jaxflash.attention(**dict(zip(names, operands)), **static)


@dataclasses.dataclass(frozen=True)
class VmapCase:
  """`operands` maps each positional operand of the attention call (jaxflash.attention's
  argument names) to the shape of the full, batched array (a bool mask for "mask", int32 lengths
  for *_seq_lengths, int32 ids in {0, 1, 2} for *_segment_ids, float32 slopes in [0.05, 1) for
  alibi_slopes). `layers` are (in_axes, out_axes) from the innermost vmap outwards."""
  operands: dict
  layers: tuple
  static: dict = dataclasses.field(default_factory=dict)

  def build(self, vmap):
    fn = attention_of(tuple(self.operands), **self.static)
    for in_axes, out_axes in self.layers:
      fn = vmap(fn, in_axes=in_axes, out_axes=out_axes)
    return fn

  def inputs(self, seed: int, dtype):
    def arrays():
      key, arrays = jax.random.key(seed), []
      for i, (name, shape) in enumerate(self.operands.items()):
        k = jax.random.fold_in(key, i)
        if name == "mask":
          arrays.append(reference.random_mask(k, shape))
        elif name.endswith("seq_lengths"):
          limit = T if name == "query_seq_lengths" else S
          arrays.append(jax.random.randint(k, shape, 0, limit + 1, jnp.int32))
        elif name.endswith("segment_ids"):
          arrays.append(jax.random.randint(k, shape, 0, 3, jnp.int32))
        elif name == "alibi_slopes":
          arrays.append(jax.random.uniform(k, shape, jnp.float32, 0.05, 1.0))
        else:
          arrays.append(reference.random_inputs(k, {name: shape}, dtype)[name])
      return arrays
    return made_for_test(arrays)

  @property
  def differentiable(self):
    return tuple(i for i, name in enumerate(self.operands) if name in reference.DIFFERENTIABLE)


VMAP_CASES = {
    # Single-head (T, H) calls vmapped over the heads of a TNH array.
    "heads_axis1": VmapCase(dict(query=(T, N, H), key=(S, N, H), value=(S, N, H)),
                            layers=((1, 1),)),
    "heads_axis_minus2": VmapCase(dict(query=(T, N, H), key=(S, N, H), value=(S, N, H)),
                                  layers=((-2, -2),)),
    # ... then over batch: BTNH in, BTNH out (heads innermost).
    "heads_then_batch": VmapCase(dict(query=(B, T, N, H), key=(B, S, N, H), value=(B, S, N, H)),
                                 layers=((1, 1), (0, 0))),
    # ... batch innermost, the outer vmap over axis 2 (heads) of BTNH.
    "batch_then_heads_axis2": VmapCase(
        dict(query=(B, T, N, H), key=(B, S, N, H), value=(B, S, N, H)),
        layers=((0, 0), (2, 2))),
    # K/V not batched: every head reads the same K/V, i.e. multi-query attention.
    "kv_unbatched_mqa": VmapCase(dict(query=(T, N, H), key=(S, H), value=(S, H)),
                                 layers=(((1, None, None), 1),)),
    # Batched K/V per batch entry, shared across heads: MQA inside each batch entry.
    "kv_shared_over_heads_then_batch": VmapCase(
        dict(query=(B, T, N, H), key=(B, S, H), value=(B, S, H)),
        layers=(((1, None, None), 1), (0, 0))),
    # A bias and a mask shared (unbatched) by every head.
    "shared_bias_and_mask": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H), bias=(T, S), mask=(T, S)),
        layers=(((1, 1, 1, None, None), 1),), static=dict(is_causal=True)),
    # A per-head bias (batched on its own axis 0) with a shared mask.
    "per_head_bias_shared_mask": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H), bias=(N, T, S), mask=(T, S)),
        layers=(((1, 1, 1, 0, None), 1),)),
    # Masking options and the residual under vmap.
    "heads_causal_window_residual": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H)), layers=((1, 1),),
        static=dict(is_causal=True, local_window_size=(9, 2), return_residual=True)),
    "heads_bottom_right_causal": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H)), layers=((1, 1),),
        static=dict(is_causal=True, mask_alignment="bottom_right")),
    # Heads-major (N, T, H) operands: the vmapped axis is the outermost one.
    "heads_axis0_BNTH": VmapCase(dict(query=(N, T, H), key=(N, S, H), value=(N, S, H)),
                                 layers=((0, 0),)),
    # Every operand batched on a different axis (per-operand strides).
    "mixed_axes": VmapCase(dict(query=(N, T, H), key=(S, N, H), value=(S, H, N)),
                           layers=(((0, 1, 2), 0),)),
    # Output batched on another axis than the query.
    "heads_in_axis1_out_axis0": VmapCase(dict(query=(T, N, H), key=(S, N, H), value=(S, N, H)),
                                         layers=((1, 0),)),
    # Only the mask (or only the bias) batched: q/k/v shared by every item, so the rule must
    # broadcast them (the cuDNN batcher's bug, JAX issue #38495) and sum their gradients.
    "only_mask_batched": VmapCase(dict(query=(T, H), key=(S, H), value=(S, H), mask=(E, T, S)),
                                  layers=(((None, None, None, 0), 0),)),
    "only_bias_batched": VmapCase(dict(query=(T, H), key=(S, H), value=(S, H), bias=(E, T, S)),
                                  layers=(((None, None, None, 0), 0),)),
    # A 4-D GQA call vmapped over an extra leading axis.
    "extra_leading_axis_4d": VmapCase(
        dict(query=(E, B, T, N, H), key=(E, B, S, 2, H), value=(E, B, S, 2, H)),
        layers=((0, 0),)),
    # ... with per-item sequence lengths, causal and the residual.
    "extra_leading_axis_4d_lengths": VmapCase(
        dict(query=(E, B, T, N, H), key=(E, B, S, N, H), value=(E, B, S, N, H),
             query_seq_lengths=(E, B), key_value_seq_lengths=(E, B)),
        layers=((0, 0),), static=dict(is_causal=True, return_residual=True)),
    # K/V shared by every item (unbatched: stride 0, their gradients summed) while the key
    # lengths are per item: the instances that share one key tile see different keys of it.
    "kv_unbatched_lengths_batched": VmapCase(
        dict(query=(E, B, T, N, H), key=(B, S, N, H), value=(B, S, N, H),
             query_seq_lengths=(E, B), key_value_seq_lengths=(E, B)),
        layers=(((0, None, None, 0, 0), 0),), static=dict(is_causal=True)),
    # ... with sequence lengths shared by every item (unbatched).
    "extra_leading_axis_4d_shared_lengths": VmapCase(
        dict(query=(E, B, T, N, H), key=(E, B, S, N, H), value=(E, B, S, N, H),
             query_seq_lengths=(B,), key_value_seq_lengths=(B,)),
        layers=(((0, 0, 0, None, None), 0),), static=dict(mask_alignment="bottom_right",
                                                          is_causal=True)),
    # Segment ids per item of the extra axis, and shared by every item (unbatched: stride 0).
    "extra_leading_axis_4d_segment_ids": VmapCase(
        dict(query=(E, B, T, N, H), key=(E, B, S, 2, H), value=(E, B, S, 2, H),
             query_segment_ids=(E, B, T), key_value_segment_ids=(E, B, S)),
        layers=((0, 0),), static=dict(is_causal=True, return_residual=True)),
    "heads_shared_segment_ids": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H), query_segment_ids=(T,),
             key_value_segment_ids=(S,)),
        layers=(((1, 1, 1, None, None), 1),)),
    # Only the ids batched: q/k/v shared by every item.
    "only_segment_ids_batched": VmapCase(
        dict(query=(T, H), key=(S, H), value=(S, H), query_segment_ids=(E, T),
             key_value_segment_ids=(E, S)),
        layers=(((None, None, None, 0, 0), 0),)),
    # ALiBi slopes: one per vmapped head (each single-head call gets a scalar slope), per item of
    # an extra axis, shared by every item (unbatched: stride 0), or the only batched operand.
    "heads_alibi": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H), alibi_slopes=(N,)),
        layers=(((1, 1, 1, 0), 1),), static=dict(is_causal=True, mask_alignment="bottom_right")),
    "extra_leading_axis_4d_alibi": VmapCase(
        dict(query=(E, B, T, N, H), key=(E, B, S, 2, H), value=(E, B, S, 2, H),
             alibi_slopes=(E, B, N)),
        layers=((0, 0),), static=dict(return_residual=True)),
    "extra_leading_axis_4d_shared_alibi": VmapCase(
        dict(query=(E, B, T, N, H), key=(E, B, S, 2, H), value=(E, B, S, 2, H),
             alibi_slopes=(N,)),
        layers=(((0, 0, 0, None), 0),), static=dict(local_window_size=(7, 3))),
    "only_alibi_batched": VmapCase(
        dict(query=(T, H), key=(S, H), value=(S, H), alibi_slopes=(E,)),
        layers=(((None, None, None, 0), 0),)),
    # A traced scale (differentiated) shared by every head: the kernels' scale operand, one call.
    "heads_shared_traced_scale": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H), scale=()),
        layers=(((1, 1, 1, None), 1),), static=dict(is_causal=True)),
    # One scale per head (batched): the scale operand gets a stride along the mapped heads (q
    # reaches the kernel as it is, not multiplied by the scale), still one call.
    "heads_per_head_traced_scale": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, H), scale=(N,)),
        layers=(((1, 1, 1, 0), 1),)),
    # Only the scale batched: q/k/v shared by every item (stride 0), the scale per item.
    "only_traced_scale_batched": VmapCase(
        dict(query=(T, H), key=(S, H), value=(S, H), scale=(E,)),
        layers=(((None, None, None, 0), 0),), static=dict(return_residual=True)),
    # A value head dim HV != H: o, dO and dv have HV features, and the vmapped axis lands in
    # front of, or (value: heads after its feature axis) behind, the HV axis. On CUDA the
    # narrower operands are zero-padded to one head dim around the kernel, along their feature
    # axis wherever it lies (kernels.call_with_one_head_dim): v and dO below H; q and k above
    # it, as in the last case (key: heads after its feature axis).
    "heads_value_head_dim": VmapCase(
        dict(query=(T, N, H), key=(S, N, H), value=(S, N, HV)), layers=((1, 1),),
        static=dict(is_causal=True, return_residual=True)),
    "mixed_axes_value_head_dim": VmapCase(dict(query=(N, T, H), key=(S, N, H), value=(S, HV, N)),
                                          layers=(((0, 1, 2), 0),)),
    "kv_unbatched_mqa_value_head_dim": VmapCase(dict(query=(T, N, H), key=(S, H), value=(S, HV)),
                                                layers=(((1, None, None), 1),)),
    "mixed_axes_wide_value_head_dim": VmapCase(
        dict(query=(N, T, H), key=(S, H, N), value=(S, N, HV_WIDE)), layers=(((0, 2, 1), 0),),
        static=dict(is_causal=True)),
}

# Configurations in which every operand is batched, so vmap-of-grad can map the gradients back
# onto the operands' own axes.
FULLY_BATCHED = ("heads_axis1", "heads_then_batch", "batch_then_heads_axis2", "heads_axis0_BNTH",
                 "mixed_axes", "extra_leading_axis_4d", "heads_causal_window_residual",
                 "extra_leading_axis_4d_segment_ids", "heads_alibi", "extra_leading_axis_4d_alibi",
                 "heads_per_head_traced_scale", "heads_value_head_dim", "mixed_axes_value_head_dim",
                 "mixed_axes_wide_value_head_dim")
# Forward-only configurations whose compiled HLO must be a single kernel without layout copies.
HLO_FORWARD = ("heads_axis1", "heads_axis_minus2", "heads_then_batch", "batch_then_heads_axis2",
               "heads_axis0_BNTH", "mixed_axes", "kv_unbatched_mqa",
               "kv_shared_over_heads_then_batch", "shared_bias_and_mask", "extra_leading_axis_4d",
               "extra_leading_axis_4d_segment_ids", "heads_shared_segment_ids", "heads_alibi",
               "extra_leading_axis_4d_shared_alibi", "heads_shared_traced_scale",
               "heads_per_head_traced_scale", "only_traced_scale_batched",
               "kv_unbatched_mqa_value_head_dim")
HLO_GRAD = ("heads_axis1", "heads_then_batch", "kv_unbatched_mqa", "shared_bias_and_mask",
            "only_bias_batched", "extra_leading_axis_4d", "extra_leading_axis_4d_segment_ids",
            "extra_leading_axis_4d_alibi", "only_alibi_batched", "heads_alibi",
            "heads_shared_traced_scale",
            "only_traced_scale_batched", "heads_value_head_dim", "kv_unbatched_mqa_value_head_dim")
# Configurations with an operand whose feature axis is not minor-most (value vmapped on an axis
# after its head dim). The CUDA kernels need a unit feature stride, so the CUDA lowering asks
# XLA for a layout with that axis minor-most: a transpose of that operand, on CUDA only.
COL_NOT_MINOR = ("mixed_axes",)
# A value head dim other than the query/key one: on CUDA, zero padding to one head dim around
# the kernel and slices after it (kernels.call_with_one_head_dim), copies by design.
ONE_HEAD_DIM = ("heads_value_head_dim", "mixed_axes_value_head_dim",
                "kv_unbatched_mqa_value_head_dim", "mixed_axes_wide_value_head_dim")

VMAP_DTYPES = ("float32", "bfloat16")




def weighted_sum_loss(fn, cotangent):
  """sum(out * cotangent) (and likewise for the lse) in float32: its gradient is the VJP of
  `fn` with `cotangent`."""

  def loss(*operands):
    outs = fn(*operands)
    return sum(jnp.sum(jnp.where(jnp.isfinite(o), o, 0).astype(jnp.float32) *
                       c.astype(jnp.float32))
               for o, c in zip(jax.tree.leaves(outs), jax.tree.leaves(cotangent)))

  return loss


def made_for_test(fn, *args):
  """fn(*args) (random inputs) made on the CPU, so that they are the same on every backend and
  cost no GPU compile, then placed on the device the test runs on (the backend fixture's
  default device)."""
  device = jax.config.jax_default_device or jax.devices()[0]
  return reference.made_on_cpu(device, fn, *args)


def random_cotangent(fn, operands, seed: int):
  shapes = jax.eval_shape(fn, *operands)
  leaves, tree = jax.tree.flatten(shapes)

  def cotangent():
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype)
                                     for k, s in zip(keys, leaves)])
  return made_for_test(cotangent)


def random_inputs(seed: int, shapes, dtype):
  return made_for_test(lambda: reference.random_inputs(jax.random.key(seed), shapes, dtype))


def small_inputs(seed: int, dtype, *, q_shape=(B, T, N, H), kv_shape=(B, S, 2, H)):
  return random_inputs(seed, dict(query=q_shape, key=kv_shape, value=kv_shape), dtype)


# --------------------------------------------------------------------------------------------
# vmap
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", VMAP_DTYPES)
@pytest.mark.parametrize("name", list(VMAP_CASES))
def test_vmap_matches_loop(name, dtype, backend):
  case = VMAP_CASES[name]
  operands = case.inputs(1, dtype)
  batched = jax.jit(case.build(jax.vmap))(*operands)
  looped = case.build(loop_vmap)(*operands)
  for i, (b, l) in enumerate(zip(jax.tree.leaves(batched), jax.tree.leaves(looped))):
    assert b.shape == l.shape and b.dtype == l.dtype, (i, b.shape, l.shape, b.dtype, l.dtype)
    assert_same_kernel(b, l, dtype, f"{name}: output {i}")


def test_vmap_over_heads_equals_multi_head_call(backend):
  """Vmapping the single-head call over heads and batch is the 4-D multi-head call."""
  inputs = small_inputs(2, "float32", kv_shape=(B, S, N, H))
  case = VMAP_CASES["heads_then_batch"]
  batched = jax.jit(case.build(jax.vmap))(inputs["query"], inputs["key"], inputs["value"])
  direct = jaxflash.attention(inputs["query"], inputs["key"], inputs["value"])
  assert_same_kernel(batched, direct, "float32", "vmapped single-head vs 4-D call")


@pytest.mark.parametrize("dtype", VMAP_DTYPES)
@pytest.mark.parametrize("name", list(VMAP_CASES))
def test_grad_of_vmap_matches_loop(name, dtype, backend):
  case = VMAP_CASES[name]
  operands = case.inputs(3, dtype)
  batched_fn, looped_fn = case.build(jax.vmap), case.build(loop_vmap)
  cotangent = random_cotangent(batched_fn, operands, 4)
  argnums = case.differentiable
  batched = jax.jit(jax.grad(weighted_sum_loss(batched_fn, cotangent), argnums))(*operands)
  looped = jax.grad(weighted_sum_loss(looped_fn, cotangent), argnums)(*operands)
  for i, b, l in zip(argnums, batched, looped):
    assert b.shape == operands[i].shape and b.dtype == operands[i].dtype
    assert not np.isnan(np.asarray(b, np.float32)).any(), f"{name}: NaN in grad {i}"
    assert_same_kernel(b, l, dtype, f"{name}: grad of operand {i}")


@pytest.mark.parametrize("dtype", VMAP_DTYPES)
@pytest.mark.parametrize("name", FULLY_BATCHED)
def test_vmap_of_grad_matches_loop(name, dtype, backend):
  case = VMAP_CASES[name]
  operands = case.inputs(5, dtype)
  item_fn = attention_of(tuple(case.operands), **case.static)
  argnums = case.differentiable

  # The per-item cotangent is vmapped along with the operands, onto the output's axes.
  def item_grads(*operands_and_cotangent):
    *item_operands, cotangent = operands_and_cotangent
    return jax.grad(weighted_sum_loss(item_fn, cotangent), argnums)(*item_operands)

  cotangent = random_cotangent(case.build(jax.vmap), operands, 6)
  batched_fn, looped_fn = item_grads, item_grads
  for in_axes, out_axes in case.layers:
    in_axes = (in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(operands))
    # Gradients come back on their operands' axes.
    grad_axes = tuple(in_axes[i] for i in argnums)
    batched_fn = jax.vmap(batched_fn, in_axes=in_axes + (out_axes,), out_axes=grad_axes)
    looped_fn = loop_vmap(looped_fn, in_axes + (out_axes,), grad_axes)
  batched = jax.jit(batched_fn)(*operands, cotangent)
  looped = looped_fn(*operands, cotangent)
  for i, b, l in zip(argnums, batched, looped):
    assert b.shape == operands[i].shape, (b.shape, operands[i].shape)
    assert_same_kernel(b, l, dtype, f"{name}: vmapped grad of operand {i}")


# jaxflash.kernels imported without the package's __init__ (which imports every module, the
# primitives of jaxflash/primitives.py too): the kernel primitives' batching rules must come with
# them. vmap of each kernel call then equals the per-item calls.
KERNELS_ALONE = """
import importlib.util
import sys

spec = importlib.util.find_spec("jaxflash")
package = importlib.util.module_from_spec(spec)  # not executed
package.__version__ = sys.argv[1]
sys.modules["jaxflash"] = package

import jax
import numpy as np

from jaxflash import kernels, validation
from jaxflash.contract import OPTIONAL_INPUTS as OPTIONAL, absent

assert "jaxflash.primitives" not in sys.modules, sorted(sys.modules)


def kernel_calls(q, k, v):
  config = validation.validate(q, k, v, is_causal=True).config
  o, lse, _ = kernels.forward_kernel_p.bind(q, k, v, *(absent(s, q.dtype) for s in OPTIONAL),
                                            config=config)
  grad_layouts = {"d_o": config.layout("o"), "delta": config.layout("lse"),
                  "dq": config.layout("q"), "dk": config.layout("k"), "dv": config.layout("v")}
  dq, dk, dv, *_ = kernels.backward_kernel_p.bind(
      q, k, v, *(absent(s, q.dtype) for s in OPTIONAL), lse, lse, o, absent("dscale_centre", q.dtype),
      absent("dalibi_centre", q.dtype), config=config.with_layouts(grad_layouts))
  return o, lse, dq, dk, dv


q, k, v = (jax.random.normal(jax.random.key(i), (3, 24, 16)) for i in range(3))
batched = jax.jit(jax.vmap(kernel_calls))(q, k, v)
looped = [jax.jit(kernel_calls)(q[i], k[i], v[i]) for i in range(3)]
for j, b in enumerate(batched):
  np.testing.assert_allclose(b, np.stack([items[j] for items in looped]), rtol=1e-6, atol=1e-6)
print("batched")
"""


def test_kernel_primitives_batch_without_the_rest_of_the_package():
  result = subprocess.run([sys.executable, "-c", KERNELS_ALONE, jaxflash.__version__],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0 and result.stdout.split() == ["batched"], result.stderr


# --------------------------------------------------------------------------------------------
# Compiled HLO of vmapped calls: one kernel, strided access instead of transposes/copies.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", HLO_FORWARD)
def test_vmap_compiles_to_one_kernel_without_copies(name, backend):
  case = VMAP_CASES[name]
  operands = case.inputs(7, "bfloat16")
  hlo = reference.compiled_hlo(case.build(jax.vmap), *operands)
  targets = reference.custom_call_targets(hlo)
  assert reference.count_custom_calls(hlo, "jaxflash_fwd") == 1, (
      f"{name}: expected one jaxflash_fwd custom call, got targets {targets}\n{hlo}")
  assert reference.count_custom_calls(hlo, "jaxflash_bwd") == 0, targets
  if backend == "cuda" and name in COL_NOT_MINOR + ONE_HEAD_DIM:
    return  # a transpose of the operand whose feature axis is not minor, or padding, by design
  copies = reference.transpose_or_copy_lines(hlo)
  assert not copies, f"{name}: layout copies around the kernel:\n" + "\n".join(copies) + \
      f"\n--- full HLO ---\n{hlo}"


@pytest.mark.parametrize("name", HLO_GRAD)
def test_vmapped_grad_compiles_to_one_forward_and_one_backward_kernel(name, backend):
  """One call per direction, whatever the vmap nesting; a differentiated traced scale adds one
  forward, attention(q, k, v=k) for the rows' centre of its gradient (attention._dscale_centre),
  also one call, and differentiated ALiBi slopes another, attention(q, k, v=key positions)
  (attention._dalibi_centre)."""
  case = VMAP_CASES[name]
  operands = case.inputs(8, "bfloat16")
  fn = case.build(jax.vmap)
  cotangent = random_cotangent(fn, operands, 9)
  argnums = case.differentiable
  grad_fn = jax.grad(weighted_sum_loss(fn, cotangent), argnums)
  hlo = reference.compiled_hlo(grad_fn, *operands)
  targets = reference.custom_call_targets(hlo)
  names = tuple(case.operands)
  # Each differentiated centre adds its forward: the traced scale's, the slopes'.
  forwards = 1 + sum(any(names[i] == n for i in argnums) for n in ("scale", "alibi_slopes"))
  assert reference.count_custom_calls(hlo, "jaxflash_fwd") == forwards, f"{name}: {targets}\n{hlo}"
  assert reference.count_custom_calls(hlo, "jaxflash_bwd") == 1, f"{name}: {targets}\n{hlo}"
  if "alibi_slopes" in names:
    # The slopes' gradient stays copy-free too: dalibi (per key row of each query head) is laid out
    # as delta's instance axes and its centre's forward takes positions shared by every instance.
    copies = reference.transpose_or_copy_lines(hlo)
    assert not copies, f"{name}: layout copies in the gradient:\n" + "\n".join(copies)


def test_strides_follow_a_col_minor_physical_order():
  """mixed_axes' value, (S, H, N) with the vmapped heads after the feature axis: row-major it
  has col stride N; in the physical order (S, N, H) that the CUDA lowering requests, the
  strides are those of that order, with col stride 1."""
  layout = ((ROW, S), (COL, H), ((0,), N))
  assert strides_of(layout, (N,)) == ([1], H * N, N)
  assert col_minor_order(layout) == (0, 2, 1)
  assert strides_of(layout, (N,), (0, 2, 1)) == ([H], N * H, 1)
  # Heads first, feature axis last or followed only by unit axes: row-major already fits.
  assert col_minor_order(((ROW, S), ((0,), N), (COL, H))) is None
  assert col_minor_order(((ROW, S), (COL, H), ((0,), 1))) is None
  assert col_minor_order(((ROW, S), (COL, 1), ((0,), N))) is None
  # A nested case: feature axis first of four.
  layout = ((COL, H), ((0,), E), (ROW, S), ((1,), N))
  assert col_minor_order(layout) == (1, 2, 3, 0)
  assert strides_of(layout, (E, N), (1, 2, 3, 0)) == ([S * N * H, H], N * H, 1)
  # packed_strides puts each slot's strides (instance..., row, col) in its SLOTS row.
  sizes, strides = packed_strides((N,), {"q": ((ROW, T), ((0,), N), (COL, H)),
                                         "v": ((ROW, S), (COL, H), ((0,), N))},
                                  orders={"v": (0, 2, 1)})
  rows = strides.reshape(len(SLOTS), -1)
  assert sizes.tolist() == [N]
  assert rows[SLOTS.index("q")].tolist() == [H, N * H, 1]
  assert rows[SLOTS.index("v")].tolist() == [H, N * H, 1]


def _lowered_for_cuda(fn, *operands) -> str:
  """fn lowered for CUDA, as StableHLO text (lowering only: no GPU needed), with the CUDA
  lowering rules registered as a CUDA build registers them."""
  if "cuda" not in jaxflash.kernels.PLATFORMS:
    jaxflash.kernels.register_lowerings("cuda")  # a CPU-only build lowers for CPU only
  return jax.jit(fn).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()


def _cuda_custom_calls(fn, *operands):
  """The jaxflash custom calls of fn lowered for CUDA."""
  text = _lowered_for_cuda(fn, *operands)
  return [line for line in text.splitlines() if re.search(r"custom_call @jaxflash_(fwd|bwd)", line)]


def _attribute(call: str, name: str) -> list[int]:
  match = re.search(name + r" = dense<\[?([-\d, ]+)\]?>", call)
  assert match, f"no {name} in {call}"
  return [int(x) for x in match.group(1).split(",")]


def _layouts(call: str, which: str) -> list[list[int]]:
  match = re.search(which + r" = \[((?:dense<[^>]*> : tensor<[^>]*>(?:, )?)*)\]", call)
  assert match, f"no {which} in {call}"
  return [[int(x) for x in m.split(",")] for m in re.findall(r"dense<\[?([\d, ]+)\]?>",
                                                              match.group(1))]


def _slot_strides(call: str, slot: str) -> list[int]:
  dims = len(_attribute(call, "instance_sizes"))
  strides = _attribute(call, "strides")
  i = SLOTS.index(slot) * (dims + 2)
  return strides[i:i + dims + 2]


def test_cuda_lowering_makes_the_feature_axis_minor():
  """The CUDA lowering of mixed_axes (value vmapped after its head dim) asks XLA for a layout of
  value (and of dv) with the feature axis minor-most and passes the strides of that layout;
  q, k, o, dq, dk keep the default layout. A case without such an operand keeps every default
  (no transpose there). Runs on any machine: it only lowers."""
  case = VMAP_CASES["mixed_axes"]  # q (N, T, H), k (S, N, H), v (S, H, N); heads vmapped
  operands = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in case.operands.values()]
  fn = case.build(jax.vmap)
  grad_fn = jax.grad(lambda *ops: jnp.sum(fn(*ops).astype(jnp.float32)), (0, 1, 2))

  (fwd,) = _cuda_custom_calls(fn, *operands)
  assert _layouts(fwd, "operand_layouts")[:3] == [[2, 1, 0], [2, 1, 0], [1, 2, 0]]
  assert _layouts(fwd, "result_layouts")[:2] == [[2, 1, 0], [2, 1, 0]]  # o; lse: rows, (hi, lo)
  assert _slot_strides(fwd, "q") == [T * H, H, 1]
  assert _slot_strides(fwd, "k") == [H, N * H, 1]
  assert _slot_strides(fwd, "v") == [H, N * H, 1]  # physical (S, N, H)

  calls = _cuda_custom_calls(grad_fn, *operands)
  bwd = next(c for c in calls if "jaxflash_bwd" in c)
  assert _layouts(bwd, "operand_layouts")[:3] == [[2, 1, 0], [2, 1, 0], [1, 2, 0]]
  assert _layouts(bwd, "result_layouts")[:3] == [[2, 1, 0], [2, 1, 0], [1, 2, 0]]  # dq dk dv
  for slot in ("v", "dv"):
    assert _slot_strides(bwd, slot) == [H, N * H, 1], slot

  plain = VMAP_CASES["heads_axis1"]
  plain_operands = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
                    for shape in plain.operands.values()]
  (fwd,) = _cuda_custom_calls(plain.build(jax.vmap), *plain_operands)
  row_major = lambda layout: layout == sorted(layout, reverse=True)
  assert all(map(row_major, _layouts(fwd, "operand_layouts") + _layouts(fwd, "result_layouts")))


def test_cuda_lowering_pads_a_value_head_dim_along_the_feature_axis():
  """A value head dim Hv other than the query/key one H lowers for CUDA as one call per
  direction of one head dim D = max(H, Hv) (kernels.call_with_one_head_dim): the narrower
  operands zero-padded to D along their feature axis wherever vmap put it, the wider results
  sliced back, the scale still 1/sqrt(H), and a padded operand whose feature axis is not
  minor-most given the layout and strides with it minor-most. Runs on any machine: it only
  lowers."""
  for name, D, narrow in (("mixed_axes_value_head_dim", H, ("v", "dv")),
                          ("mixed_axes_wide_value_head_dim", HV_WIDE, ("k", "dk"))):
    case = VMAP_CASES[name]
    operands = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in case.operands.values()]
    fn = case.build(jax.vmap)
    grad_fn = jax.grad(lambda *ops: jnp.sum(fn(*ops).astype(jnp.float32)), (0, 1, 2))
    text = _lowered_for_cuda(grad_fn, *operands)
    calls = [line for line in text.splitlines() if "custom_call @jaxflash_" in line]
    fwd, bwd = (next(c for c in calls if f"@jaxflash_{d}(" in c) for d in ("fwd", "bwd"))
    assert len(calls) == 2, calls
    for call in (fwd, bwd):
      assert _attribute(call, "dims") == [T, S, D, D], name
      scale = float(re.search(r", scale = ([-+.\de]+) : f32", call).group(1))
      assert scale == pytest.approx(1 / np.sqrt(H)), (name, scale)
    # The operand vmapped after its feature axis (v (S, HV, N) or k (S, H, N)) is padded along
    # that axis, axis 1, and reaches the kernels in the physical order (S, N, D).
    S_, F, N_ = case.operands[{"v": "value", "k": "key"}[narrow[0]]]
    assert re.search(rf"stablehlo.pad .*high = \[0, {D - F}, 0\].*tensor<{S_}x{F}x{N_}xbf16>.* "
                     rf"-> tensor<{S_}x{D}x{N_}xbf16>", text), text
    q_k_v = {"k": 1, "v": 2}[narrow[0]]
    assert _layouts(fwd, "operand_layouts")[q_k_v] == [1, 2, 0]
    assert _layouts(bwd, "operand_layouts")[q_k_v] == [1, 2, 0]
    assert _layouts(bwd, "result_layouts")[q_k_v] == [1, 2, 0]  # dk or dv
    for call, slot in ((fwd, narrow[0]), (bwd, narrow[0]), (bwd, narrow[1])):
      assert _slot_strides(call, slot) == [D, N * D, 1], (name, slot)
    # Its gradient is sliced back to its own width.
    assert re.search(rf"stablehlo.slice .*tensor<{S_}x{D}x{N_}xbf16>\) -> "
                     rf"tensor<{S_}x{F}x{N_}xbf16>", text), text


@pytest.mark.parametrize("name", ONE_HEAD_DIM)
def test_one_head_dim_call_under_vmap_equals_the_native_call(name):
  """The CUDA lowering's zero padding to one head dim (kernels.call_with_one_head_dim) run
  around the CPU kernels, on the layouts vmap gives (a vmapped axis behind the feature axis of
  v or of k, K/V shared by every head): the vmapped call and its gradients equal the CPU
  kernels' native Hv ≠ H call to one rounding. On the CPU in every build."""
  case = VMAP_CASES[name]
  with jax.default_device(jax.devices("cpu")[0]):
    operands = case.inputs(3, "float32")
    fn = case.build(jax.vmap)
    cotangent = random_cotangent(fn, operands, 4)
    loss = weighted_sum_loss(fn, cotangent)
    run = lambda: jax.jit(lambda *ops: (fn(*ops), jax.grad(loss, case.differentiable)(*ops)))(
        *operands)
    native = run()
    with reference.one_head_dim_on_cpu() as padded_calls:
      padded = run()
  assert {kernel for kernel, _ in padded_calls} == {"jaxflash_fwd_kernel", "jaxflash_bwd_kernel"}
  for i, (ours, want) in enumerate(zip(jax.tree.leaves(padded), jax.tree.leaves(native))):
    assert ours.shape == want.shape and ours.dtype == want.dtype, (i, ours.shape, want.shape)
    assert_same_kernel(ours, want, "float32", f"{name}: result {i}")


# --------------------------------------------------------------------------------------------
# jit, eval_shape, checkpoint, determinism
# --------------------------------------------------------------------------------------------

MASKING_OPTIONS = {
    "plain": {},
    "causal_residual": dict(is_causal=True, return_residual=True),
    "window_bottom_right": dict(local_window_size=(7, 3), mask_alignment="bottom_right"),
}


@pytest.mark.parametrize("options", list(MASKING_OPTIONS))
def test_jit_equals_eager(options, backend):
  inputs = small_inputs(10, "float16")
  static = MASKING_OPTIONS[options]
  eager = jaxflash.attention(**inputs, **static)
  jitted = jax.jit(functools.partial(jaxflash.attention, **static))(**inputs)
  for i, (e, j) in enumerate(zip(jax.tree.leaves(eager), jax.tree.leaves(jitted))):
    assert_bitwise_equal(j, e, f"jit vs eager, output {i}")


@pytest.mark.parametrize("options", list(MASKING_OPTIONS))
def test_disable_jit_equals_jit(options, backend):
  """Under jax.disable_jit() each primitive still runs as one compiled kernel call."""
  inputs = small_inputs(10, "float16")
  static = MASKING_OPTIONS[options]
  attention = lambda q, k, v: jaxflash.attention(q, k, v, **static)
  loss = lambda q, k, v: jax.tree.leaves(attention(q, k, v))[0].astype(jnp.float32).sum()
  fn = lambda q, k, v: (attention(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
  args = (inputs["query"], inputs["key"], inputs["value"])
  jitted = jax.jit(fn)(*args)
  with jax.disable_jit():
    eager = fn(*args)
  for i, (e, j) in enumerate(zip(jax.tree.leaves(eager), jax.tree.leaves(jitted))):
    assert_bitwise_equal(e, j, f"disable_jit vs jit, output {i}")


@pytest.mark.parametrize("q_shape,kv_shape", [((B, T, N, H), (B, S, 2, H)),
                                               ((T, N, H), (S, 1, H)),
                                               ((T, H), (S, H))],
                         ids=["BTNH", "TNH", "TH"])
@pytest.mark.parametrize("return_residual", [False, True])
def test_eval_shape(q_shape, kv_shape, return_residual, backend):
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  out = jax.eval_shape(functools.partial(jaxflash.attention, return_residual=return_residual),
                       spec(q_shape), spec(kv_shape), spec(kv_shape))
  expected = spec(q_shape)
  if return_residual:
    out, lse = out
    assert (lse.shape, lse.dtype) == (q_shape[:-1], jnp.bfloat16)
  assert (out.shape, out.dtype) == (expected.shape, expected.dtype)

  grads = jax.eval_shape(jax.grad(lambda q, k, v: jnp.sum(
      jaxflash.attention(q, k, v).astype(jnp.float32)), (0, 1, 2)),
      spec(q_shape), spec(kv_shape), spec(kv_shape))
  assert [(g.shape, g.dtype) for g in grads] == [(s, jnp.bfloat16)
                                                 for s in (q_shape, kv_shape, kv_shape)]


@pytest.mark.parametrize("options", list(MASKING_OPTIONS))
def test_checkpoint_grad_equals_grad(options, backend):
  inputs = small_inputs(11, "float32")
  fn = functools.partial(jaxflash.attention, **MASKING_OPTIONS[options])
  operands = (inputs["query"], inputs["key"], inputs["value"])
  loss = weighted_sum_loss(fn, random_cotangent(fn, operands, 12))
  plain = jax.jit(jax.grad(loss, (0, 1, 2)))(*operands)
  for policy in (None, jax.checkpoint_policies.nothing_saveable):
    remat = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), (0, 1, 2)))(*operands)
    for name, r, p in zip(("dq", "dk", "dv"), remat, plain):
      assert_bitwise_equal(r, p, f"checkpoint(policy={policy}) {name}")


# (batch, T, S, repeats) per backend: on the GPU, 60 sequences of 1024 keep every SM busy with
# many key tiles contending for each dQ tile (the deterministic ordering is then exercised),
# 50 times; the CPU kernels take a small case.
DETERMINISM_SIZES = {"cpu": (2, 256, 320, 3), "cuda": (60, 1024, 1024, 50)}


def test_deterministic(backend):
  """Repeated runs give bitwise equal results, forward and backward. GQA with several heads per
  KV head, a bias and a long key axis: the backward accumulates dK/dV across the group and dQ
  across key tiles, where parallel reductions would reorder sums."""
  batch, t, s, repeats = DETERMINISM_SIZES[backend]
  shape_q, shape_kv = (batch, t, 8, 64), (batch, s, 2, 64)
  inputs = random_inputs(13, dict(query=shape_q, key=shape_kv, value=shape_kv), jnp.bfloat16)
  bias = random_inputs(14, dict(bias=(1, 8, t, s)), jnp.bfloat16)["bias"]
  fn = functools.partial(jaxflash.attention, bias=bias, is_causal=True, return_residual=True)
  operands = (inputs["query"], inputs["key"], inputs["value"])
  loss = weighted_sum_loss(fn, random_cotangent(fn, operands, 15))
  run = jax.jit(lambda *ops: (fn(*ops), jax.grad(loss, (0, 1, 2))(*ops)))
  first = jax.tree.leaves(run(*operands))

  # Compared on the device, bit patterns as unsigned integers (so -0.0 != 0.0 and NaNs compare).
  @jax.jit
  def same_bits(a, b):
    bits = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return jnp.all(jax.lax.bitcast_convert_type(a, bits) == jax.lax.bitcast_convert_type(b, bits))

  names = ("out", "lse", "dq", "dk", "dv")
  for repeat in range(repeats):
    again = jax.tree.leaves(run(*operands))
    differ = [name for name, a, f in zip(names, again, first) if not same_bits(a, f)]
    assert not differ, f"repeat {repeat + 1} of {repeats}: {differ} not bitwise equal to the first run"


def test_grad_without_dbias_equals_grad_with_dbias(backend):
  """A bias that is present but not differentiated (the backward skips dbias) changes nothing
  in dq, dk, dv."""
  inputs = small_inputs(17, "float32")
  bias = random_inputs(18, dict(bias=(B, N, T, S)), jnp.float32)["bias"]
  operands = (inputs["query"], inputs["key"], inputs["value"], bias)
  fn = functools.partial(jaxflash.attention, is_causal=True)
  loss = weighted_sum_loss(fn, random_cotangent(fn, operands, 19))
  with_dbias = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*operands)
  without_dbias = jax.jit(jax.grad(loss, (0, 1, 2)))(*operands)
  for name, a, b in zip(("dq", "dk", "dv"), without_dbias, with_dbias):
    assert_bitwise_equal(a, b, name)


# --------------------------------------------------------------------------------------------
# Unsupported differentiation: must raise, never silently return zeros.
# --------------------------------------------------------------------------------------------

def _single_head_operands():
  inputs = small_inputs(16, "float32", q_shape=(T, H), kv_shape=(S, H))
  return inputs["query"], inputs["key"], inputs["value"]


def test_jvp_raises(backend):
  q, k, v = _single_head_operands()
  with pytest.raises(Exception, match=r"(?i)jvp|forward|jaxflash"):
    jax.jvp(jaxflash.attention, (q, k, v), (q, k, v))


def test_jacfwd_raises(backend):
  q, k, v = _single_head_operands()
  with pytest.raises(Exception, match=r"(?i)jvp|forward|jaxflash"):
    jax.jacfwd(lambda q: jaxflash.attention(q, k, v))(q)


def test_second_order_grad_raises_naming_jaxflash(backend):
  q, k, v = _single_head_operands()
  loss = lambda q: jnp.sum(jaxflash.attention(q, k, v) ** 2)
  with pytest.raises(Exception, match="jaxflash"):
    jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(q)
