"""The compiled extension ``jaxflash._native``, wherever the install put it.

A wheel, an editable install and an in-place build all put the extension where
``from jaxflash import _native`` finds it. One case does not: Python started in
a source checkout (``python -m jaxflash`` or ``python -m pytest`` from the
repository root) imports the checkout's ``jaxflash/``, which shadows the
installed package and holds no extension. Then the installed distribution's
extension is loaded under the same name, provided it was built from this
version of the sources; otherwise the error says how to rebuild.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import sys
from types import ModuleType

_NAME = "jaxflash._native"


def _installed_extension() -> pathlib.Path | None:
  """The extension file the installed jaxflash distribution lists, if any."""
  try:
    dist = importlib.metadata.distribution("jaxflash")
  except importlib.metadata.PackageNotFoundError:
    return None
  for file in dist.files or ():
    if (file.parent.name == "jaxflash" and file.name.startswith("_native.")
        and any(file.name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)):
      path = pathlib.Path(dist.locate_file(file))
      if path.is_file():
        return path
  return None


def _load_from(path: pathlib.Path) -> ModuleType:
  spec = importlib.util.spec_from_file_location(_NAME, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[_NAME] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[_NAME]
    raise
  return module


def load(version: str) -> ModuleType:
  """Imports ``jaxflash._native`` and checks that it was built from ``version``."""
  try:
    module = importlib.import_module(_NAME)
    where = "beside the sources"
  except ImportError as beside_error:
    path = _installed_extension()
    if path is None:
      raise ImportError(
          "jaxflash's native extension (jaxflash._native) is not built: install jaxflash with "
          "`pip install .` (or `pip install -e .`) from the repository root") from beside_error
    module = _load_from(path)
    where = f"installed at {path}"
  built = getattr(module, "version", None)
  if built != version:
    raise ImportError(
        f"jaxflash's native extension ({where}) was built from jaxflash {built}, but these "
        f"sources are jaxflash {version}: reinstall (`pip install .` from the repository root)")
  return module
