"""What the installed distribution says of itself: its version is jaxflash.__version__, it ships
the PEP 561 marker, and the public names are there with docstrings."""

import importlib.metadata
import pathlib

import jaxflash


def test_distribution_version_is_the_package_version():
  assert importlib.metadata.version("jaxflash") == jaxflash.__version__


def test_typed_marker_is_installed():
  assert (pathlib.Path(jaxflash.__file__).parent / "py.typed").is_file()


def test_public_names_have_docstrings():
  for name in jaxflash.__all__:
    if name != "__version__":
      assert getattr(jaxflash, name).__doc__, name
