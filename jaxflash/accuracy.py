"""The accuracy rule jaxflash is held to (shared by the self-check and the tests).

FlashAttention's rule: against a float32 reference computed on the same
(rounded) inputs, our error may be at most twice the error of the plain
``jax.nn.dot_product_attention`` run in the input dtype, plus a small absolute
tolerance tied to the dtype's rounding and the reference's magnitude.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Per-dtype absolute tolerance, relative to max(1, max|reference|): a few
# units of the dtype's rounding (float32 also covers summation-order effects
# over long sequences).
ATOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.float16): 1e-3,
        jnp.dtype(jnp.bfloat16): 4e-3}


def max_abs_error(x, reference) -> float:
  """max |x - reference| in float64; inf if x has a NaN/inf that reference lacks."""
  x = np.asarray(x, np.float64)
  reference = np.asarray(reference, np.float64)
  same_nonfinite = (~np.isfinite(reference)) & (x == reference)
  diff = np.where(same_nonfinite, 0.0, np.abs(x - reference))
  diff = np.where(np.isnan(diff), np.inf, diff)
  return float(diff.max()) if diff.size else 0.0


def error_bound(reference, baseline, dtype, factor: float = 2.0) -> float:
  """The largest error allowed: factor * error(baseline) + atol(dtype)."""
  finite = np.asarray(reference, np.float64)
  finite = finite[np.isfinite(finite)]
  magnitude = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
  return factor * max_abs_error(baseline, reference) + ATOL[jnp.dtype(dtype)] * magnitude
