"""Tests of the two command-line entry points on tiny sizes: they run end to end on the
present backend, the self-check passes (and a failing one sets the exit status), the tables,
plots and --json results come out and agree, and the benchmark writes its table."""

from __future__ import annotations

import json
import re
import sys

import jax
import pytest

import jaxflash
from jaxflash import __main__ as main_job
from jaxflash import bench, kernels

TINY = ["--seqlens", "64,128", "--batch", "1", "--heads", "2", "--head-dim", "32", "--repeats", "1"]


CELL_COLUMNS = 4  # per path: median ms, min ms, FLOP/s, MiB


def _table_rows(out: str, varying_values) -> dict[tuple[str, int], list[str]]:
  """The cells of the speed tables' rows, keyed by (direction, N / heads / batch)."""
  rows = {}
  for line in out.splitlines():
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    if cells and cells[0] in ("fwd", "fwd+bwd") and int(cells[1]) in varying_values:
      rows[(cells[0], int(cells[1]))] = cells[2:]
  return rows


def _number(cell: str) -> float:
  return float(cell.replace(",", ""))


def test_main_job_self_check_passes_and_prints_table(tmp_path, capsys):
  json_path = tmp_path / "run.json"
  assert main_job.main([*TINY, "--json", str(json_path)]) == 0
  out = capsys.readouterr().out
  assert "FAIL" not in out
  build = kernels.build_info()
  major, minor = build["ffi_api_version"]
  assert f"jaxflash {jaxflash.__version__}: kernels for {', '.join(jaxflash.backends())}" in out
  assert f"CUDA architectures: {build['cuda_architectures'] or 'none'}" in out
  assert f"XLA FFI API {major}.{minor}" in out and f"JAX {jax.__version__}" in out
  assert f"CPU kernels: {build['cpu_instruction_sets']}" in out
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
  rate_unit = "TFLOP/s" if "TFLOP/s" in out else "GFLOP/s"
  for cells in rows.values():  # CELL_COLUMNS per path (jaxflash, XLA, ...), then speedups
    ms, min_ms, rate, mib = map(_number, cells[:CELL_COLUMNS])  # jaxflash always runs
    assert ms >= min_ms > 0 and rate > 0 and mib > 0
    xla_ms = _number(cells[CELL_COLUMNS])  # within --max-xla-seqlen
    speedup = float(cells[CELL_COLUMNS * len(bench.paths())].removesuffix("x"))  # vs XLA
    assert abs(speedup - xla_ms / ms) <= 0.01 * speedup + 0.006, cells  # of rounded times

  # --json: the same results, machine-readable.
  report = json.loads(json_path.read_text())
  assert report["jaxflash"]["version"] == jaxflash.__version__
  assert report["jaxflash"]["cuda_architectures"] == build["cuda_architectures"]
  assert report["jaxflash"]["cpu_instruction_sets"] == build["cpu_instruction_sets"]
  assert report["jaxflash"]["ffi_api_version"] == f"{major}.{minor}"
  assert (report["jax"]["version"], report["jax"]["backend"]) == (jax.__version__,
                                                                   jax.default_backend())
  assert report["device"]["platform"] == jax.devices()[0].platform
  assert report["options"]["seqlens"] == [64, 128] and report["options"]["causal"] is False
  checks = report["self_check"]
  assert checks["passed"]
  assert len(checks["results"]) == len(main_job.CHECK_DTYPES) * len(main_job.CHECKS)
  for result in checks["results"]:
    assert result["passed"] and set(result["errors"]) <= set(main_job.CHECK_RESULTS)
    assert all(0 <= e["error"] <= e["allowed"] for e in result["errors"].values()), result
  cells = {(c["path"], c["direction"], c["seqlen"]): c for c in report["benchmark"]["cells"]}
  assert set(cells) == {(p, d, n) for p in bench.paths() for d, n in rows}
  for (direction, n), row in rows.items():
    cell = cells[("jaxflash", direction, n)]
    assert (cell["batch"], cell["heads"], cell["head_dim"], cell["dtype"]) == (1, 2, 32, "float32")
    assert cell["status"] == "ok" and cell["repeats"] == 1 and cell["causal"] is False
    assert cell["flops"] == bench.attention_flops(1, n, 2, 32, causal=False,
                                                  backward=direction == "fwd+bwd")
    rate_size = 1e12 if rate_unit == "TFLOP/s" else 1e9
    shown = (cell["median_seconds"] * 1e3, cell["min_seconds"] * 1e3,
             cell["flop_per_s"] / rate_size)
    for value, text in zip(shown, row):  # the table's cells, rounded to 3 digits
      assert _number(text) == pytest.approx(value, rel=5e-3), (value, text)


def test_main_job_causal(tmp_path, capsys):
  """--causal times causal attention and counts half the FLOPs of full attention's."""
  path = tmp_path / "run.json"
  assert main_job.main(["--skip-check", "--causal", *TINY, "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "head dim 32, causal" in out and "halved (causal)" in out
  report = json.loads(path.read_text())
  assert report["self_check"] is None and report["options"]["causal"] is True
  for cell in report["benchmark"]["cells"]:
    full = bench.attention_flops(cell["batch"], cell["seqlen"], cell["heads"], cell["head_dim"],
                                 causal=False, backward=cell["direction"] == "fwd+bwd")
    assert cell["causal"] is True and cell["flops"] == full / 2
    assert cell["flop_per_s"] == pytest.approx(cell["flops"] / cell["median_seconds"])


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
  xla = CELL_COLUMNS  # the first cell of jax.nn XLA's columns
  assert rows[("fwd", 128)][xla] == rows[("fwd+bwd", 128)][xla] == "skipped"  # > --max-xla-seqlen
  assert float(rows[("fwd", 64)][xla]) > 0
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
  for option in ("--seqlens", "--batch", "--heads", "--head-dim", "--causal", "--dtype",
                 "--repeats", "--max-xla-seqlen", "--plot", "--scaling", "--heads-sweep",
                 "--batch-sweep", "--sweep-seqlen", "--skip-check", "--skip-bench", "--json"):
    assert option in out
  assert "on a GPU" in out and "on the CPU" in out and "examples:" in out


@pytest.mark.parametrize("argv,named", [(["--skip-bench", "--plot", "plots"], "--skip-bench"),
                                        (["--json", "missing/run.json"], "--json")])
def test_main_job_rejects_bad_options(argv, named, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as exit_info:
    main_job.main(argv)
  assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_main_job_says_how_to_rebuild_for_a_gpu(monkeypatch, capsys):
  """JAX on a GPU and a build without CUDA kernels: one line says so and how to rebuild."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jaxflash, "backends", lambda: ("cpu",))
  assert main_job.main([]) == 1
  out = capsys.readouterr().out
  assert "JAX sees a GPU, but this build of jaxflash has no CUDA kernels" in out
  assert "JAXFLASH_CUDA=ON pip install ." in out and "JAXFLASH_CUDA_ARCHITECTURES=90a" in out


def test_rate_unit_reads_at_least_one():
  def cells(flop_per_s):
    return [main_job.Measurement("jaxflash", 1, 64, 1, False, flops=f, seconds=1.0)
            for f in flop_per_s] + [main_job.Measurement("xla", 1, 64, 1, False, flops=1.0)]
  assert main_job.rate_unit(cells([2e9, 5e11])) == ("GFLOP/s", 1e9)  # 0.5 TFLOP/s
  assert main_job.rate_unit(cells([2e9, 3e12])) == ("TFLOP/s", 1e12)


def test_bench_writes_protocol_table(tmp_path):
  path = tmp_path / "bench.md"
  assert bench.main(["--tokens", "256", "--seqlens", "64,128", "--head-dims", "64", "--dtypes",
                     "bfloat16", "--repeats", "1", "--longest-from", "256", "--longest-limit", "512",
                     "--out", str(path)]) == 0
  text = path.read_text()
  rows = [line for line in text.splitlines() if line.startswith("| bfloat16")]
  assert len(rows) == 2 * 2 * 2  # seqlens x causal x direction
  assert re.search(r"jaxflash: 512 in [0-9.]+ s", text)  # O(N) memory: the search reaches its limit


def test_bench_longest_ratio_needs_a_common_length():
  assert bench.longest_ratio({"jaxflash": (512, 3.0), "cudnn": (512, 2.0)}) == \
      "jaxflash / cudnn time at 512: 1.50"
  assert bench.longest_ratio({"jaxflash": (512, 3.0), "cudnn": (256, 2.0)}) is None
  assert bench.longest_ratio({"jaxflash": (512, 3.0), "xla": (None, None)}) is None


def test_bench_times_calls_issued_back_to_back(monkeypatch):
  """run_seconds issues a sample's calls back to back and synchronises once: with a call that
  takes 1 ms (the clock below) it makes ~10 ms samples of 10 calls, and reports per call."""
  clock, calls, synced = [0.0], [], []
  monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

  def fn(x):
    clock[0] += 1e-3
    calls.append(x)
    return x

  monkeypatch.setattr(bench.jax, "block_until_ready", lambda x: synced.append(len(calls)) or x)
  times = bench.run_seconds(fn, (7,), repeats=3)
  assert times == pytest.approx([1e-3] * 3)
  # Warm-up and the single timed call, then 3 samples of 10: one synchronisation each.
  assert len(calls) == 2 + 3 * 10
  assert synced == [1, 2, 12, 22, 32]
