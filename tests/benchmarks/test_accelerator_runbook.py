"""The GPU runbook's CPU path: it parses its arguments and runs end to end without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNBOOK = os.path.join(ROOT, "benchmarks", "accelerator_check.sh")


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", RUNBOOK, *args], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)


@pytest.mark.cpu_only("the dry run forces JAX onto the CPU backend")
def test_dry_run_prints_one_table_with_tests_and_benchmark_rows(tmp_path):
    result = run("--dry-run", "--log-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| check | result | detail |"
    checks = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table[2:]}
    assert checks["tests (dry run, CPU)"] == "ok"
    assert any(name.startswith("bench_gpu: 256 req decode") for name in checks)
    assert "bench_gpu: step" not in checks  # a second table's header row is a header, not a result
    details = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in table[2:]}
    decode = next(detail for name, detail in details.items() if name.startswith("bench_gpu: 256 req decode"))
    assert decode.startswith("jaxprep device µs: ")  # read under the step table's own columns
    assert "backend cpu" in result.stdout
    # the fused step's benchmark: both jaxprep paths, vLLM's rows, and serve_step on both paths
    assert details["bench_fused: 16 decode / jaxprep Pallas"].startswith("launches: n/a; device µs: n/a; thread µs: ")
    assert "bench_fused: 16 decode / MRV2 torch ops" in checks
    assert "needs CUDA" in details["bench_fused: 16 decode / MRV2 real kernels"]
    serve_rows = {f"bench_fused: serve_step, plain step on {kernel}" for kernel in ("xla", "pallas")}
    assert serve_rows <= set(checks)
    assert checks["MRV2 kernel sources"] == "-"
    assert sorted(os.listdir(tmp_path))  # each step's log was written


@pytest.mark.parametrize("args, message", [(["--workers", "-1"], "--workers must be >= 0"),
                                           (["--wheels", "/nonexistent-dir"], "no such directory"),
                                           (["--bogus"], "unrecognized arguments")])
def test_bad_arguments_exit_2_naming_the_flag(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
