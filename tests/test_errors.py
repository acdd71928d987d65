"""Bad inputs raise ValueError/TypeError at trace time, and the message names the offending
argument and what was given (so a user can fix the call without reading jaxflash's source).

Each case is a valid call with exactly one thing changed, given as overrides of VALID.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir

import jaxflash
from jaxflash import kernels, validation
from jaxflash.contract import Flag

B, T, S, N, K, H = 2, 8, 12, 4, 2, 16


def _array(shape, dtype=np.float32):
  # NumPy, not jax arrays: the cases are built at import (collection) time, before the backend
  # fixture chooses a device, and must not initialise a GPU then.
  return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _valid():
  return dict(query=_array((B, T, N, H)), key=_array((B, S, K, H)), value=_array((B, S, K, H)))


# name -> (overrides of the valid call, argument-name pattern, patterns for what was given).
# The argument pattern allows the natural alternatives (e.g. a head-dim mismatch may be
# reported on query or on key); every "given" pattern must appear in the message.
ERROR_CASES = {
    "query_rank_5": (dict(query=_array((1, B, T, N, H))), r"query", [r"5|\(1, 2, 8, 4, 16\)"]),
    "query_rank_1": (dict(query=_array((H,))), r"query", [r"\b1\b|\(16,\)"]),
    "key_rank_mismatch": (dict(key=_array((S, K, H)), value=_array((S, K, H))), r"key|query",
                          [r"3|\(12, 2, 16\)"]),
    "dtype_mismatch_query_key": (dict(query=_array((B, T, N, H), np.float16)), r"query|key",
                                 [r"float16", r"float32"]),
    "dtype_mismatch_key_value": (dict(value=_array((B, S, K, H), jnp.bfloat16)), r"value|key",
                                 [r"bfloat16"]),
    "integer_inputs": (dict(query=_array((B, T, N, H), np.int32),
                            key=_array((B, S, K, H), np.int32),
                            value=_array((B, S, K, H), np.int32)), r"query", [r"int32"]),
    "head_dim_mismatch": (dict(key=_array((B, S, K, 32)), value=_array((B, S, K, 32))),
                          r"query|key|head", [r"16", r"32"]),
    "heads_not_multiple_of_kv_heads": (dict(key=_array((B, S, 3, H)), value=_array((B, S, 3, H))),
                                       r"head", [r"4", r"3"]),
    "head_dim_above_256": (dict(query=_array((B, T, N, 320)), key=_array((B, S, K, 320)),
                                value=_array((B, S, K, 320))), r"head|query", [r"320"]),
    "batch_mismatch": (dict(key=_array((3, S, K, H)), value=_array((3, S, K, H))),
                       r"batch|query|key", [r"2", r"3"]),
    "seq_mismatch_key_value": (dict(value=_array((B, S + 1, K, H))), r"value|key", [r"13"]),
    # The value head dim may differ from the query/key one, up to 256 like it.
    "value_head_dim_above_256": (dict(value=_array((B, S, K, 320))), r"value",
                                 [r"320", r"256"]),
    "kv_heads_mismatch_key_value": (dict(value=_array((B, S, 1, H))), r"value|key", [r"1"]),
    "bias_not_broadcastable": (dict(bias=_array((1, 1, T - 1, S))), r"bias", [r"7"]),
    "bias_rank_5": (dict(bias=_array((1, 1, 1, T, S))), r"bias", [r"5|\(1, 1, 1, 8, 12\)"]),
    "mask_not_bool": (dict(mask=np.ones((B, 1, T, S), np.float32)), r"mask", [r"float32"]),
    "mask_int": (dict(mask=np.ones((B, 1, T, S), np.int32)), r"mask", [r"int32"]),
    "mask_not_broadcastable": (dict(mask=np.ones((B, 1, T, S - 1), bool)), r"mask", [r"11"]),
    "query_seq_lengths_wrong_shape": (dict(query_seq_lengths=np.array([1, 2, 3], np.int32)),
                                      r"query_seq_lengths", [r"3"]),
    "key_value_seq_lengths_rank_2": (
        dict(key_value_seq_lengths=np.ones((B, 1), np.int32)), r"key_value_seq_lengths",
        [r"\(2, 1\)"]),
    "query_seq_lengths_float": (dict(query_seq_lengths=np.array([1.0, 2.0], np.float32)),
                                r"query_seq_lengths", [r"float32"]),
    "key_value_seq_lengths_float": (dict(key_value_seq_lengths=np.array([1.0, 2.0], np.float32)),
                                    r"key_value_seq_lengths", [r"float32"]),
    "window_negative_int": (dict(local_window_size=-1), r"local_window_size", [r"-1"]),
    "window_negative_in_tuple": (dict(local_window_size=(3, -2)), r"local_window_size",
                                 [r"-2"]),
    "window_tuple_length_3": (dict(local_window_size=(1, 2, 3)), r"local_window_size",
                              [r"\(1, 2, 3\)|3"]),
    "window_2_to_the_63": (dict(local_window_size=2**63), r"local_window_size",
                           [r"9223372036854775808", r"2\*\*31"]),
    "window_int64_max_in_tuple": (dict(local_window_size=(2**63 - 1, 0)), r"local_window_size",
                                  [r"9223372036854775807", r"2\*\*31"]),
    "implementation_cudnn": (dict(implementation="cudnn"), r"implementation", [r"cudnn"]),
    "implementation_xla": (dict(implementation="xla"), r"implementation", [r"xla"]),
    "mask_alignment_middle": (dict(mask_alignment="middle"), r"mask_alignment", [r"middle"]),
    "scale_not_a_number": (dict(scale="large"), r"scale", [r"large"]),
    "scale_nan": (dict(scale=float("nan")), r"scale", [r"nan", r"finite"]),
    "scale_complex": (dict(scale=1j), r"scale", [r"1j", r"float"]),
    # Arrays: traced under jit (the learned-temperature case), concrete when eager.
    "scale_not_scalar": (dict(scale=np.ones((2,), np.float32)), r"scale", [r"\(2,\)", r"\(\)"]),
    "scale_shape_1": (dict(scale=np.ones((1,), np.float32)), r"scale", [r"\(1,\)", r"\(\)"]),
    "scale_int32_array": (dict(scale=np.array(2, np.int32)), r"scale", [r"int32", r"float"]),
    "scale_complex_array": (dict(scale=np.array(1 + 1j, np.complex64)), r"scale",
                            [r"complex64", r"float"]),
    "precision_unknown_name": (dict(precision="fp64"), r"precision", [r"fp64", r"highest"]),
    "precision_not_a_name": (dict(precision=3), r"precision", [r"\b3\b"]),
    "soft_cap_zero": (dict(logits_soft_cap=0.0), r"logits_soft_cap", [r"0\.0", r"> 0"]),
    "soft_cap_negative": (dict(logits_soft_cap=-30.0), r"logits_soft_cap", [r"-30"]),
    "soft_cap_nan": (dict(logits_soft_cap=float("nan")), r"logits_soft_cap", [r"nan"]),
    "soft_cap_inf": (dict(logits_soft_cap=float("inf")), r"logits_soft_cap", [r"inf"]),
    "soft_cap_bool": (dict(logits_soft_cap=True), r"logits_soft_cap", [r"True"]),
    "soft_cap_string": (dict(logits_soft_cap="30"), r"logits_soft_cap", [r"'30'"]),
    "query_segment_ids_alone": (dict(query_segment_ids=np.zeros((B, T), np.int32)),
                                r"query_segment_ids", [r"without key_value_segment_ids"]),
    "key_value_segment_ids_alone": (dict(key_value_segment_ids=np.zeros((B, S), np.int32)),
                                    r"key_value_segment_ids", [r"without query_segment_ids"]),
    "query_segment_ids_wrong_length": (
        dict(query_segment_ids=np.zeros((B, S), np.int32),
             key_value_segment_ids=np.zeros((B, S), np.int32)),
        r"query_segment_ids", [r"\(2, 12\)", r"\(2, 8\)"]),
    "key_value_segment_ids_wrong_batch": (
        dict(query_segment_ids=np.zeros((B, T), np.int32),
             key_value_segment_ids=np.zeros((1, S), np.int32)),
        r"key_value_segment_ids", [r"\(1, 12\)", r"\(2, 12\)"]),
    "query_segment_ids_rank_1": (
        dict(query_segment_ids=np.zeros((T,), np.int32),
             key_value_segment_ids=np.zeros((B, S), np.int32)),
        r"query_segment_ids", [r"\(8,\)"]),
    "segment_ids_float": (
        dict(query_segment_ids=np.zeros((B, T), np.float32),
             key_value_segment_ids=np.zeros((B, S), np.int32)),
        r"query_segment_ids", [r"float32"]),
    "segment_ids_bool": (
        dict(query_segment_ids=np.zeros((B, T), np.int32),
             key_value_segment_ids=np.zeros((B, S), bool)),
        r"key_value_segment_ids", [r"bool"]),
    "alibi_slopes_wrong_heads": (dict(alibi_slopes=_array((N + 1,))), r"alibi_slopes",
                                 [r"\(5,\)", r"\(4,\)"]),
    "alibi_slopes_wrong_batch": (dict(alibi_slopes=_array((3, N))), r"alibi_slopes",
                                 [r"\(3, 4\)", r"\(2, 4\)"]),
    "alibi_slopes_rank_3": (dict(alibi_slopes=_array((B, N, 1))), r"alibi_slopes",
                            [r"\(2, 4, 1\)"]),
    "alibi_slopes_per_kv_head": (dict(alibi_slopes=_array((K,))), r"alibi_slopes",
                                 [r"\(2,\)", r"\(4,\)"]),
    "alibi_slopes_int": (dict(alibi_slopes=np.ones((N,), np.int32)), r"alibi_slopes", [r"int32"]),
}


@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_input_raises_naming_argument(name, under_jit, backend):
  overrides, argument, given = ERROR_CASES[name]
  call = dict(_valid(), **overrides)
  arrays = {k: v for k, v in call.items() if isinstance(v, (jax.Array, np.ndarray))}
  options = {k: v for k, v in call.items() if k not in arrays}
  fn = lambda **arrays: jaxflash.attention(**arrays, **options)
  if under_jit:  # the checks must run at trace time, not only on concrete values
    fn = jax.jit(fn)
  with pytest.raises((ValueError, TypeError)) as excinfo:
    jax.block_until_ready(fn(**arrays))
  message = str(excinfo.value)
  assert re.search(argument, message), f"message does not name {argument!r}: {message!r}"
  for pattern in given:
    assert re.search(pattern, message), f"message does not show {pattern!r}: {message!r}"


def test_valid_call_does_not_raise(backend):
  """The base of every case above is valid: each error comes from its one change."""
  out = jaxflash.attention(**_valid())
  assert out.shape == (B, T, N, H)


def test_lengths_beyond_int32_raise(backend):
  """Concrete lengths are range-checked before conversion, which would wrap 2**32 + 5 to 5."""
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must fit in int32.*4294967301"):
    jaxflash.attention(**_valid(), key_value_seq_lengths=np.array([2**32 + 5, 3]))


def test_lengths_of_a_jax_array_must_be_int32(backend):
  """A JAX array may be traced, so only its dtype can be checked: int32, as jax.nn."""
  with pytest.raises(TypeError, match=r"query_seq_lengths must be an int32 array, got uint32"):
    jaxflash.attention(**_valid(), query_seq_lengths=jnp.array([3, 5], jnp.uint32))


def test_segment_ids_beyond_int32_raise(backend):
  """Concrete wide ids are range-checked: a wrapping cast could make two different ids equal."""
  with pytest.raises(ValueError, match=r"key_value_segment_ids must fit in int32.*4294967296"):
    jaxflash.attention(**_valid(), query_segment_ids=np.zeros((B, T), np.int64),
                       key_value_segment_ids=np.full((B, S), 2**32, np.int64))


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int64, np.uint32])
def test_segment_ids_of_other_integer_dtypes(dtype, backend):
  """Narrow integer ids are cast to int32, as are wide ones whose (concrete) values fit: the
  same result as int32 ids."""
  if backend == "cuda":
    pytest.skip("the CUDA kernels have no segment ids yet (test_attention checks the refusal)")
  ids = np.array([[0] * (T // 2) + [1] * (T - T // 2)] * B)
  kv_ids = np.array([[0] * (S // 2) + [1] * (S - S // 2)] * B)
  want = jaxflash.attention(**_valid(), query_segment_ids=ids.astype(np.int32),
                            key_value_segment_ids=kv_ids.astype(np.int32))
  got = jaxflash.attention(**_valid(), query_segment_ids=ids.astype(dtype),
                           key_value_segment_ids=kv_ids.astype(dtype))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_traced_wide_segment_ids_raise(backend):
  """A traced uint32 id array cannot be range-checked, so it is refused, saying how to cast."""
  fn = jax.jit(lambda ids, kv_ids: jaxflash.attention(**_valid(), query_segment_ids=ids,
                                                      key_value_segment_ids=kv_ids))
  with pytest.raises(TypeError, match=r"query_segment_ids must be int32 .*uint32.*astype"):
    fn(jnp.zeros((B, T), jnp.uint32), jnp.zeros((B, S), jnp.uint32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_alibi_slopes_raise(bad, backend):
  """Concrete slopes are checked for NaN and inf (either would turn whole rows into NaN);
  traced ones cannot be."""
  slopes = np.array([0.5, bad, 0.25, 0.125], np.float32)
  with pytest.raises(ValueError, match=r"alibi_slopes must be finite.*(nan|inf)"):
    jaxflash.attention(**_valid(), alibi_slopes=slopes)


def test_alibi_and_its_gradient_lower_for_cuda():
  """ALiBi lowers for a GPU, the forward and a backward that differentiates the slopes
  (HAS_DALIBI) alike: the CUDA kernels compute their gradient too."""
  config = validation.validate(**_valid(), alibi_slopes=np.ones((N,), np.float32)).config
  kernels._check_cuda_call(config)
  kernels._check_cuda_call(config.replace(flags=config.flags | Flag.HAS_DALIBI))


@pytest.fixture
def cuda_lowering_rules():
  """The CUDA lowering rules registered as a CUDA build registers them, also in a CPU-only
  build (which lowers for the CPU only: its CUDA rule says so), for one test."""
  if "cuda" in kernels.PLATFORMS:
    yield
    return
  kernels.register_lowerings("cuda")
  try:
    yield
  finally:
    for primitive in (kernels.forward_kernel_p, kernels.backward_kernel_p):
      mlir.register_lowering(primitive, kernels._not_built("cuda"), platform="cuda")


@pytest.mark.parametrize("value_head_dim", [H // 2, 2 * H])
def test_value_head_dim_lowers_for_cuda(value_head_dim, cuda_lowering_rules):
  """A value head dim other than the query/key one, below or above it, is no refusal on CUDA
  (the lowering zero-pads to one head dim: kernels.call_with_one_head_dim), with the slopes'
  gradient too. Lowering only, so it runs in every build."""
  value = _array((B, S, K, value_head_dim))
  kernels._check_cuda_call(validation.validate(**dict(_valid(), value=value)).config)
  q, k = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (_valid()["query"], _valid()["key"]))
  v = jax.ShapeDtypeStruct(value.shape, jnp.float32)
  slopes = jax.ShapeDtypeStruct((N,), jnp.float32)
  loss = lambda q, k, v, s: jnp.sum(jaxflash.attention(q, k, v, alibi_slopes=s))
  lower = lambda argnums: jax.jit(jax.grad(loss, argnums)).trace(q, k, v, slopes).lower(
      lowering_platforms=("cuda",))
  lower((0, 1, 2))
  lower((0, 1, 2, 3))


def test_largest_window_equals_no_window(backend):
  """2**31 - 1, the largest window taken, reaches every key: the same as no window, also in
  the gradients (position arithmetic near the int32 limit must not overflow)."""
  inputs = {name: jnp.asarray(x) for name, x in _valid().items()}

  def run(**options):
    loss = lambda q, k, v: jaxflash.attention(q, k, v, **options).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(*inputs.values())

  for window, same_as in (((2**31 - 1), {}), ((2**31 - 1, 0), dict(is_causal=True)),
                          ((0, 2**31 - 1), dict(local_window_size=(0, 2 * S)))):
    for got, want in zip(jax.tree.leaves(run(local_window_size=window)), jax.tree.leaves(run(**same_as))):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.skipif("cuda" in jaxflash.backends(), reason="this build has CUDA kernels")
def test_lowering_for_a_platform_without_kernels_says_how_to_build_them():
  """A CPU-only build lowered for a GPU (a wheel built where no GPU was visible, run on one)."""
  q = _valid()["query"]
  traced = jax.jit(lambda q: jaxflash.attention(q, q, q)).trace(q)
  with pytest.raises(NotImplementedError, match=r"no CUDA kernels.*JAXFLASH_CUDA=ON"):
    traced.lower(lowering_platforms=("cuda",))


@pytest.mark.skipif("cuda" not in jaxflash.backends(), reason="this build has no CUDA kernels")
@pytest.mark.parametrize("which", ["query", "key"])
def test_sequences_beyond_the_cuda_kernels_positions_raise_when_lowered_for_a_gpu(which):
  """The CUDA kernels hold positions in 32 bits (fewer than 2**28 of them): a longer sequence is
  refused when the call is lowered for a GPU, naming the sequence and the limit, not by the
  kernel at run time. Shapes only (nothing of 2**28 rows is allocated); 2**28 - 1 lowers."""
  def lower(t, s):
    q = jax.ShapeDtypeStruct((1, t, 1, 8), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, s, 1, 8), jnp.bfloat16)
    traced = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v)).trace(q, kv, kv)
    return traced.lower(lowering_platforms=("cuda",))

  too_long = dict(query=(2**28, 5), key=(5, 2**28))[which]
  with pytest.raises(ValueError, match=rf"{which}.* sequence length .* is {2**28}; the CUDA kernels "
                                       r"take fewer than 2\*\*28"):
    lower(*too_long)
  lower(*dict(query=(2**28 - 1, 5), key=(5, 2**28 - 1))[which])
