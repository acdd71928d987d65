"""The benchmark scripts, run in-process at a tiny size on the default device: each prints its
tables with a figure in every cell, so that the GPU run (scripts/gpu_check.sh cli) does not find
a broken script. The figures themselves are not checked (no timed asserts).

benchmarks/ is not a package, so the scripts are imported from their paths.
"""

from __future__ import annotations

import importlib.util
import os
import re

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _load_script(name):
  spec = importlib.util.spec_from_file_location(f"benchmarks_{name}",
                                                os.path.join(BENCHMARKS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_score_modifier_benchmark_fills_every_cell(capsys):
  """Issue 18's two tables."""
  script = _load_script("score_modifiers")
  assert script.main(["--docs", "3", "--doc-len", "37", "--seqlens", "64", "--tokens", "64",
                      "--repeats", "1"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith("| fwd") or re.match(r"\| 64 \|", line)]
  # Packing: fwd and fwd+bwd; modifiers: causal or not x fwd or fwd+bwd at N = 64.
  assert len(rows) == 2 + 4, rows
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(re.fullmatch(r"[\d.e+-]+|yes|no|fwd|fwd\+bwd|NotImplementedError", c) for c in cells), row


def test_flax_mask_path_benchmark_fills_every_cell(capsys):
  """One row per path; the classification has no backward."""
  script = _load_script("flax_mask_path")
  assert script.main(["--batch", "1", "--seqlen", "37", "--heads", "2", "--head-dim", "16",
                      "--repeats", "1"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith("| ") and not line.startswith("| path")]
  names = [row.strip("|").split("|")[0].strip() for row in rows]
  assert names[:4] == ["mask", "is_causal", "switch only", "classification only"], names
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")[1:]]
    assert all(re.fullmatch(r"[\d.]+", c) for c in cells) or (
        row.startswith("| classification only") and cells[1] == cells[3] == "-"), row
