"""jaxflash.flax_attention as the attention_fn of Flax's attention modules (nnx.MultiHeadAttention and
linen.MultiHeadDotProductAttention), under jit: outputs and gradients (w.r.t. the parameters and
the inputs) match the modules' default attention_fn.

Same rule as test_attention: ours = the module with jaxflash in `dtype`; baseline = the module
with its default attention_fn in `dtype`; reference = the default module computing in float32
at "highest" precision on the same rounded inputs and parameters. The parameters and inputs are
made once on the CPU; the reference and the baseline run there too (reference.on_cpu), only
ours runs on the backend under test. Where ours is float32 on tf32 tensor cores (CUDA at default
precision: jaxflash's kernels and XLA's projections alike), the baseline is the module with
every matmul rounded to tf32: tf32_dot_general for its projections and jax.nn's XLA path with
tf32 matmuls (reference.baseline_attention) as its attention_fn.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax import lax

import jaxflash
import reference
from jaxflash import flax_adapter, primitives

BATCH, LENGTH, FEATURES, NUM_HEADS, QKV_FEATURES = 2, 24, 32, 4, 64  # head dim 16


def _causal_mask(api, dtype):
  return api.make_causal_mask(jnp.ones((BATCH, LENGTH)), dtype=dtype)  # (B, 1, T, T)


def _key_padding_mask(api, dtype):
  """Batch element 1 has its last 7 keys padded (every query still sees a key: Flax's default
  attention averages the values of a fully masked row where jaxflash gives 0)."""
  kv_valid = jnp.arange(LENGTH)[None, :] < jnp.array([[LENGTH], [LENGTH - 7]])
  return api.make_attention_mask(jnp.ones((BATCH, LENGTH), jnp.bool_), kv_valid, dtype=dtype)


def _packed_mask(api, dtype):
  """Documents packed along each row (no padding, see above): make_attention_mask of the
  segment ids with jnp.equal, as Flax models build it."""
  q_ids, kv_ids = jaxflash.segment_ids_from_lengths(jnp.array([[5, 11, 8], [9, 2, 13]]), LENGTH)
  return api.make_attention_mask(q_ids, kv_ids, jnp.equal, dtype=dtype)


def _random_mask(api, dtype):
  """No structure jaxflash recognises: reaches the kernels as a dense mask."""
  mask = jax.random.bernoulli(jax.random.key(7), 0.7, (BATCH, 1, LENGTH, LENGTH))
  return mask.at[..., 0].set(True).astype(dtype)  # every query sees a key (see above)


# Each: the module's mask (from the module API's own helpers), or None. flax_attention runs the
# causal and padding ones as is_causal / sequence lengths, the packed ones as segment ids (and
# is_causal), the random one as a dense mask.
MASKINGS = {
    "no_mask": lambda api: None,
    "causal_mask_float": lambda api: _causal_mask(api, jnp.float32),
    "causal_mask_bool": lambda api: _causal_mask(api, jnp.bool_),
    "key_padding": lambda api: _key_padding_mask(api, jnp.bool_),
    "causal_key_padding": lambda api: api.combine_masks(_causal_mask(api, jnp.bool_),
                                                        _key_padding_mask(api, jnp.bool_)),
    "packed": lambda api: _packed_mask(api, jnp.float32),
    "causal_packed": lambda api: api.combine_masks(_causal_mask(api, jnp.bool_),
                                                   _packed_mask(api, jnp.bool_)),
    "random_mask": lambda api: _random_mask(api, jnp.float32),
}
# One masking per kernel call that flax_attention picks: none, lengths, segment ids, the mask.
KERNEL_CALLS = ["no_mask", "causal_key_padding", "causal_packed", "random_mask"]


def tf32_attention_fn(query, key, value, bias=None, mask=None, *, dropout_rate=0.0,
                      deterministic=True, is_causal=False, **unused):
  """The default attention (jax.nn's XLA path) with tf32 matmuls, in Flax's attention_fn
  convention (the baseline for float32 on tf32 GPUs)."""
  assert dropout_rate == 0.0 or deterministic
  if mask is not None:
    mask = mask.astype(jnp.bool_)
  return reference.baseline_attention(query, key, value, bias, mask, is_causal=is_causal,
                                      tf32=True)


# Runners: (attention_fn, dtype, static call arguments, projections' dot_general or None) ->
# (params, apply(params, x, mask)). The same seed gives every variant the same float32
# parameters; the mask is an argument of apply, so the module can be built on the CPU and run
# elsewhere.

def _nnx_runner(attention_fn, dtype, static_kwargs, dot_general=None):
  model = nnx.MultiHeadAttention(num_heads=NUM_HEADS, in_features=FEATURES,
                                 qkv_features=QKV_FEATURES, dtype=dtype, decode=False,
                                 attention_fn=attention_fn, qkv_dot_general=dot_general,
                                 out_dot_general=dot_general, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)

  def apply(params, x, mask):
    return nnx.merge(graphdef, params)(x, mask=mask, decode=False, **static_kwargs)

  return params, apply


def _linen_runner(attention_fn, dtype, static_kwargs, dot_general=None):
  module = linen.MultiHeadDotProductAttention(num_heads=NUM_HEADS, qkv_features=QKV_FEATURES,
                                              dtype=dtype, decode=False,
                                              attention_fn=attention_fn,
                                              qkv_dot_general=dot_general,
                                              out_dot_general=dot_general)
  # Initialise with the default attention so that every variant gets identical parameters.
  params = module.clone(attention_fn=linen.dot_product_attention).init(
      jax.random.key(0), jnp.zeros((BATCH, LENGTH, FEATURES)), **static_kwargs)

  def apply(params, x, mask):
    return module.apply(params, x, mask=mask, deterministic=True, **static_kwargs)

  return params, apply


RUNNERS = {"nnx": (nnx, _nnx_runner, nnx.dot_product_attention),
           "linen": (linen, _linen_runner, linen.dot_product_attention)}


def _forward_and_grads(apply, params, x, mask, cotangent, precision=None):
  """The module's output and its VJP with `cotangent`: (out, d_params, dx)."""

  @jax.jit
  def run(params, x, mask, cotangent):
    out, vjp = jax.vjp(lambda params, x: apply(params, x, mask), params, x)
    d_params, dx = vjp(cotangent)
    return out, d_params, dx

  if precision is None:
    return run(params, x, mask, cotangent)
  with jax.default_matmul_precision(precision):
    return run(params, x, mask, cotangent)


CASES = [(api, masking, dtype)
         for api in RUNNERS for masking in MASKINGS for dtype in ("float32", "bfloat16")]
CASES += [("nnx", "is_causal", dtype) for dtype in ("float32", "bfloat16")]  # nnx-only argument


@pytest.mark.parametrize("api,masking,dtype", CASES,
                         ids=[f"{a}-{m}-{d}" for a, m, d in CASES])
def test_flax_module_with_jaxflash_matches_default(api, masking, dtype, backend, device):
  flax_api, runner, default_fn = RUNNERS[api]
  static = dict(is_causal=True) if masking == "is_causal" else {}
  # Inputs, mask and parameters are made on the CPU; only ours runs on `device`.
  x, cotangent, mask = reference.made_on_cpu(device, lambda: (
      *reference.random_inputs(jax.random.key(1), dict(x=(BATCH, LENGTH, FEATURES),
                                                       ct=(BATCH, LENGTH, FEATURES)),
                               dtype).values(),
      None if masking == "is_causal" else MASKINGS[masking](flax_api)))

  params, ours_apply = reference.on_cpu(runner, jaxflash.flax_attention, dtype, static)
  ours = _forward_and_grads(ours_apply, jax.device_put(params, device), x, mask, cotangent)

  tf32 = reference.baseline_uses_tf32(backend, dtype)

  def reference_and_baseline(x, mask, cotangent):
    ref_params, ref_apply = runner(default_fn, jnp.float32, static)
    for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
      reference.assert_bitwise_equal(p, r, "the variants must share parameters")
    ref = _forward_and_grads(ref_apply, ref_params, x.astype(jnp.float32), mask,
                             cotangent.astype(jnp.float32), precision="highest")
    _, base_apply = (runner(tf32_attention_fn, dtype, static, reference.tf32_dot_general)
                     if tf32 else runner(default_fn, dtype, static))
    return ref, _forward_and_grads(base_apply, ref_params, x, mask, cotangent)

  ref, base = reference.on_cpu(reference_and_baseline, x, mask, cotangent)

  (ours_out, ours_dparams, ours_dx), (ref_out, ref_dparams, ref_dx), (base_out, base_dparams,
                                                                      base_dx) = ours, ref, base
  assert ours_out.shape == x.shape and ours_out.dtype == x.dtype
  tolerance = reference.compute_name(backend, dtype)
  reference.assert_close(ours_out, ref_out, base_out, tolerance, "out")
  reference.assert_close(ours_dx, ref_dx, base_dx, tolerance, "d inputs")
  names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(ref_dparams)]
  ref_grads = dict(zip(names, jax.tree.leaves(ref_dparams)))
  for name, o, r, b in zip(names, jax.tree.leaves(ours_dparams), jax.tree.leaves(ref_dparams),
                           jax.tree.leaves(base_dparams)):
    # The key projection's bias gets gradient 0 (softmax is invariant to a shift of every
    # logit of a row): a sum over batch and positions of dK that cancels, so its error scales
    # with those terms, which the key kernel's gradient sums too (times unit-scale inputs).
    floor = 1.0
    if "key" in name and "bias" in name:
      floor = max(1.0, float(jnp.max(jnp.abs(ref_grads[name.replace("bias", "kernel")]))))
    reference.assert_close(o, r, b, tolerance, f"d{name}", floor=floor)


def _structure(mask):
  found = jax.jit(flax_adapter.mask_structure)(jnp.asarray(mask, jnp.bool_))
  return int(found.kind), found.query_seq_lengths.tolist(), found.key_value_seq_lengths.tolist()


def test_mask_structure_recognises_causal_and_prefix_padding_masks():
  t_len, s_len = 5, 7
  t = jnp.arange(t_len)[:, None]
  s = jnp.arange(s_len)[None, :]
  q_valid = jnp.arange(t_len)[None, :] < jnp.array([[5], [3]])
  kv_valid = jnp.arange(s_len)[None, :] < jnp.array([[7], [4]])
  padding = q_valid[:, :, None] & kv_valid[:, None, :]
  causal = jnp.broadcast_to(s <= t, (2, t_len, s_len))
  full = jnp.ones((2, t_len, s_len), jnp.bool_)
  fa = flax_adapter
  assert _structure(full) == (fa.PADDING, [5, 5], [7, 7])
  assert _structure(padding) == (fa.PADDING, [5, 3], [7, 4])
  assert _structure(causal) == (fa.CAUSAL_PADDING, [5, 5], [5, 5])
  assert _structure(causal & padding) == (fa.CAUSAL_PADDING, [5, 3], [5, 3])
  kind, q_len, kv_len = _structure(jnp.zeros((2, t_len, s_len), jnp.bool_))  # both structures fit
  assert kind != fa.DENSE and q_len == kv_len == [0, 0]
  # Left padding is not prefix padding, but segments (keys 0 and 1 in none).
  assert _structure(jnp.broadcast_to(s >= 2, (2, t_len, s_len)))[0] == fa.SEGMENTS
  # A window, one stray element: dense.
  assert _structure(causal & (s >= t - 1))[0] == fa.DENSE
  assert _structure(padding.at[1, 4, 0].set(True))[0] == fa.DENSE


def _packed_ids(lengths, total):
  return jaxflash.segment_ids_from_lengths(jnp.array(lengths), total)


def _segment_mask(q_ids, kv_ids, causal=False):
  """(B, T, S): query t sees key s where their ids are equal (and s <= t when causal)."""
  mask = q_ids[:, :, None] == kv_ids[:, None, :]
  t, s = np.arange(q_ids.shape[1])[:, None], np.arange(kv_ids.shape[1])[None, :]
  return mask & (s <= t) if causal else mask


# Rows of documents packed from position 0, some with padding after them, an empty document, a
# row of one document, for T = 37 (T = 53 for the cross-attention keys).
PACKED_37 = [[10, 1, 0, 20], [37, 0, 0, 0], [5, 5, 5, 5]]
PACKED_53 = [[30, 13, 0, 0], [1, 52, 0, 0], [2, 2, 2, 40]]

# Each: () -> a (B, T, S) mask of the segment form, and the kind mask_structure must find.
SEGMENT_MASKS = {
    "packed": (lambda: _segment_mask(*_packed_ids(PACKED_37, 37)), flax_adapter.SEGMENTS),
    "causal_packed": (lambda: _segment_mask(*_packed_ids(PACKED_37, 37), causal=True),
                      flax_adapter.CAUSAL_SEGMENTS),
    # make_attention_mask(ids, ids): the padding queries see the padding keys, one more document.
    "padding_as_a_document": (lambda: _segment_mask(*(_packed_ids(PACKED_37, 37)[0],) * 2),
                              flax_adapter.SEGMENTS),
    "cross_attention": (lambda: _segment_mask(_packed_ids(PACKED_37, 37)[0],
                                              _packed_ids(PACKED_53, 53)[1]),
                        flax_adapter.SEGMENTS),
    "causal_cross_attention": (lambda: _segment_mask(_packed_ids(PACKED_37, 37)[0],
                                                     _packed_ids(PACKED_53, 53)[1], causal=True),
                               flax_adapter.CAUSAL_SEGMENTS),
    # Not contiguous: the mask is still exactly "equal ids", only the kernels skip fewer tiles.
    "documents_interleaved": (lambda: _segment_mask(*(jnp.arange(37)[None, :] % jnp.array(
        [[1], [2], [3]]),) * 2), flax_adapter.SEGMENTS),
}


@pytest.mark.parametrize("name", SEGMENT_MASKS)
def test_mask_structure_recognises_segment_masks(name):
  """The derived ids reproduce the mask exactly (with s <= t for the causal kind), padding
  queries and keys get the packing convention's ids."""
  make_mask, expected_kind = SEGMENT_MASKS[name]
  mask = make_mask()
  found = jax.jit(flax_adapter.mask_structure)(mask)
  assert int(found.kind) == expected_kind
  q_ids, kv_ids = found.query_segment_ids, found.key_value_segment_ids
  assert q_ids.shape == mask.shape[:2] and kv_ids.shape == mask.shape[::2]
  causal = expected_kind == flax_adapter.CAUSAL_SEGMENTS
  assert jnp.array_equal(_segment_mask(q_ids, kv_ids, causal=causal), mask)
  assert jnp.array_equal(q_ids == jaxflash.packing.QUERY_PADDING_ID, ~jnp.any(mask, axis=2))
  assert jnp.array_equal(kv_ids == jaxflash.packing.KEY_VALUE_PADDING_ID, ~jnp.any(mask, axis=1))


def _causal_packed_37():
  return _segment_mask(*_packed_ids(PACKED_37, 37), causal=True)


def _window(mask, size):
  t, s = np.arange(mask.shape[1])[:, None], np.arange(mask.shape[2])[None, :]
  return mask & (s >= t - size)


# Masks one step away from the segment form: each must be classified DENSE.
NEAR_MISSES = {
    "one_element_cleared": lambda: _causal_packed_37().at[0, 20, 15].set(False),
    "one_element_set": lambda: _causal_packed_37().at[0, 20, 3].set(True),
    # Document 3 of row 0 (keys 11-30) also sees the last key of document 0.
    "overlapping_documents": lambda: _causal_packed_37().at[0, 11:31, 9].set(True),
    "one_document_not_causal": lambda: _causal_packed_37().at[2, 5:10, 5:10].set(True),
    "window_inside_documents": lambda: _window(_causal_packed_37(), 4),
}


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_mask_structure_finds_near_misses_dense(name):
  assert _structure(NEAR_MISSES[name]())[0] == flax_adapter.DENSE


def _equations(jaxpr, predicate):
  """The equations of `jaxpr` and of every jaxpr nested in it for which predicate(eqn)."""
  for eqn in jaxpr.eqns:
    if predicate(eqn):
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _equations(sub.jaxpr, predicate)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _equations(sub, predicate)


_is_kernel_call = lambda eqn: eqn.primitive in (primitives.forward_p, primitives.backward_p)
# flax_attention's switch over the mask kinds (not the conds that pick a platform's lowering).
_is_switch = lambda eqn: (eqn.primitive.name == "cond" and not eqn.params.get("branches_platforms")
                          and len(eqn.params["branches"]) == flax_adapter.CAUSAL_SEGMENTS + 1)


def _has_mask_operand(call, t_len, s_len):
  return any(tuple(x.aval.shape[-2:]) == (t_len, s_len) for x in call.invars)


@pytest.mark.parametrize("masking", ["packed", "causal_packed"])
def test_segment_mask_reaches_the_kernels_as_ids(masking):
  """In the jaxpr of the forward and backward, the switch's segment branch calls the kernels
  with (B, T) ids and no T×S operand; its dense branch (the check's control) has the mask; a
  per-head mask is not classified (no switch) and reaches the kernels as it is."""
  t_len = 37
  q = jnp.ones((BATCH, t_len, NUM_HEADS, 16))
  q_ids, kv_ids = _packed_ids(PACKED_37[:BATCH], t_len)
  mask = nnx.make_attention_mask(q_ids, kv_ids, jnp.equal, dtype=jnp.bool_)
  causal = masking == "causal_packed"
  if causal:
    mask = nnx.combine_masks(mask, nnx.make_causal_mask(q_ids, dtype=jnp.bool_))
  kind = flax_adapter.CAUSAL_SEGMENTS if causal else flax_adapter.SEGMENTS
  assert _structure(mask[:, 0])[0] == kind

  loss = lambda q, mask: jnp.sum(jaxflash.flax_attention(q, q, q, mask=mask))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(q, mask).jaxpr
  switches = list(_equations(jaxpr, _is_switch))
  assert len(switches) == 2, "a forward and a backward switch"
  for switch in switches:
    segment_calls = list(_equations(switch.params["branches"][kind].jaxpr, _is_kernel_call))
    dense_calls = list(_equations(switch.params["branches"][flax_adapter.DENSE].jaxpr,
                                  _is_kernel_call))
    assert segment_calls and dense_calls
    for call in segment_calls:
      assert not _has_mask_operand(call, t_len, t_len), call
      ids = [x.aval for x in call.invars if x.aval.shape == (BATCH, t_len)]
      assert len(ids) == 2 and all(a.dtype == jnp.int32 for a in ids), call
    assert all(_has_mask_operand(call, t_len, t_len) for call in dense_calls)

  per_head = jnp.broadcast_to(mask, (BATCH, NUM_HEADS, t_len, t_len))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(q, per_head).jaxpr
  assert not list(_equations(jaxpr, _is_switch))
  calls = list(_equations(jaxpr, _is_kernel_call))
  assert len(calls) == 2 and all(_has_mask_operand(call, t_len, t_len) for call in calls)


# Every conditional but those that pick a platform's lowering.
_is_conditional = lambda eqn: (eqn.primitive.name == "cond"
                               and not eqn.params.get("branches_platforms"))
_is_backward_call = lambda eqn: eqn.primitive == primitives.backward_p


def _nbytes(aval):
  return math.prod(aval.shape) * aval.dtype.itemsize


@pytest.mark.parametrize("masking", ["causal_mask_bool", "causal_key_padding", "packed",
                                     "random_mask"])
def test_mask_path_forward_conditionals_output_one_residual_set(masking):
  """Under jax.grad, the conditionals of the mask path's forward (those without a backward
  kernel call: the classification's and the kernels' switch) output one float32 output-sized
  array, and no more bytes in all than it, the kernels' lse pair and the mask's structure (kind,
  lengths, ids): no copies of q, k and v or of the mask, no second out32 from a nested switch
  (attention.attention_switch says why). bf16, as the benchmark: the output's float32 copy is
  then the only float32 array of its size."""
  shape = (BATCH, LENGTH, NUM_HEADS, 16)
  q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  mask = MASKINGS[masking](nnx).astype(jnp.bool_)
  loss = lambda q, k, v, mask: jnp.sum(jaxflash.flax_attention(q, k, v, mask=mask).astype(
      jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q, mask).jaxpr
  forward = [eqn for eqn in _equations(jaxpr, _is_conditional)
             if not any(any(_equations(branch.jaxpr, _is_backward_call))
                        for branch in eqn.params["branches"])]
  outputs = [v.aval for eqn in forward for v in eqn.outvars]
  out32 = [a for a in outputs if a.dtype == jnp.float32 and tuple(a.shape) == shape]
  assert len(out32) == 1, outputs
  lse2 = math.prod(shape[:-1]) * 2 * 4
  structure = 4 * (1 + 2 * BATCH + 2 * BATCH * LENGTH)  # kind, lengths, ids (T = S)
  assert sum(map(_nbytes, outputs)) <= _nbytes(out32[0]) + lse2 + structure, outputs


def _packed_module_mask(api, t_len, causal):
  """(B, 1, T, T) for three rows of packed documents (padding after them, an empty document,
  one document filling the row), from the module API's helpers."""
  lengths = [[t_len // 3, 1, t_len // 4, t_len // 5], [t_len, 0, 0, 0], [2, 0, t_len // 2, 3]]
  q_ids, kv_ids = jaxflash.segment_ids_from_lengths(jnp.array(lengths), t_len)
  mask = api.make_attention_mask(q_ids, kv_ids, jnp.equal, dtype=jnp.bool_)
  return api.combine_masks(mask, api.make_causal_mask(q_ids, dtype=jnp.bool_)) if causal else mask


PACKED_CASES = [(api, causal, length, dtype) for api in RUNNERS for causal in (False, True)
                for length, dtype in ((37, "float32"), (113, "bfloat16"))]


@pytest.mark.parametrize("api,causal,length,dtype", PACKED_CASES,
                         ids=[f"{a}-{'causal' if c else 'bidirectional'}-T{t}-{d}"
                              for a, c, t, d in PACKED_CASES])
def test_flax_module_with_packed_mask_matches_the_dense_mask_path(api, causal, length, dtype,
                                                                  backend, device):
  """A module's block-diagonal (documents, padding) mask runs as segment ids: the output and the
  gradients (parameters and inputs) match the same module given the mask per head, which
  flax_attention passes to the kernels as it is. Padding rows output 0 on both paths (Flax's
  default attention would average the values there, so it is not the baseline here)."""
  flax_api, runner, _ = RUNNERS[api]
  x, cotangent, mask = reference.made_on_cpu(device, lambda: (
      *reference.random_inputs(jax.random.key(8), dict(x=(3, length, FEATURES),
                                                       ct=(3, length, FEATURES)), dtype).values(),
      _packed_module_mask(flax_api, length, causal)))
  expected_kind = flax_adapter.CAUSAL_SEGMENTS if causal else flax_adapter.SEGMENTS
  assert _structure(mask[:, 0])[0] == expected_kind

  params, apply = reference.on_cpu(runner, jaxflash.flax_attention, dtype, {})
  params = jax.device_put(params, device)
  packed = _forward_and_grads(apply, params, x, mask, cotangent)
  per_head = jnp.broadcast_to(mask, (3, NUM_HEADS, length, length))
  dense = _forward_and_grads(apply, params, x, per_head, cotangent)
  for (path, ours), expected in zip(jax.tree_util.tree_leaves_with_path(packed),
                                    jax.tree.leaves(dense)):
    reference.assert_same_kernel(ours, expected, dtype, jax.tree_util.keystr(path))


def _adapter_inputs(seed: int, device, dtype="float32", value_head_dim=16, amplitude=1):
  """Random q, k, v of (BATCH, LENGTH, NUM_HEADS, 16) (v: value_head_dim features), times
  `amplitude`, on `device`."""
  inputs = reference.random_inputs(jax.random.key(seed), dict(q=(BATCH, LENGTH, NUM_HEADS, 16),
                                                              k=(BATCH, LENGTH, NUM_HEADS, 16),
                                                              v=(BATCH, LENGTH, NUM_HEADS,
                                                                 value_head_dim)), dtype)
  return tuple(jax.device_put(amplitude * x, device) for x in inputs.values())


@pytest.mark.parametrize("masking", ["key_padding", "packed"])
def test_flax_attention_is_causal_on_top_of_a_structured_mask(masking, backend, device):
  """nnx's is_causal with a padding or packed mask: the lengths or ids call becomes its causal
  variant, the same as the dense mask combined with a causal one."""
  q, k, v = _adapter_inputs(9, device)
  mask = MASKINGS[masking](nnx).astype(jnp.bool_)
  ours = jax.jit(lambda q, k, v: jaxflash.flax_attention(q, k, v, mask=mask,
                                                         is_causal=True))(q, k, v)
  expected = jaxflash.attention(q, k, v, mask=mask & _causal_mask(nnx, jnp.bool_))
  np.testing.assert_allclose(ours, expected, *reference.SAME_KERNEL_TOL["float32"])


def test_flax_attention_merges_batch_axes_and_casts_dtype(device):
  """Two batch axes, a (3, 1, 1, S) key-padding mask broadcast over the first, dtype=bfloat16:
  the result matches jax.nn on the flattened batch."""
  inputs = reference.random_inputs(jax.random.key(3), dict(q=(2, 3, 9, 4, 16), k=(2, 3, 9, 4, 16),
                                                           v=(2, 3, 9, 4, 16)), "float32")
  q, k, v = (jax.device_put(x, device) for x in inputs.values())
  mask = (jnp.arange(9) < jnp.array([9, 5, 2])[:, None])[:, None, None, :]
  out = jax.jit(lambda q, k, v, m: jaxflash.flax_attention(q, k, v, mask=m,
                                                           dtype=jnp.bfloat16))(q, k, v, mask)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16

  def flat_jax_nn(q, k, v, mask, dtype):
    flat = lambda x: x.astype(jnp.bfloat16).astype(dtype).reshape((6,) + x.shape[2:])
    dense = jnp.broadcast_to(mask, (2, 3, 1, 9, 9)).reshape(6, 1, 9, 9)
    return jax.nn.dot_product_attention(flat(q), flat(k), flat(v), mask=dense)

  ref, base = (reference.on_cpu(flat_jax_nn, q, k, v, mask, dtype)
               for dtype in (jnp.float32, jnp.bfloat16))
  reference.assert_close(out.reshape((6,) + out.shape[2:]), ref, base, "bfloat16", "out")


@pytest.mark.parametrize("masking", KERNEL_CALLS)
@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "per_head"])
def test_flax_attention_passes_dropout_to_the_kernels(masking, broadcast, device):
  """Dropout (rate > 0, not deterministic) is jaxflash.attention's, bit for bit, whichever
  kernel the mask classification picks (the mask depends on positions only); deterministic=True
  or rate 0 is no dropout."""
  q, k, v = _adapter_inputs(4, device, "bfloat16")
  mask = MASKINGS[masking](nnx)
  rng = jax.random.key(21)
  ours = jax.jit(lambda q, k, v, rng: jaxflash.flax_attention(
      q, k, v, mask=mask, dropout_rng=rng, dropout_rate=0.3, deterministic=False,
      broadcast_dropout=broadcast))(q, k, v, rng)
  dense = None if mask is None else mask.astype(jnp.bool_)
  expected = jaxflash.attention(q, k, v, mask=dense, dropout_rate=0.3, dropout_rng=rng,
                                broadcast_dropout=broadcast)
  assert jnp.array_equal(ours, expected)
  for rate, deterministic in ((0.3, True), (0.0, False)):
    off = jaxflash.flax_attention(q, k, v, mask=mask, dropout_rng=rng, dropout_rate=rate,
                                  deterministic=deterministic)
    assert jnp.array_equal(off, jaxflash.attention(q, k, v, mask=dense))


@pytest.mark.parametrize("masking", KERNEL_CALLS)
def test_flax_attention_passes_the_soft_cap(masking, backend, device):
  """logits_soft_cap, bound with functools.partial, is jaxflash.attention's whichever kernel
  call the mask classification picks."""
  q, k, v = _adapter_inputs(5, device, amplitude=3)
  mask = MASKINGS[masking](nnx)
  capped = functools.partial(jaxflash.flax_attention, logits_soft_cap=2.0)
  ours = jax.jit(lambda q, k, v: capped(q, k, v, mask=mask))(q, k, v)
  dense = None if mask is None else mask.astype(jnp.bool_)
  expected = jaxflash.attention(q, k, v, mask=dense, logits_soft_cap=2.0)
  np.testing.assert_allclose(ours, expected, *reference.SAME_KERNEL_TOL["float32"])
  assert not np.allclose(ours, jaxflash.attention(q, k, v, mask=dense), atol=1e-3)


@pytest.mark.parametrize("masking", KERNEL_CALLS)
def test_flax_attention_passes_segment_ids(masking, backend, device):
  """Segment ids bound with functools.partial are jaxflash.attention's, combined with the
  module's mask whichever kernel call its classification picks, also with two batch axes."""
  q, k, v = _adapter_inputs(6, device)
  mask = MASKINGS[masking](nnx)
  lengths = np.tile(np.array([[3, LENGTH // 2, 1]]), (BATCH, 1))
  q_ids, kv_ids = jaxflash.segment_ids_from_lengths(lengths, LENGTH)
  packed = functools.partial(jaxflash.flax_attention, query_segment_ids=q_ids,
                             key_value_segment_ids=kv_ids)
  ours = jax.jit(lambda q, k, v: packed(q, k, v, mask=mask))(q, k, v)
  dense = None if mask is None else mask.astype(jnp.bool_)
  expected = jaxflash.attention(q, k, v, mask=dense, query_segment_ids=q_ids,
                                key_value_segment_ids=kv_ids)
  np.testing.assert_allclose(ours, expected, *reference.SAME_KERNEL_TOL["float32"])
  two_axes = lambda x: x.reshape((1,) + x.shape)  # batch (1, BATCH)
  ours_2 = jaxflash.flax_attention(two_axes(q), two_axes(k), two_axes(v),
                                   query_segment_ids=two_axes(q_ids),
                                   key_value_segment_ids=two_axes(kv_ids))
  expected_2 = jaxflash.attention(q, k, v, query_segment_ids=q_ids, key_value_segment_ids=kv_ids)
  np.testing.assert_allclose(ours_2[0], expected_2, *reference.SAME_KERNEL_TOL["float32"])


@pytest.mark.parametrize("masking", KERNEL_CALLS)
def test_flax_attention_passes_alibi_slopes(masking, backend, device):
  """ALiBi slopes bound with functools.partial are jaxflash.attention's, per head ((N,)) or per
  batch item and head ((batch..., N), two batch axes merged), whichever kernel call the mask's
  classification picks; the slopes' gradient flows through the adapter (CPU kernels only: on
  CUDA, where the slopes have no gradient yet, the forward alone)."""
  q, k, v = _adapter_inputs(7, device)
  mask = MASKINGS[masking](nnx)
  dense = None if mask is None else mask.astype(jnp.bool_)
  slopes = jax.device_put(jnp.linspace(0.05, 0.8, BATCH * NUM_HEADS).reshape(BATCH, NUM_HEADS),
                          device)
  for given in (slopes[0], slopes):
    ours = jax.jit(lambda q, k, v, s: jaxflash.flax_attention(q, k, v, mask=mask,
                                                              alibi_slopes=s))(q, k, v, given)
    expected = jaxflash.attention(q, k, v, mask=dense, alibi_slopes=given)
    np.testing.assert_allclose(ours, expected, *reference.SAME_KERNEL_TOL["float32"])
  if backend == "cuda":
    return
  two_axes = lambda x: x.reshape((1,) + x.shape)  # batch (1, BATCH)
  loss = lambda s: jnp.sum(jaxflash.flax_attention(two_axes(q), two_axes(k), two_axes(v),
                                                   alibi_slopes=two_axes(s)) ** 2)
  expected_loss = lambda s: jnp.sum(jaxflash.attention(q, k, v, alibi_slopes=s) ** 2)
  np.testing.assert_allclose(jax.grad(loss)(slopes), jax.grad(expected_loss)(slopes),
                             *reference.SAME_KERNEL_TOL["float32"])


@pytest.mark.parametrize("masking", ["no_mask", "causal_key_padding", "random_mask"])
def test_flax_attention_takes_a_value_head_dim(masking, backend, device):
  """A value head dim (24) other than the query/key one (16) is jaxflash.attention's whichever
  kernel call the mask's classification picks, the output shaped with it, also with two batch
  axes."""
  q, k, v = _adapter_inputs(8, device, value_head_dim=24)
  mask = MASKINGS[masking](nnx)
  dense = None if mask is None else mask.astype(jnp.bool_)
  ours = jax.jit(lambda q, k, v: jaxflash.flax_attention(q, k, v, mask=mask))(q, k, v)
  assert ours.shape == (BATCH, LENGTH, NUM_HEADS, 24)
  np.testing.assert_allclose(ours, jaxflash.attention(q, k, v, mask=dense),
                             *reference.SAME_KERNEL_TOL["float32"])
  two_axes = lambda x: x.reshape((1,) + x.shape)  # batch (1, BATCH)
  ours_2 = jaxflash.flax_attention(two_axes(q), two_axes(k), two_axes(v))
  np.testing.assert_allclose(ours_2[0], jaxflash.attention(q, k, v),
                             *reference.SAME_KERNEL_TOL["float32"])


# The kind each masking's mask has (mask_structure's), one per kernel call of the mask path.
KINDS = {"random_mask": flax_adapter.DENSE, "key_padding": flax_adapter.PADDING,
         "causal_key_padding": flax_adapter.CAUSAL_PADDING, "packed": flax_adapter.SEGMENTS,
         "causal_packed": flax_adapter.CAUSAL_SEGMENTS}


def _variant(name):
  """(flax_attention's extra arguments, attention()'s equivalent ones, the shapes of the extra
  differentiable operands or of q, k, v and the cotangent where they change) of a variant of
  the mask path's call."""
  if name == "is_causal":  # nnx's, on top of the mask
    return dict(is_causal=True), {}, {}
  if name == "caller_ids":  # the caller's own ids: the segment kinds run as the dense mask
    ids = jaxflash.segment_ids_from_lengths(np.tile([[3, LENGTH // 2, 1]], (BATCH, 1)), LENGTH)
    ids = dict(zip(("query_segment_ids", "key_value_segment_ids"), ids))
    return ids, ids, {}
  if name == "dropout":
    dropout = dict(dropout_rate=0.3, dropout_rng=jax.random.key(21), broadcast_dropout=False)
    return dict(dropout, deterministic=False), dropout, {}
  if name == "bias":
    return {}, {}, dict(bias=(BATCH, NUM_HEADS, LENGTH, LENGTH))
  if name == "alibi":
    return {}, {}, dict(alibi_slopes=(NUM_HEADS,))
  if name == "gqa":  # two key/value heads for the four query heads
    return {}, {}, dict(k=(BATCH, LENGTH, 2, 16), v=(BATCH, LENGTH, 2, 16))
  if name == "value_head_dim":  # the output (and its cotangent) with the value's 24 features
    return {}, {}, dict(v=(BATCH, LENGTH, NUM_HEADS, 24), ct=(BATCH, LENGTH, NUM_HEADS, 24))
  assert name == "plain"
  return {}, {}, {}


def _switch_over_attention_calls(q, k, v, mask, is_causal, options, found=None,
                                 **differentiable):
  """The mask path before attention_switch: mask_structure's kind (`found`, or found here) picks
  one of the candidate attention() calls by a lax.switch, each call its own custom_vjp."""
  if found is None:
    found = flax_adapter.mask_structure(mask[:, 0])
  kind, calls = flax_adapter.candidates(found, mask, is_causal, options)
  return lax.switch(kind, [functools.partial(jaxflash.attention, q, k, v, **differentiable,
                                             **options, **call) for call in calls])


VARIANTS = ["plain", "is_causal", "caller_ids", "bias", "dropout", "alibi", "gqa",
            "value_head_dim"]
BITWISE_CASES = ([(m, v, "float32") for m in KINDS for v in VARIANTS] +
                 [(m, "plain", "bfloat16") for m in KINDS])


@pytest.mark.parametrize("masking,variant,dtype", BITWISE_CASES,
                         ids=[f"{m}-{v}-{d}" for m, v, d in BITWISE_CASES])
def test_mask_path_equals_the_switch_over_attention_calls(masking, variant, dtype):
  """The mask path (one attention_switch) gives bit for bit the output and the gradients (q, k,
  v, the bias, the ALiBi slopes) of the switch over attention() calls it replaces and of the
  attention() call it picks, for every kind of mask, with nnx's is_causal, the caller's segment
  ids, a bias, dropout, ALiBi, GQA and a value head dim of its own. On the CPU, on every
  machine (the CUDA kernels' run-to-run determinism is not what this checks)."""
  flax_kwargs, options, extra = _variant(variant)
  is_causal = flax_kwargs.get("is_causal", False)

  def run():
    shapes = dict(q=(BATCH, LENGTH, NUM_HEADS, 16), k=(BATCH, LENGTH, NUM_HEADS, 16),
                  v=(BATCH, LENGTH, NUM_HEADS, 16), ct=(BATCH, LENGTH, NUM_HEADS, 16))
    inputs = reference.random_inputs(jax.random.key(11), dict(shapes, **extra), dtype)
    if "alibi_slopes" in inputs:
      inputs["alibi_slopes"] = jnp.linspace(0.05, 0.8, NUM_HEADS)
    cotangent = inputs.pop("ct")
    mask = MASKINGS[masking](nnx).astype(jnp.bool_)
    found = jax.jit(flax_adapter.mask_structure)(mask[:, 0])
    assert int(found.kind) == KINDS[masking]
    kind, calls = flax_adapter.candidates(found, mask, is_causal, options)
    picked = calls[int(kind)]

    paths = {
        "mask path": lambda q, k, v, **d: jaxflash.flax_attention(q, k, v, mask=mask, **d,
                                                                  **flax_kwargs),
        "switch over attention calls": lambda q, k, v, **d: _switch_over_attention_calls(
            q, k, v, mask, is_causal, options, **d),
        "attention call": lambda q, k, v, **d: jaxflash.attention(q, k, v, **d, **options,
                                                                  **picked),
    }

    @jax.jit
    def outputs_and_grads(inputs, cotangent):
      results = {}
      for name, path in paths.items():
        out, vjp = jax.vjp(lambda d: path(**d), inputs)
        results[name] = (out, vjp(cotangent)[0])
      return results

    return outputs_and_grads(inputs, cotangent)

  results = reference.on_cpu(run)
  ours = results.pop("mask path")
  for name, expected in results.items():
    for (path, o), e in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(expected)):
      reference.assert_bitwise_equal(o, e, f"{name}: {jax.tree_util.keystr(path)}")


def test_mask_path_under_vmap_runs_each_items_call():
  """vmap over items whose masks are of every kind: the classification's cond and the kernels'
  switches see a batched index and become selects that run every branch; each item still gets
  its own call's output and gradients, as flax_attention on the item alone."""

  def run():
    items = len(KINDS)
    shape = (items, BATCH, LENGTH, NUM_HEADS, 16)
    inputs = reference.random_inputs(jax.random.key(12), dict(q=shape, k=shape, v=shape,
                                                              ct=shape), "float32")
    masks = jnp.stack([MASKINGS[m](nnx).astype(jnp.bool_) for m in KINDS])

    def out_and_grads(q, k, v, ct, mask):
      out, vjp = jax.vjp(lambda q, k, v: jaxflash.flax_attention(q, k, v, mask=mask), q, k, v)
      return out, vjp(ct)

    operands = (*inputs.values(), masks)
    batched = jax.jit(jax.vmap(out_and_grads))(*operands)
    single = jax.jit(out_and_grads)
    each = [single(*(x[i] for x in operands)) for i in range(items)]
    return batched, jax.tree.map(lambda *xs: jnp.stack(xs), *each)

  batched, each = reference.on_cpu(run)
  for (path, b), e in zip(jax.tree_util.tree_leaves_with_path(batched), jax.tree.leaves(each)):
    reference.assert_same_kernel(b, e, "float32", jax.tree_util.keystr(path))


@pytest.mark.parametrize("spec", [("batch",), ("batch", "seq"), (None, "seq")],
                         ids=["batch", "batch_and_sequence", "sequence"])
def test_mask_switch_splits_over_devices_as_the_attention_calls(spec):
  """q, k and v sharded over 8 CPU devices by batch and/or sequence (the kernels' partitioning:
  shards, or ring attention for sequence-sharded calls it takes, ring.unsupported: not the
  dense mask's): attention_switch's output and gradients equal bit for bit those of the switch
  over attention() calls, each branch split as its attention() call; and flax_attention, which
  classifies the sharded mask itself, gives the same."""
  devices = jax.devices("cpu")
  if len(devices) < 8:
    pytest.skip(f"needs 8 CPU devices, JAX sees {len(devices)}")
  mesh = jax.sharding.Mesh(np.asarray(devices[:8]).reshape(2, 4), ("batch", "seq"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  shape = (4, 64, NUM_HEADS, 16)

  def run():
    inputs = reference.random_inputs(jax.random.key(13), dict(q=shape, k=shape, v=shape,
                                                              ct=shape), "float32")
    cotangent = inputs.pop("ct")
    qkv = [jax.device_put(x, sharding) for x in inputs.values()]
    results = []
    random = jax.random.bernoulli(jax.random.key(7), 0.7, (shape[0], 1, shape[1], shape[1]))
    for mask in (nnx.make_causal_mask(jnp.ones(shape[:2]), dtype=jnp.bool_),
                 random.at[..., 0].set(True)):
      found = jax.jit(flax_adapter.mask_structure)(mask[:, 0])
      for path in (lambda q, k, v: flax_adapter.run_as(found, q, k, v, None, mask, False, {}),
                   lambda q, k, v: _switch_over_attention_calls(q, k, v, mask, False, {},
                                                                found=found),
                   lambda q, k, v: jaxflash.flax_attention(q, k, v, mask=mask)):
        out, vjp = jax.jit(lambda *qkv: jax.vjp(path, *qkv))(*qkv)
        results.append((out, vjp(cotangent)))
    return results

  results = reference.on_cpu(run)
  pairs = list(zip(results[::3], results[1::3])) + list(zip(results[2::3], results[::3]))
  for ours, expected in pairs:
    for (path, o), e in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(expected)):
      reference.assert_bitwise_equal(o, e, jax.tree_util.keystr(path))


def test_mask_path_with_no_keys():
  """Cross-attention to zero keys calls no kernel (attention() returns zeros): attention_switch
  keeps the switch over attention() calls for it; the output and the query's gradient are
  zeros."""
  q = jnp.ones((BATCH, LENGTH, NUM_HEADS, 16))
  kv = jnp.ones((BATCH, 0, NUM_HEADS, 16))
  mask = jnp.ones((BATCH, 1, LENGTH, 0), jnp.bool_)
  attend = lambda q: jaxflash.flax_attention(q, kv, kv, mask=mask)
  out = jax.jit(attend)(q)
  grad = jax.jit(jax.grad(lambda q: jnp.sum(attend(q))))(q)
  assert out.shape == grad.shape == q.shape
  assert not jnp.any(out) and not jnp.any(grad)


def test_nnx_module_trains_with_dropout(device):
  """nnx.MultiHeadAttention with dropout_rate > 0 in training mode: the rngs' dropout stream
  reaches the kernels (two calls draw two masks), gradients are finite, eval mode is the
  deterministic module."""
  with jax.default_device(device):
    module = nnx.MultiHeadAttention(NUM_HEADS, FEATURES, qkv_features=QKV_FEATURES,
                                    dropout_rate=0.5, decode=False,
                                    attention_fn=jaxflash.flax_attention,
                                    rngs=nnx.Rngs(0, dropout=1))
    x = jax.random.normal(jax.random.key(2), (BATCH, LENGTH, FEATURES))
    mask = _causal_mask(nnx, jnp.bool_)

  @nnx.jit
  def loss_and_grad(module, x):
    return nnx.value_and_grad(lambda m: jnp.sum(m(x, mask=mask, deterministic=False) ** 2))(module)

  (loss_a, grads), (loss_b, _) = loss_and_grad(module, x), loss_and_grad(module, x)
  assert bool(jnp.isfinite(loss_a)) and loss_a != loss_b
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(nnx.state(grads)))
  assert jnp.array_equal(module(x, mask=mask, deterministic=True),
                         module(x, mask=mask, deterministic=True))


def test_flax_attention_refuses_what_it_cannot_honour():
  x = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="needs a dropout_rng"):
    jaxflash.flax_attention(x, x, x, dropout_rate=0.1, deterministic=False)
  with pytest.raises(ValueError, match="sow its attention weights"):
    jaxflash.flax_attention(x, x, x, module=object())
  with pytest.raises(ValueError, match="custom attention einsums"):
    jaxflash.flax_attention(x, x, x, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(ValueError, match="batch axes"):
    jaxflash.flax_attention(x, x[0], x[0])
