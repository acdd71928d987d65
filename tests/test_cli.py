"""Tests of the two command-line entry points on tiny sizes: they run end to end on the
present backend, the self-check passes (and a failing one sets the exit status), the tables
and plots come out, and the benchmark writes its table."""

from __future__ import annotations

import sys

import pytest

from jaxflash import __main__ as main_job
from jaxflash import bench

TINY = ["--seqlens", "64,128", "--batch", "1", "--heads", "2", "--head-dim", "32", "--repeats", "1"]


def _table_rows(out: str, varying_values) -> dict[tuple[str, int], list[str]]:
  """The cells of the speed tables' rows, keyed by (direction, N / heads / batch)."""
  rows = {}
  for line in out.splitlines():
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    if cells and cells[0] in ("fwd", "fwd+bwd") and int(cells[1]) in varying_values:
      rows[(cells[0], int(cells[1]))] = cells[2:]
  return rows


def test_main_job_self_check_passes_and_prints_table(capsys):
  assert main_job.main(TINY) == 0
  out = capsys.readouterr().out
  assert "FAIL" not in out
  lines = out.splitlines()
  for dtype in main_job.CHECK_DTYPES:
    for name, *_ in main_job.CHECKS:
      assert sum("PASS" in l and f" {dtype} " in l and f" {name} " in l for l in lines) == 1, out
  assert out.count("PASS") == len(main_job.CHECK_DTYPES) * len(main_job.CHECKS)
  assert "self-check: all passed" in out
  for path in bench.paths():
    assert main_job.PATH_LABELS[path] in out
  rows = _table_rows(out, (64, 128))
  assert set(rows) == {(d, n) for d in ("fwd", "fwd+bwd") for n in (64, 128)}, out
  for cells in rows.values():  # ms, TFLOP/s, MiB per path (jaxflash, XLA, ...), then speedups
    ms, tflops, mib = (float(c.replace(",", "")) for c in cells[:3])  # jaxflash always runs
    assert ms > 0 and tflops > 0 and mib > 0
    xla_ms = float(cells[3].replace(",", ""))  # within --max-xla-seqlen
    speedup = float(cells[3 * len(bench.paths())].removesuffix("x"))  # vs XLA, the first
    assert abs(speedup - xla_ms / ms) <= 0.01 * speedup + 0.006, cells  # of rounded times


def test_main_job_fails_when_a_check_fails(monkeypatch, capsys):
  monkeypatch.setattr(main_job, "CHECKS", main_job.CHECKS[:1])
  monkeypatch.setattr(main_job, "error_bound", lambda *args: 0.0)  # no error allowed
  assert main_job.main(["--skip-bench"]) == 1
  out = capsys.readouterr().out
  assert out.count("FAIL") == len(main_job.CHECK_DTYPES) + 1 and "PASS" not in out  # + summary


def test_main_job_plots(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  plots = tmp_path / "new" / "plots"
  assert main_job.main(["--skip-check", *TINY, "--max-xla-seqlen", "64", "--plot", str(plots),
                        "--heads-sweep", "1,2", "--batch-sweep", "1,2",
                        "--sweep-seqlen", "64"]) == 0
  out = capsys.readouterr().out
  for name in ("tflops_vs_seqlen.png", "memory_vs_seqlen.png", "scaling.png"):
    data = (plots / name).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name
    assert f"wrote {plots / name}" in out
  rows = _table_rows(out, (64, 128))
  assert rows[("fwd", 128)][3] == rows[("fwd+bwd", 128)][3] == "skipped"  # over --max-xla-seqlen
  assert float(rows[("fwd", 64)][3]) > 0
  assert "scaling with heads" in out and "scaling with batch" in out


def test_main_job_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
  with pytest.raises(SystemExit, match="pip install matplotlib"):
    main_job.main(["--plot", str(tmp_path / "plots")])
  assert not (tmp_path / "plots").exists()  # refused before anything ran


def test_main_job_help_names_every_option(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main_job.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for option in ("--seqlens", "--batch", "--heads", "--head-dim", "--dtype", "--repeats",
                 "--max-xla-seqlen", "--plot", "--scaling", "--heads-sweep", "--batch-sweep",
                 "--sweep-seqlen", "--skip-check", "--skip-bench"):
    assert option in out
  assert "on a GPU" in out and "on the CPU" in out and "examples:" in out


def test_main_job_rejects_plot_with_skip_bench(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main_job.main(["--skip-bench", "--plot", str(tmp_path)])
  assert exit_info.value.code == 2 and "--skip-bench" in capsys.readouterr().err


def test_bench_writes_protocol_table(tmp_path):
  path = tmp_path / "bench.md"
  assert bench.main(["--tokens", "256", "--seqlens", "64,128", "--head-dims", "64", "--dtypes",
                     "bfloat16", "--repeats", "1", "--longest-from", "256", "--longest-limit", "512",
                     "--out", str(path)]) == 0
  text = path.read_text()
  rows = [line for line in text.splitlines() if line.startswith("| bfloat16")]
  assert len(rows) == 2 * 2 * 2  # seqlens x causal x direction
  assert "jaxflash: 512" in text  # O(N) memory: the short search reaches its limit
