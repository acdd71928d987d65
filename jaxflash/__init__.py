"""jaxflash: FlashAttention for JAX.

``jaxflash.attention`` is a drop-in for ``jax.nn.dot_product_attention`` that
runs jaxflash's own kernels (C++ on CPU, CUDA on NVIDIA GPUs) through XLA FFI;
``jaxflash.flax_attention`` is the same as the ``attention_fn`` of Flax's attention modules.
"""

from jaxflash.attention import attention
from jaxflash.dropout import dropout_mask
from jaxflash.flax_adapter import flax_attention
from jaxflash.primitives import PLATFORMS

__version__ = "0.1.0"


def backends() -> tuple[str, ...]:
  """The platforms this build of jaxflash has kernels for, e.g. ``("cpu", "cuda")``."""
  return PLATFORMS


__all__ = ["attention", "backends", "dropout_mask", "flax_attention", "__version__"]
