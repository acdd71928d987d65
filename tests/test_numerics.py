"""Hostile numerics, on every backend and kernel variant: NaN in any operand shows up in exactly
the outputs and gradients where jax.nn has NaN, values near the dtype's maximum do not overflow
where jax.nn's result is finite, logits of ~1e4 keep the gradients accurate, and
precision="highest" is float32-accurate (the last two against a float64 reference), and the
longest sequences the CUDA kernels take keep their position arithmetic exact.

Kernel variants: on CUDA, head dims 64 and 128 without a bias take the fast forward (and, in
16 bits on Hopper, the sm_90 backward); a bias or head dim 59 takes the general kernels; float32
at precision="highest" the 3xTF32 ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
import reference

B, T, S, N = 2, 150, 203, 2
VARIANTS = {  # name -> (head dim, with a bias, precision)
    "fast_d64": (64, False, None),
    "fast_d128": (128, False, None),
    "general_d59_bias": (59, True, None),
}
DTYPES = ("float32", "float16", "bfloat16")
# One NaN per case, in a key tile past the first (at 64 keys a tile) and visible to some rows
# under causal masking too.
NAN_AT = {"query": (0, 5, 1, 3), "key": (1, 70, 0, 2), "value": (0, 71, 1, 0),
          "bias": (1, 0, 120, 100)}


def _inputs(key, dtype, head_dim, with_bias, value_scale=1.0):
  keys = jax.random.split(key, 4)
  shape_q, shape_kv = (B, T, N, head_dim), (B, S, N, head_dim)
  inputs = dict(query=jax.random.normal(keys[0], shape_q).astype(dtype),
                key=jax.random.normal(keys[1], shape_kv).astype(dtype),
                # uniform, so that value_scale * it stays below the dtype's maximum
                value=(value_scale * jax.random.uniform(keys[2], shape_kv, minval=-1, maxval=1)
                       ).astype(dtype),
                bias=jax.random.normal(keys[3], (B, N, T, S)).astype(dtype) if with_bias else None)
  return {**dict.fromkeys(reference.NON_DIFFERENTIABLE), **inputs}


def _nan_pattern(tree):
  return [np.isnan(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", list(VARIANTS) + ["dropout_d64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", list(NAN_AT))
def test_nan_propagates_as_in_jax_nn(where, dtype, variant, is_causal, backend, device):
  """With dropout (dropout_d64: the kernels' dropout copies) the reference is jax.nn's math
  restated in XLA with the kernels' own dropout mask (reference.restated_reference_attention):
  a dropped entry is P·0, which is NaN where P is."""
  head_dim, with_bias, precision = VARIANTS.get(variant, (64, False, None))
  dropout = dict(dropout_rate=0.3) if variant.startswith("dropout") else {}
  if where == "bias" and not with_bias:
    pytest.skip("no bias in this variant")

  def make():
    inputs = _inputs(jax.random.key(0), dtype, head_dim, with_bias)
    inputs[where] = inputs[where].at[NAN_AT[where]].set(jnp.nan)
    if dropout:
      inputs["dropout_rng"] = jax.random.key(2)
    cotangent = jax.random.normal(jax.random.key(1), (B, T, N, head_dim)).astype(dtype)
    return inputs, cotangent

  inputs, cotangent = reference.made_on_cpu(device, make)
  options = dict(is_causal=is_causal, precision=precision, **dropout)
  ours = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **options)
  # jax.nn itself, in float32 (NaN does not depend on the dtype; jax.nn's half-precision
  # gradients do not compile on the CPU).
  peer = reference.restated_reference_attention if dropout else jax.nn.dot_product_attention
  theirs = reference.on_cpu(reference.forward_and_grads, peer, reference.upcast_floats(inputs),
                            cotangent, is_causal=is_causal, **dropout)
  names = ["out"] + sorted(ours[1])
  ours_nan = _nan_pattern((ours[0], [ours[1][n] for n in sorted(ours[1])]))
  theirs_nan = _nan_pattern((theirs[0], [theirs[1][n] for n in sorted(theirs[1])]))
  assert ours_nan[0].any(), "the NaN did not reach the output"
  if where == "value" and is_causal:
    # The NaN must reach the queries that see its key (causal: t >= key), and may reach others
    # only as jax.nn does: jax.nn has NaN in every row, multiplying it by the zero probability
    # of a masked key, the kernels only in the rows of a key tile they visit.
    b, key, head, dim = NAN_AT["value"]
    seen = np.zeros_like(theirs_nan[0])
    seen[b, key:, head, dim] = True
    mine, upper = ours_nan.pop(0), theirs_nan.pop(0)
    names.pop(0)
    assert not (seen & ~mine).any(), f"out: finite in {int((seen & ~mine).sum())} rows that see the NaN"
    assert not (mine & ~upper).any(), "out: NaN where jax.nn has none"
  for name, mine, expected in zip(names, ours_nan, theirs_nan):
    if is_causal and name != "out":
      # Under masking the gradients' NaN patterns differ in both directions: jax.nn's dense
      # einsums carry a NaN operand through zero coefficients (0 * NaN) into rows that never see
      # it, which the kernels skip; the kernels' dS = P (dP - delta) is 0 * NaN at masked
      # entries of a visited tile, where jax.nn's mask cuts the gradient. What must hold is that
      # a gradient that jax.nn makes NaN is NaN here too: the fault is never hidden.
      assert mine.any() or not expected.any(), f"{name}: no NaN, jax.nn has {int(expected.sum())}"
      continue
    assert np.array_equal(mine, expected), (
        f"{name}: NaN at {int(mine.sum())} positions, expected {int(expected.sum())}; first "
        f"difference at {tuple(int(i) for i in np.argwhere(mine != expected)[0])}")


# Just below each dtype's largest finite value (bf16 and float32 share float32's range).
NEAR_MAX = {"float32": 1e38, "bfloat16": 3e38, "float16": 6e4}


@pytest.mark.parametrize("variant", list(VARIANTS) + ["highest_d64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_near_the_dtype_maximum_do_not_overflow(dtype, variant, backend, device):
  """The output is a convex combination of rows of V, so it is finite whenever V is; a sum of
  S unnormalised products would not be (S * 3e38 overflows float32)."""
  head_dim, with_bias, precision = VARIANTS.get(variant, (64, False, "highest"))
  if precision and dtype != "float32":
    pytest.skip("precision='highest' selects other kernels for float32 only")
  inputs = reference.made_on_cpu(
      device, lambda: _inputs(jax.random.key(2), dtype, head_dim, with_bias, NEAR_MAX[dtype]))
  arrays = {n: inputs[n] for n in ("query", "key", "value", "bias")}
  ours = jax.jit(lambda **a: jaxflash.attention(**a, precision=precision))(**arrays)
  ref = reference.on_cpu(reference.reference_attention, **reference.upcast_floats(arrays))
  tf32 = reference.baseline_uses_tf32(backend, dtype, precision)
  base = reference.on_cpu(lambda **a: reference.baseline_attention(**a, tf32=tf32), **arrays)
  reference.assert_close(ours, ref, base, reference.compute_name(backend, dtype, precision), "out")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", list(VARIANTS) + ["highest_d64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_keep_the_gradients_accurate(dtype, variant, is_causal, backend, device):
  """Logits of ~1e4 (q and k of ~100): the softmax is near one-hot and the backward recomputes
  P = exp(logit - lse) from an lse whose float32 ulp is ~1e-3, so any rounding of the lse
  between forward and backward moves every P (it did: dv 3e4x jax.nn's error on the CPU, dq 4e3x
  on the H100). The lse the caller gets, and its cotangent, are checked too. At this size float32
  logits themselves carry errors of ~1e-3 (in jax.nn too), so the reference is float64."""
  head_dim, with_bias, precision = VARIANTS.get(variant, (64, False, "highest"))
  if precision and dtype != "float32":
    pytest.skip("precision='highest' selects other kernels for float32 only")
  # On the CUDA kernels this failed before the forward's normaliser took in the rounding of
  # the row's largest P for the P·V product (primitives/softmax.h, softmax_finalize): fp16 on
  # the sm_90 kernels dq / dk 0.25-0.28 against bounds of 0.16-0.25, and float32 on tf32 out
  # 7e-4 against 6.5e-4 (H200 and H100). At logits of 1e4 that P is 2^r, r the offset's own
  # rounding (~2^-9), and on rows attending to one key its rounding is the row's whole error.

  def make():
    inputs = _inputs(jax.random.key(3), dtype, head_dim, with_bias)
    for name in ("query", "key"):
      inputs[name] = (100 * inputs[name].astype(jnp.float32)).astype(dtype)
    cotangents = jax.random.split(jax.random.key(4))
    cotangent = (jax.random.normal(cotangents[0], (B, T, N, head_dim)).astype(dtype),
                 jax.random.normal(cotangents[1], (B, T, N)).astype(dtype))
    return inputs, cotangent

  inputs, cotangent = reference.made_on_cpu(device, make)
  static = dict(is_causal=is_causal, precision=precision, return_residual=True)
  ours, ours_grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **static)
  _, (base, base_grads) = reference.reference_and_baseline(inputs, cotangent, backend=backend,
                                                           **static)
  ref, ref_grads = reference.float64_forward_and_grads(inputs, cotangent, is_causal=is_causal)
  compute = reference.compute_name(backend, dtype, precision)
  for what, o, r, b in zip(("out", "lse"), ours, ref, base):
    reference.assert_close(o, r, b, compute, what)
  for name in ours_grads:
    reference.assert_close(ours_grads[name], ref_grads[name], base_grads[name], compute, name)


# precision="highest" on N(0,1) inputs: (T, S, with a bias, causal).
HIGHEST_CASES = {"self": (128, 128, False, False), "causal": (203, 203, False, True),
                 "bias": (113, 203, True, False), "cross": (37, 1023, False, False)}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(HIGHEST_CASES))
def test_highest_precision_is_float32_accurate(case, head_dim, backend, device):
  """precision="highest" promises float32-accurate products (3xTF32 on CUDA): against float64,
  every output and gradient is within twice the error of XLA's float32 dot (the CPU's, exact)
  plus 1e-5 absolute, which is what an attention library's own float32 tests ask for."""
  T, S, with_bias, is_causal = HIGHEST_CASES[case]

  def make():
    keys = jax.random.split(jax.random.key(5), 6)
    inputs = dict.fromkeys(reference.NON_DIFFERENTIABLE)
    inputs.update(query=jax.random.normal(keys[0], (B, T, N, head_dim)),
                  key=jax.random.normal(keys[1], (B, S, N, head_dim)),
                  value=jax.random.normal(keys[2], (B, S, N, head_dim)),
                  bias=jax.random.normal(keys[3], (B, N, T, S)) if with_bias else None)
    cotangent = (jax.random.normal(keys[4], (B, T, N, head_dim)),
                 jax.random.normal(keys[5], (B, T, N)))
    return inputs, cotangent

  inputs, cotangent = reference.made_on_cpu(device, make)
  static = dict(is_causal=is_causal, precision="highest", return_residual=True)
  ours, ours_grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **static)
  _, (base, base_grads) = reference.reference_and_baseline(inputs, cotangent, backend=backend,
                                                           **static)
  ref, ref_grads = reference.float64_forward_and_grads(inputs, cotangent, is_causal=is_causal)
  results = [("out", ours[0], ref[0], base[0]), ("lse", ours[1], ref[1], base[1])]
  results += [(name, ours_grads[name], ref_grads[name], base_grads[name]) for name in ours_grads]
  for what, o, r, b in results:
    err = np.max(np.abs(np.asarray(o, np.float64) - r))
    base_err = np.max(np.abs(np.asarray(b, np.float64) - r))
    assert err <= 2 * base_err + 1e-5, (
        f"{what}: max|ours - float64| = {err:.3g} > 2 * {base_err:.3g} (XLA float32) + 1e-5")


@functools.partial(jax.jit, static_argnums=1)
def _random_bf16(key, shape):
  """bfloat16 values of random sign and mantissa in ±[1/8, 2), made from 16 random bits each
  (one 32-bit word per pair of elements): jax.random.normal, or bits of uint16, would hold
  4 bytes per element while it converts, too much beside the 8 GiB arrays below."""
  words = jax.random.bits(key, (*shape[:-1], shape[-1] // 2), jnp.uint32)
  bits = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(shape)
  exponent = (0x7C + ((bits >> 7) & 3)) << 7
  return jax.lax.bitcast_convert_type((bits & 0x807F) | exponent, jnp.bfloat16)


# (the long side, head dim, with the backward): what fits beside each other in the memory of
# one H100. At D = 16 a long array's row offsets (t * 16 elements) pass 2**31; the backward of
# 2**28 queries holds a float32 dQ accumulator of 2**28 x 32 (32 GiB), so that case is D = 8.
LONGEST_CASES = {"query_d8": ("query", 8, True), "query_d16_forward": ("query", 16, False),
                 "key_d16": ("key", 16, True)}


@pytest.mark.big_memory
@pytest.mark.parametrize("case", list(LONGEST_CASES))
def test_the_longest_cuda_sequences(case, backend, device):
  """A sequence of CUDA_MAX_SEQLEN - 1 = 2**28 - 1 positions, the longest the CUDA kernels hold
  (32-bit positions), against 37 on the other side. Bottom-right causal with a window of 45 and
  lengths 2 and 3 short of the arrays put the visible band at the far end of the long
  sequence, where the kernels' position, offset and window arithmetic takes its largest
  values. The band is checked against the reference on a slice (the mask written out from
  global positions); everything outside it must be exactly 0 (lse -inf)."""
  longest, head_dim, backward = LONGEST_CASES[case]
  if backend != "cuda":
    pytest.skip("the CUDA kernels' limit (the CPU kernels take any length)")
  n, short, left = jaxflash.contract.CUDA_MAX_SEQLEN - 1, 37, 45
  needs = 56 * 2**30 if backward and longest == "query" else 36 * 2**30
  limit = device.memory_stats().get("bytes_limit", 0)
  if limit < needs:
    pytest.skip(f"needs {needs / 2**30:.0f} GiB of device memory, {limit / 2**30:.0f} GiB "
                "available (XLA_PYTHON_CLIENT_MEM_FRACTION)")
  T, S = (n, short) if longest == "query" else (short, n)
  q_len, kv_len = T - 2, S - 3
  keys = jax.random.split(jax.random.key(9), 5)
  q, k, v = (_random_bf16(key, (1, length, 1, head_dim))
             for key, length in zip(keys, (T, S, S)))
  cotangent = (_random_bf16(keys[3], (1, T, 1, head_dim)), _random_bf16(keys[4], (1, T, 1, 2))[..., 0])

  # The band: the last 128 positions of the long side, all of the short one.
  t0, s0 = max(0, T - 128), max(0, S - 128)
  t, s = np.arange(t0, T)[:, None], np.arange(s0, S)[None, :]
  diagonal = s - t - (kv_len - q_len)
  visible = (t < q_len) & (s < kv_len) & (diagonal <= 0) & (diagonal >= -left)
  assert visible.any(axis=1).sum() >= 30, "the band must hold the visible rows (a test bug)"
  band = jax.device_get({**dict.fromkeys(reference.NON_DIFFERENTIABLE), "query": q[:, t0:],
                         "key": k[:, s0:], "value": v[:, s0:], "mask": visible[None, None]})
  band_cotangent = jax.device_get(tuple(c[:, t0:] for c in cotangent))

  inputs = {**dict.fromkeys(reference.NON_DIFFERENTIABLE), "query": q, "key": k, "value": v,
            "query_seq_lengths": jnp.array([q_len], jnp.int32),
            "key_value_seq_lengths": jnp.array([kv_len], jnp.int32)}
  static = dict(is_causal=True, local_window_size=(left, 0), mask_alignment="bottom_right",
                return_residual=True)
  if backward:
    ours, grads = reference.forward_and_grads(jaxflash.attention, inputs, cotangent, **static)
  else:
    ours = jax.jit(functools.partial(jaxflash.attention, **static))(**inputs)
    grads = {}
  del q, k, v, inputs, cotangent  # (ours' outputs stay alive until the end; the inputs need not)
  (ref, ref_grads), (base, base_grads) = reference.reference_and_baseline(
      band, band_cotangent, backend=backend, return_residual=True)

  outside = {"out": ours[0][:, :t0], "lse": ours[1][:, :t0]}
  outside.update({name: g[:, :t0] if name == "dq" else g[:, :s0] for name, g in grads.items()})
  for name, x in outside.items():
    expected = -jnp.inf if name == "lse" else 0
    assert bool(jnp.all(x == expected)), f"{name}: not {expected} outside the visible band"
  for name, o, r, b in (("out", ours[0], ref[0], base[0]), ("lse", ours[1], ref[1], base[1])):
    reference.assert_close(o[:, t0:], r, b, "bfloat16", name)
  for name, g in grads.items():
    cut = g[:, t0:] if name == "dq" else g[:, s0:]
    reference.assert_close(cut, ref_grads[name], base_grads[name], "bfloat16", name)
