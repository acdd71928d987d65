"""Smoke tests of the two command-line entry points on tiny sizes: they run end to end on the
present backend, the self-check passes, and the benchmark writes its table."""

from jaxflash import __main__ as main_job
from jaxflash import bench


def test_main_job_self_check_passes_and_prints_table(capsys):
  assert main_job.main(["--seqlens", "128", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  assert "FAIL" not in out
  assert out.count("PASS") == 3 * len(main_job.CHECKS)
  assert "fwd+bwd" in out


def test_bench_writes_protocol_table(tmp_path):
  path = tmp_path / "bench.md"
  assert bench.main(["--tokens", "256", "--seqlens", "64,128", "--head-dims", "64", "--dtypes",
                     "bfloat16", "--repeats", "1", "--longest-from", "256", "--longest-limit", "512",
                     "--out", str(path)]) == 0
  text = path.read_text()
  rows = [line for line in text.splitlines() if line.startswith("| bfloat16")]
  assert len(rows) == 2 * 2 * 2  # seqlens x causal x direction
  assert "jaxflash: 512" in text  # O(N) memory: the short search reaches its limit
