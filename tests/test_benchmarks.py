"""benchmarks/score_modifiers.py, run in-process at a tiny size on the default device: it prints
issue 18's two tables with a figure in every cell, so that the GPU run (scripts/gpu_check.sh
cli) does not find a broken script. The figures themselves are not checked (no timed asserts).

benchmarks/ is not a package, so the script is imported from its path.
"""

from __future__ import annotations

import importlib.util
import os
import re

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "score_modifiers.py")


def _load_script():
  spec = importlib.util.spec_from_file_location("benchmarks_score_modifiers", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_score_modifier_benchmark_fills_every_cell(capsys):
  script = _load_script()
  assert script.main(["--docs", "3", "--doc-len", "37", "--seqlens", "64", "--tokens", "64",
                      "--repeats", "1"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith("| fwd") or re.match(r"\| 64 \|", line)]
  # Packing: fwd and fwd+bwd; modifiers: causal or not x fwd or fwd+bwd at N = 64.
  assert len(rows) == 2 + 4, rows
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(re.fullmatch(r"[\d.e+-]+|yes|no|fwd|fwd\+bwd|NotImplementedError", c) for c in cells), row
