"""What the installed distribution says of itself: its version is jaxflash.__version__, it ships
the PEP 561 marker, the public names are there with docstrings, its extension was built from the
same sources, it runs from a source checkout (where the checkout shadows it), and on x86-64 its
CPU kernels run on any x86-64 CPU (only the AVX clones use AVX)."""

import collections
import importlib.metadata
import os
import pathlib
import platform
import re
import shutil
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


# Instructions an x86-64 CPU without AVX2 lacks: every VEX/EVEX-encoded one (their mnemonics start
# with "v"), AVX-512 mask registers, and the BMI and MOVBE instructions of x86-64-v3.
_POST_BASELINE = re.compile(r"v[a-z0-9]+|k[a-z]+[bwdq]|shlx|shrx|sarx|rorx|andn|bzhi|pdep|pext|mulx|"
                            r"blsr|blsi|blsmsk|bextr|movbe")
_AVX_CLONE = re.compile(r"\[clone \.(arch_x86_64_v[34]|avx)\]")
_TASKS = ("forward_tile", "key_tile_gradients", "query_tile_gradients")


def _disassembly_by_function(path):
  """{function name: [mnemonic, ...]} of the .text section of a shared object."""
  listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", "-j", ".text", str(path)],
                           capture_output=True, text=True, check=True).stdout
  functions, current = collections.defaultdict(list), None
  for line in listing.splitlines():
    if header := re.match(r"[0-9a-f]+ <(.*)>:$", line):
      current = header.group(1)
    elif current and (instruction := re.match(r"\s+[0-9a-f]+:\s+(?:\{\w+\}\s+)?([a-z][a-z0-9.]*)", line)):
      functions[current].append(instruction.group(1))
  return functions


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64" or not shutil.which("objdump"),
                    reason="needs x86-64 Linux and objdump")
def test_only_the_avx_clones_of_the_cpu_kernels_use_avx():
  """A portable build must run on any x86-64 CPU: outside the task bodies' AVX, x86-64-v3 and
  x86-64-v4 clones (cuda/cpu/isa.h) there is no AVX, AVX-512 or BMI instruction, and the AVX2
  clone has no AVX-512 mask instruction."""
  from jaxflash import kernels
  if "clone" not in kernels._native.cpu_instruction_sets:
    pytest.skip(f"the CPU kernels are not cloned: {kernels._native.cpu_instruction_sets}")
  functions = _disassembly_by_function(kernels._native.__file__)
  leaks, clones = [], collections.Counter()
  for name, mnemonics in functions.items():
    if clone := _AVX_CLONE.search(name):
      level = clone.group(1)
      clones[(next((t for t in _TASKS if t in name), None), level)] += 1
      if level == "arch_x86_64_v3" and any(m.startswith("k") and _POST_BASELINE.fullmatch(m) for m in mnemonics):
        leaks.append(f"{name}: AVX-512 mask instructions")
      continue
    used = sorted({m for m in mnemonics if _POST_BASELINE.fullmatch(m)} - {"vzeroupper"})
    if used:
      leaks.append(f"{name}: {' '.join(used[:8])}")
  assert not leaks, "\n".join(leaks[:20])
  for task in _TASKS:  # each instantiation (dtype, bias dtype, output) has every clone
    counts = [clones[(task, level)] for level in ("avx", "arch_x86_64_v3", "arch_x86_64_v4")]
    assert counts[0] == counts[1] == counts[2] > 0, (task, clones)
