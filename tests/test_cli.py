"""Smoke tests of the two command-line entry points on tiny sizes: they run end to end on the
present backend, the self-check passes, and the benchmark writes its table."""

import pytest

from jaxflash import __main__ as main_job
from jaxflash import bench


def test_main_job_self_check_passes_and_prints_table(capsys):
  assert main_job.main(["--seqlens", "64,128", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  assert "FAIL" not in out
  assert out.count("PASS") == 3 * len(main_job.CHECKS)
  for path in main_job.paths():
    assert path in out
  rows = [line for line in out.splitlines() if "fwd+bwd" in line]
  assert len(rows) == 2, out  # one per sequence length


def test_main_job_plots(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  assert main_job.main(["--skip-check", "--seqlens", "64,128", "--repeats", "1", "--plot",
                        str(tmp_path), "--heads-sweep", "1,2", "--batch-sweep", "1,2",
                        "--sweep-seqlen", "64"]) == 0
  for name in ("tflops_vs_seqlen.png", "memory_vs_seqlen.png", "scaling.png"):
    data = (tmp_path / name).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name
  assert capsys.readouterr().out.count("wrote ") == 3


def test_main_job_help_names_every_option(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main_job.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for option in ("--seqlens", "--batch", "--heads", "--head-dim", "--dtype", "--repeats",
                 "--max-xla-seqlen", "--plot", "--heads-sweep", "--batch-sweep",
                 "--sweep-seqlen", "--skip-check", "--skip-bench"):
    assert option in out


def test_bench_writes_protocol_table(tmp_path):
  path = tmp_path / "bench.md"
  assert bench.main(["--tokens", "256", "--seqlens", "64,128", "--head-dims", "64", "--dtypes",
                     "bfloat16", "--repeats", "1", "--longest-from", "256", "--longest-limit", "512",
                     "--out", str(path)]) == 0
  text = path.read_text()
  rows = [line for line in text.splitlines() if line.startswith("| bfloat16")]
  assert len(rows) == 2 * 2 * 2  # seqlens x causal x direction
  assert "jaxflash: 512" in text  # O(N) memory: the short search reaches its limit
