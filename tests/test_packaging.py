"""What the installed distribution says of itself: its version is jaxflash.__version__, it ships
the PEP 561 marker, the public names are there with docstrings, its extension was built from the
same sources, and it runs from a source checkout (where the checkout shadows it)."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

import jaxflash
from jaxflash import native


def test_distribution_version_is_the_package_version():
  assert importlib.metadata.version("jaxflash") == jaxflash.__version__


def test_typed_marker_is_installed():
  assert (pathlib.Path(jaxflash.__file__).parent / "py.typed").is_file()


def test_public_names_have_docstrings():
  for name in jaxflash.__all__:
    if name != "__version__":
      assert getattr(jaxflash, name).__doc__, name


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_extension_was_built_from_these_sources():
  from jaxflash import kernels  # the import that loads the extension
  assert kernels._native.version == jaxflash.__version__
  major, minor = kernels._native.ffi_api_version
  assert (major, minor) >= (0, 1)  # XLA runs handlers of API 0.1 up to its own version


def test_an_extension_from_other_sources_is_refused():
  with pytest.raises(ImportError, match=r"built from jaxflash 0\.1\.0, but these sources are jaxflash 9\.9\.9: reinstall"):
    native.load("9.9.9")


@pytest.mark.skipif(not (REPO_ROOT / "jaxflash" / "__init__.py").is_file(), reason="not run from a checkout")
@pytest.mark.parametrize("command", [
    ["-m", "jaxflash", "--help"],
    ["-c", "import jaxflash, jaxflash.kernels as k; print(jaxflash.__file__); print(k._native.version)"],
])
def test_runs_from_the_repository_root(command):
  """The checkout's jaxflash/ shadows the installed package there (sys.path[0] is the working
  directory); jaxflash.native then finds the installed extension."""
  result = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr
  if command[0] == "-c":
    package_file, version = result.stdout.split()
    assert pathlib.Path(package_file).resolve() == REPO_ROOT / "jaxflash" / "__init__.py"
    assert version == jaxflash.__version__
