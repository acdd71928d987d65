"""The forward and backward attention primitives that jaxflash.attention binds.

``jaxflash_fwd``: (q, k, v, bias, mask, q_lens, kv_lens, seed) -> (o, lse)
``jaxflash_bwd``: (q, k, v, bias, mask, q_lens, kv_lens, seed, lse, delta, d_o)
                  -> (dq, dk, dv, dbias)

They describe the whole (global) problem. Each has an abstract evaluation, a
batching rule that folds the vmapped axis into the kernel's instance space (one
custom call per direction, whatever the vmap nesting, and no transpose or copy
of the operands; except on CUDA for an operand vmapped on an axis after its head
dim, see kernels._cuda_lowering), and a lowering through the partitioning stage
(jaxflash/partitioning.py), which splits the call over the devices that its
operands are sharded on and binds the kernel primitives (jaxflash/kernels.py)
on each device's shard.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax._src import dispatch
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from jaxflash import kernels, partitioning
from jaxflash.kernels import (BACKWARD_INPUTS, FORWARD_INPUTS, KernelConfig, forward_avals,
                              gradient_avals)
from jaxflash.layout import drop_col, insert_axis


def _eager(primitive):
  return lambda *args, config: jax.jit(lambda *a: primitive.bind(*a, config=config))(*args)


# ---------------------------------------------------------------- forward

forward_p = core.Primitive("jaxflash_fwd")
forward_p.multiple_results = True
forward_p.def_abstract_eval(lambda q, *rest, config: forward_avals(q, config))
forward_p.def_impl(_eager(forward_p))


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


def _forward_batch(primitive):
  def rule(args, dims, *, config):
    config, axis = _new_instance_axis(config, FORWARD_INPUTS, args, dims)
    # The output follows q's layout (the vmapped axis where q has it, else in
    # front); lse is the output's layout without the feature axis.
    o_dim = dims[0] if dims[0] is not None else 0
    o_layout = insert_axis(config.layout("o"), o_dim, axis)
    lse_layout = drop_col(o_layout)
    config = config.with_layouts({"o": o_layout, "lse": lse_layout})
    return primitive.bind(*args, config=config), (o_dim, lse_layout.index(axis))
  return rule


# The kernel primitives are bound inside ring attention (jaxflash/ring.py), which a
# shard_map user may vmap; the rules are the same.
batching.primitive_batchers[forward_p] = _forward_batch(forward_p)
batching.primitive_batchers[kernels.forward_kernel_p] = _forward_batch(kernels.forward_kernel_p)


# ---------------------------------------------------------------- backward

backward_p = core.Primitive("jaxflash_bwd")
backward_p.multiple_results = True
backward_p.def_abstract_eval(
    lambda q, k, v, bias, *rest, config: gradient_avals(q, k, v, bias, config))
backward_p.def_impl(_eager(backward_p))


def _backward_batch(primitive, extra_results: int):
  def rule(args, dims, *, config):
    config, axis = _new_instance_axis(config, BACKWARD_INPUTS, args, dims)
    # Every gradient is per vmapped instance, also for an operand that was not
    # batched (JAX sums those afterwards); each lands where its operand had the
    # vmapped axis, else in front.
    updates, out_dims = {}, []
    for grad, operand in (("dq", 0), ("dk", 1), ("dv", 2), ("dbias", 3)):
      if config.layout(grad) is None:
        out_dims.append(None)
        continue
      d = dims[operand] if dims[operand] is not None else 0
      updates[grad] = insert_axis(config.layout(grad), d, axis)
      out_dims.append(d)
    config = config.with_layouts(updates)
    return primitive.bind(*args, config=config), tuple(out_dims) + (None,) * extra_results
  return rule


batching.primitive_batchers[backward_p] = _backward_batch(backward_p, 0)
batching.primitive_batchers[kernels.backward_kernel_p] = _backward_batch(
    kernels.backward_kernel_p, 1)  # the workspace


def _no_higher_derivatives(primals, tangents, *, config):
  del primals, tangents, config
  raise NotImplementedError(
      "jaxflash.attention supports first derivatives (jax.grad, jax.vjp) only; "
      "forward-mode (jax.jvp, jax.jacfwd) and second derivatives are not implemented.")


ad.primitive_jvps[forward_p] = _no_higher_derivatives
ad.primitive_jvps[backward_p] = _no_higher_derivatives


# ---------------------------------------------------------------- lowering

mlir.register_lowering(forward_p, mlir.lower_fun(partitioning.forward, multiple_results=True))
mlir.register_lowering(backward_p, mlir.lower_fun(partitioning.backward, multiple_results=True))
# The partitioning stage needs the devices of the computation while lowering (as custom
# partitioning does), to build its mesh.
dispatch.prim_requires_devices_during_lowering.update((forward_p, backward_p))
