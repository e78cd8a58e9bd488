"""The GPU runbook's CPU path: it parses its arguments and runs end to end without a GPU."""

from __future__ import annotations

import json
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
    # the fused step with the features it covers (spec decode, runner V2) against the XLA step and MRV2's kernels
    drafts = "bench_fused: 16 decode + drafts, runner V2"
    assert details[f"{drafts} / jaxprep Pallas"].startswith("launches: n/a; device µs: n/a; thread µs: ")
    assert f"{drafts} / jaxprep XLA" in checks and "needs CUDA" in details[f"{drafts} / MRV2 real kernels"]
    serve_rows = {f"bench_fused: serve_step, plain step on {kernel}" for kernel in ("xla", "pallas")}
    assert serve_rows <= set(checks)
    assert checks["MRV2 kernel sources"] == "-"
    # serve_step's launches by attention path (JAX's decode kernel only on a GPU)
    assert "bench_fused: serve_step, plain step on pallas, attention xla" in checks
    assert details["bench_fused: serve_step, plain step on pallas"].startswith("launches: n/a; prepare kernels: n/a; "
                                                                               "attention kernels: n/a; ")
    # the ragged kernel's GPU tests skip here; float32 equality (one model) and the generate table dry-run on
    # tiny widths
    assert checks["ragged attention kernel, Triton on the GPU (tests)"] == "skipped"
    equality = {name: detail for name, detail in details.items() if name.startswith("float32 greedy equality: ")}
    assert len(equality) == 1 and all(detail.endswith("result: equal") for detail in equality.values()), equality
    speed = [name for name in checks if name.startswith("generate vs transformers: ")]
    assert "generate vs transformers: 1 x 24-token prompt, 4 new / jaxprep, warm cache" in speed, speed
    assert details["generate vs transformers: decode at one request <= 1.0 ms/token"].endswith(
        "result: not checked (not a GPU run)")
    assert sorted(os.listdir(tmp_path))  # each step's log was written
    # the record BENCHMARKS.md's GPU rows are read from (benchmarks/dashboard.py --gpu-record ...)
    with open(os.path.join(tmp_path, "gpu_record.json"), encoding="utf-8") as file:
        record = json.load(file)
    assert record["dry_run"] and record["commit"] and record["command"].endswith("--dry-run --log-dir " + str(tmp_path))
    assert [(check, result) for check, result, _ in record["rows"]] == list(checks.items())  # the table's rows
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import dashboard

    fused, end_to_end, door = dashboard.gpu_cells(record)  # CPU: every GPU figure reads n/a or -
    assert fused[1] == "n/a µs, n/a launches" and door[1] == "not measured yet"
    order = [name.split(":")[0].split(" (")[0].split(",")[0] for name in checks]  # most wanted first, the suite last
    assert order.index("ragged attention kernel") < order.index("float32 greedy equality") \
        < order.index("generate vs transformers") < order.index("bench_fused") < order.index("bench_door") \
        < order.index("call floor") \
        < order.index("bench_gpu") < order.index("tests")
    assert details["call floor: x + 1 over 13 int32[256]"].startswith("thread µs: ")
    # simulate fused and separate: timed on a GPU loan, not on the dry run
    assert checks["update dispatch"] == "skipped" and details["update dispatch"].startswith("dry run: ")
    # the door: vLLM's SchedulerOutputs to torch against V1, its thread time against the no-op floor (CPU: decode16)
    door = details["bench_door: decode16"]
    assert door.startswith("steps timed: ") and "V1 / jaxprep: " in door and "step / floor: " in door, door
    assert "MRV2 kernels µs: needs CUDA" in door and door.endswith("goals: CPU: goals not checked"), door


@pytest.mark.parametrize("args, message", [(["--workers", "-1"], "--workers must be >= 0"),
                                           (["--wheels", "/nonexistent-dir"], "no such directory"),
                                           (["--bogus"], "unrecognized arguments")])
def test_bad_arguments_exit_2_naming_the_flag(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [(["--budget-s", "0"], "--budget-s must be > 0"),
                                           (["--steps", "fused,lint"], "--steps takes names of"),
                                           (["--steps", ","], "--steps takes names of")])
def test_bad_budget_or_steps_exit_2_naming_the_flag(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.cpu_only("the dry run forces JAX onto the CPU backend")
def test_a_spent_budget_skips_every_step_and_still_writes_the_table(tmp_path):
    """A lent GPU's time is short: steps that cannot start in time are rows marked skipped, and the
    table file holds them (a run cut short keeps its rows)."""
    result = run("--dry-run", "--budget-s", "5", "--log-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in result.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| check")}
    skipped = {"ragged attention kernel", "float32 greedy equality", "generate vs transformers", "bench_fused",
               "bench_door", "call floor", "bench_gpu", "update dispatch", "test suite"}
    assert rows.pop("install jaxprep") == "skipped"  # a dry run installs nothing
    assert {name for name, outcome in rows.items() if outcome == "skipped"} == skipped, rows
    with open(tmp_path / "runbook.md") as table:
        saved = table.read()
    assert all(f"| {name} | skipped | --budget-s spent" in saved for name in skipped), saved


def test_only_the_steps_asked_for_run(tmp_path):
    result = run("--dry-run", "--steps", "suite", "--budget-s", "5", "--log-dir", str(tmp_path))
    checks = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert result.returncode == 0 and checks == ["install jaxprep", "test suite"], checks


def test_a_suite_cut_off_by_the_budget_reports_how_far_it_got():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from accelerator_check import timed_out_summary

    output = "..F.s...     [ 10%]\n.E......     [ 20%]\n....\ntimed out after 60 s"
    assert timed_out_summary(output) == "cut off by --budget-s at 20% of the tests, 2 failed or errored so far"
    assert timed_out_summary("timed out after 1 s").startswith("cut off by --budget-s at 0%")


def test_the_failure_log_names_each_failure_as_it_happens(tmp_path):
    """The suite's failures reach LOG_DIR/failures.md one by one (a run the budget kills prints no
    summary): the failing test with its assertion; the passing one not at all."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from pytest_failure_log import failed_tests

    (tmp_path / "test_two.py").write_text("def test_fine():\n    assert 1\n\n"
                                          "def test_broken():\n    assert 2 + 2 == 5, 'arithmetic'\n")
    log = tmp_path / "failures.md"
    env = dict(os.environ, JAXPREP_FAILURE_LOG=str(log),
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_failure_log",
                             "test_two.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-2000:]
    assert failed_tests(str(log)) == ["test_two.py::test_broken"]
    assert "arithmetic" in log.read_text() and "test_fine" not in log.read_text()
    assert failed_tests(str(tmp_path / "none.md")) == []


def test_table_rows_keep_their_columns_when_a_note_spans_lines():
    """A benchmark note broken over lines must not turn the next result row into a header."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from accelerator_check import Runner, add_table_rows

    output = ("| step / path | launches | device µs |\n|---|---:|---:|\n| a / XLA | 19 | 29.0 |\n"
              "| a / V1 | n/a | differs:\nArrays are not equal\n [0, 1]: 5 |\n| a / MRV2 | 7 | 9.7 |\n\n"
              "| serve_step | launches | thread µs |\n|---|---:|---:|\n| serve, xla | 3 | 866.6 |\n")
    runner = Runner({}, None)
    add_table_rows(runner, "fused", output)
    details = {check: detail for check, _, detail in runner.rows}
    assert details == {"fused: a / XLA": "launches: 19; device µs: 29.0",
                       "fused: a / V1": "launches: n/a; device µs: differs:",
                       "fused: a / MRV2": "launches: 7; device µs: 9.7",
                       "fused: serve, xla": "launches: 3; thread µs: 866.6"}


def test_a_gpu_machine_keeps_jax_runtime_defaults(tmp_path, monkeypatch):
    """The benchmarks set PJRT_NPROC=1 for XLA:CPU; it also sizes the GPU client's thread pool, so where
    jax's CUDA plugin is installed they leave JAX's defaults (unless JAX_PLATFORMS=cpu)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import common

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(common, "CUDA_PLUGINS", ("jaxprep_fake_cuda_plugin", "jax_plugins.jaxprep_fake_cuda"))
    assert not common.has_cuda_plugin()  # control: neither is installed
    (tmp_path / "jaxprep_fake_cuda_plugin").mkdir()
    (tmp_path / "jaxprep_fake_cuda_plugin" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert common.has_cuda_plugin()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not common.has_cuda_plugin()
