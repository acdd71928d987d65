"""Shared pytest configuration: the `backend` fixture that runs every numerical test once per
platform present, and the `gpu` marker.

The same tests run on the CPU-only development machine and on the GPU machine: "cpu" is always
tested; "cuda" is tested when jaxflash was built with CUDA and JAX sees a GPU, and is reported as
skipped (with the reason) otherwise, so a missing CUDA build is visible in the summary instead of
silently running fewer tests.
"""

import os
import sys

# Most of the suite's time is XLA compiling the jax.nn reference and baseline (a new shape per
# case); LLVM's optimisation level does not change results (no fast-math either way) and halves
# that. Set before JAX creates its backends; an explicit setting by the user wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()
# On the GPU machine, autotuning the few GPU GEMMs left per test (the reference and baseline run
# on the CPU, see reference.py) costs seconds per compile, and no test depends on which GEMM
# algorithm XLA picks.
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_autotune_level=0").strip()

# pytest-xdist workers share one GPU: JAX's default of preallocating 75% of its memory per
# process would make every worker after the first fail to start the CUDA backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import pytest

# The reference and tolerance helpers live next to the tests (tests/reference.py); tests/ has no
# __init__.py so that `import jaxflash` resolves to the installed package, not the source tree.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# jaxflash supports float32/float16/bfloat16 only; with x64 on, Python scalars and jnp.arange
# would silently become 64-bit and change what the tests exercise.
jax.config.update("jax_enable_x64", False)

# tests/test_sharding.py runs on a mesh of 8 host devices (the GPU machine's CPU has them too;
# every other test uses the first device only).
jax.config.update("jax_num_cpu_devices", 8)

BACKENDS = ("cpu", "cuda")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: runs on the CUDA backend (needs a GPU and a CUDA build)")
  config.addinivalue_line("markers", "big_memory: allocates tens of GiB of device memory (run alone: "
                          "scripts/gpu_check.sh runs these after the parallel suite)")


def _gpu_devices():
  try:
    return jax.devices("cuda")
  except RuntimeError:  # no CUDA backend in this jaxlib, or no GPU visible
    return []


def backend_unavailable_reason(backend: str) -> str | None:
  """None when `backend` can be tested here, else why not."""
  if backend == "cpu":
    return None
  import jaxflash  # imported here so that a missing build fails the tests, not collection

  if "cuda" not in jaxflash.backends():
    return f"jaxflash was built without CUDA (jaxflash.backends() = {jaxflash.backends()})"
  if not _gpu_devices():
    return "JAX sees no CUDA device"
  return None


@pytest.fixture(params=[pytest.param("cpu", id="cpu"),
                        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def backend(request):
  """The platform name; the test body runs with that platform's first device as the default
  device, so every array it creates (and every jit it runs) lives there."""
  reason = backend_unavailable_reason(request.param)
  if reason is not None:
    pytest.skip(reason)
  with jax.default_device(jax.devices(request.param)[0]):
    yield request.param


@pytest.fixture
def device(backend):
  """The device the test's arrays must be placed on (and its outputs must come back on)."""
  return jax.devices(backend)[0]
