"""The forward and backward attention primitives that jaxflash.attention binds.

``jaxflash_fwd``: (q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids,
                   kv_segment_ids, alibi_slopes, scale) -> (o, lse)
``jaxflash_bwd``: (q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids,
                  kv_segment_ids, alibi_slopes, scale, lse, delta, d_o, dscale_centre,
                  dalibi_centre)
                  -> (dq, dk, dv, dbias, dalibi, dscale)

lse is the kernels' base-2 logsumexp (jaxflash/kernels.py). They describe the
whole (global) problem. Each has an abstract evaluation, the
batching rule of the kernel primitive of its direction (jaxflash/kernels.py:
one custom call per direction, whatever the vmap nesting, and no transpose or
copy of the operands; except on CUDA for an operand vmapped on an axis after its
head dim, see kernels._cuda_lowering), and a lowering through the partitioning
stage (jaxflash/partitioning.py), which splits the call over the devices that
its operands are sharded on and binds the kernel primitives on each device's
shard.
"""

from __future__ import annotations

import functools

from jax._src import dispatch
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from jaxflash import partitioning
from jaxflash.kernels import (backward_batching_rule, forward_avals, forward_batching_rule,
                              gradient_avals)


def _eager(primitive):
  """Outside jit, a bind compiles and runs the primitive alone. JAX's apply_primitive lifts
  jax.disable_jit() for that one call: under it, a plain jax.jit would call back into bind."""
  return functools.partial(dispatch.apply_primitive, primitive)


# ---------------------------------------------------------------- forward

forward_p = core.Primitive("jaxflash_fwd")
forward_p.multiple_results = True
forward_p.def_abstract_eval(lambda q, *rest, config: forward_avals(q, config))
forward_p.def_impl(_eager(forward_p))
batching.primitive_batchers[forward_p] = forward_batching_rule(forward_p, 0)


# ---------------------------------------------------------------- backward

backward_p = core.Primitive("jaxflash_bwd")
backward_p.multiple_results = True
backward_p.def_abstract_eval(
    lambda q, k, v, bias, *rest, config: gradient_avals(q, k, v, bias, config))
backward_p.def_impl(_eager(backward_p))
batching.primitive_batchers[backward_p] = backward_batching_rule(backward_p, 0)


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
