"""jaxflash: FlashAttention for JAX.

Public API:

- ``jaxflash.attention``: a drop-in for ``jax.nn.dot_product_attention`` (same arguments,
  layouts and dtypes, plus attention dropout) computed by jaxflash's own kernels, C++ on the
  CPU and CUDA on NVIDIA GPUs, called through XLA FFI. Memory is O(N) in the sequence length.
- ``jaxflash.flax_attention``: the same kernels as the ``attention_fn`` of Flax's attention
  modules (``flax.linen.MultiHeadDotProductAttention``, ``flax.nnx.MultiHeadAttention``).
- ``jaxflash.ring_attention``: attention over a sequence sharded along a mesh axis, inside
  ``jax.shard_map`` (ring attention); ``jaxflash.zigzag_order`` lays a sequence out in the
  order that balances causal attention over the ring. Under ``jax.jit``, ``attention`` itself
  splits over the devices its operands are sharded on (batch, heads, sequence).
- ``jaxflash.segment_ids_from_lengths``: packed sequences' segment ids (``attention``'s
  ``query_segment_ids`` / ``key_value_segment_ids``) from the lengths of each row's documents.
- ``jaxflash.dropout_mask``: the boolean keep-mask that attention dropout applies for a key,
  for debugging and reference implementations.
- ``jaxflash.backends()``: the platforms this build has kernels for.
- ``jaxflash.__version__``: the package version (the distribution's version is read from it).

``python -m jaxflash`` checks the installed build against ``jax.nn.dot_product_attention``
and times it; README.md covers installation, and docs/DESIGN.md the design.
"""

# Before the imports below: jaxflash.native checks the extension against it.
__version__ = "0.1.0"

from jaxflash.attention import attention, ring_attention
from jaxflash.dropout import dropout_mask
from jaxflash.flax_adapter import flax_attention
from jaxflash.kernels import PLATFORMS
from jaxflash.packing import segment_ids_from_lengths
from jaxflash.ring import zigzag_order


def backends() -> tuple[str, ...]:
  """The platforms this build of jaxflash has kernels for: ``("cpu",)`` or ``("cpu", "cuda")``.

  ``"cuda"`` is there when the build found a CUDA compiler (CMake's ``JAXFLASH_CUDA``,
  ``auto`` by default). It says what was compiled, not what this process can run: the CUDA
  kernels also need JAX's CUDA plugin and a GPU whose architecture the build included
  (``JAXFLASH_CUDA_ARCHITECTURES``). ``jax.default_backend()`` says where JAX runs.
  """
  return PLATFORMS


__all__ = ["attention", "backends", "dropout_mask", "flax_attention", "ring_attention",
           "segment_ids_from_lengths", "zigzag_order", "__version__"]
