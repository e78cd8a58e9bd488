"""The GPU runbook: install over the machine's own jax/torch, run the GPU benchmarks, the CUDA
torch_bridge tests and every test with JAX on the GPU, and print one table.

    benchmarks/accelerator_check.sh [--wheels DIR] [--workers N] [--repeats N] [--log-dir DIR]
                                    [--budget-s S] [--steps kernel,equality,generate,fused,door,floor,gpu,bridge,suite]
    benchmarks/accelerator_check.sh --dry-run    # on a machine without a GPU: the CPU path

The steps run in that order, most wanted first: a lent machine's time is short (the device tool
gives a session 15 minutes, its start included), so the ragged attention kernel's GPU tests, the
float32 greedy equality with transformers (`bench_generate.py --part equality`), the generate table
against transformers (``--part speed``) and the fused step's table come before the suite.
``--budget-s`` is the runbook's own wall-time limit: each step gets what is left as its timeout,
a step that cannot start in time is reported as skipped, and the table so far is rewritten to
``LOG_DIR/runbook.md`` after every step, so a run cut short still leaves its rows.

Meant for a lent machine with an NVIDIA GPU and no internet (jax with its CUDA plugin and a CUDA
torch already installed): the project is installed with ``pip --no-deps --no-build-isolation``,
so nothing already there is replaced; test-only packages the machine lacks come as wheels from
``--wheels`` (installed into a private target directory, put first on PYTHONPATH).

Tests that need JAX on the CPU (forced host devices, the host-staged Ascend path) are marked
``cpu_only`` and show up as skipped with their reason; nothing is run on another backend.

The fused step's benchmark (`bench_fused_step.py`: jaxprep's XLA and Pallas paths, vLLM V1, MRV2's
real Triton kernels and MRV2 in torch ops; then `serve_step`) runs twice, with XLA's command
buffers off and on. MRV2's kernels come as source files in ``.vllm_src`` (git-ignored): copy them
on a machine with vLLM (``python benchmarks/vllm_sources.py``) and bring the folder along; the
runbook copies them itself where vLLM is installed.

``--dry-run`` checks the runbook itself where there is no GPU: it parses its arguments, runs one
small test file and the benchmarks with a few repeats and tiny shapes on the CPU backend, and
prints the table (the test suite runs it so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from pytest_failure_log import ENV, failed_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_BRIDGE_TESTS = ["tests/torch_bridge/test_cuda.py", "tests/torch_bridge/test_to_torch.py",
                     "tests/torch_bridge/test_lifetime.py", "tests/torch_bridge/test_from_torch.py"]
DRY_RUN_TESTS = ["tests/core/test_config.py"]
"""The dry run's suite step: one small, quick test file (the step's path is what it checks; the suite runs the rest)."""
KERNEL_TESTS = ["tests/attention/test_ragged_attention.py", "-k", "triton"]
"""The ragged attention kernel compiled by Triton against the oracle (skipped without a GPU)."""
STEPS = ("kernel", "equality", "generate", "fused", "door", "floor", "gpu", "bridge", "dispatch", "suite")
"""The runbook's steps in the order they run: the ragged attention kernel on the GPU, the float32
greedy equality of `jaxprep generate` with transformers, the generate table against transformers,
the fused-step benchmark (command buffers off, then on; serve_step's launches), the door (bench_door.py:
vLLM's SchedulerOutput to torch CUDA tensors against V1, its thread time against the no-op floor), the call floor
(call_floor.py with PJRT_NPROC unset, then 1), bench_gpu.py, the CUDA torch_bridge tests, `jaxprep simulate`
with its updates fused into the step and applied apart (warm-up and step time: which ``--update-dispatch auto``
should pick on a GPU), the whole suite."""
MIN_STEP_S = 30
"""A step is not started with less than this left of ``--budget-s``."""
TABLE_FILE = "runbook.md"
FAILURE_LOG = "failures.md"
RECORD_FILE = "gpu_record.json"
"""The loan's rows as JSON, for BENCHMARKS.md's table: ``python benchmarks/dashboard.py --gpu-record
LOG_DIR/gpu_record.json`` takes its headline GPU rows from it (`dashboard.gpu_cells`)."""


def default_workers() -> int:
    """The suite's xdist workers: the machine's cores less 4 (for XLA's and torch's own threads), 1 to 12
    (a 16-core GPU machine runs the suite with 12 in about 5.5 minutes)."""
    return max(1, min(12, (os.cpu_count() or 1) - 4))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU path: one test file, a short benchmark")
    parser.add_argument("--wheels", help="directory of wheels for test packages the machine lacks")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="pytest-xdist workers for the suite (0: none; default: the cores less 4, at most 12)")
    parser.add_argument("--repeats", type=int, default=200, help="benchmark calls per round")
    parser.add_argument("--log-dir", help="write each step's full output here")
    parser.add_argument("--skip-install", action="store_true", help="the project is importable already")
    parser.add_argument("--budget-s", type=float, help="the runbook's wall-time limit in seconds (default: none)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"which steps, comma-separated, of {','.join(STEPS)}")
    args = parser.parse_args(argv)
    if args.workers < 0 or args.repeats < 1:
        parser.error(f"--workers must be >= 0 and --repeats >= 1, got {args.workers} and {args.repeats}")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0 seconds, got {args.budget_s}")
    args.steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown or not args.steps:
        parser.error(f"--steps takes names of {','.join(STEPS)}, got {unknown or 'none'}")
    if args.wheels and not os.path.isdir(args.wheels):
        parser.error(f"--wheels {args.wheels}: no such directory")
    return args


class Runner:
    """Runs each step as a subprocess in the repository root, keeping its output and time; with a
    budget, each step's timeout is what is left of it."""

    def __init__(self, env: dict, log_dir: str | None, budget_s: float | None = None):
        self.env, self.log_dir, self.rows = env, log_dir, []
        self.deadline = None if budget_s is None else time.monotonic() + budget_s

    def seconds_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def can_start(self, name: str) -> bool:
        """Whether a step fits what is left of the budget; if not, a skipped row says so."""
        if self.seconds_left() >= MIN_STEP_S:
            return True
        self.add(name, "skipped", f"--budget-s spent ({max(self.seconds_left(), 0):.0f} s left)")
        return False

    def run(self, name: str, command: list[str], timeout: float = 1800, env: dict | None = None,
            replace_env: bool = False) -> tuple[int, str]:
        """``env`` adds to the runner's environment, or with ``replace_env`` is the whole of it."""
        timeout = max(1.0, min(timeout, self.seconds_left()))
        print(f"[runbook] {name}: {' '.join(command)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            full_env = env if replace_env else {**self.env, **(env or {})}
            result = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True,
                                    text=True, timeout=timeout)
            code, output = result.returncode, result.stdout + result.stderr
        except subprocess.TimeoutExpired as error:
            code, output = 124, f"{as_text(error.stdout)}{as_text(error.stderr)}\ntimed out after {timeout:.0f} s"
        seconds = time.perf_counter() - start
        if self.log_dir:
            with open(os.path.join(self.log_dir, f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}.log"), "w") as log:
                log.write(output)
        print(f"[runbook] {name}: exit {code} in {seconds:.0f} s", file=sys.stderr, flush=True)
        return code, output

    def add(self, check: str, result: str, detail: str) -> None:
        self.rows.append((check, result, detail))


def as_text(output) -> str:
    """A timed-out subprocess's partial output (bytes even under ``text=True``) as text."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def base_env(args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if args.dry_run:  # nothing is installed: the steps import this checkout, not an installed jaxprep
        env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def install(runner: Runner, args) -> bool:
    if args.wheels:
        target = os.path.join(ROOT, ".runbook_site")
        wheels = sorted(os.path.join(args.wheels, f) for f in os.listdir(args.wheels) if f.endswith(".whl"))
        code, output = runner.run("install wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index",
                                                     "--no-deps", "--upgrade", "--target", target, *wheels])
        runner.env["PYTHONPATH"] = os.pathsep.join(p for p in (target, runner.env.get("PYTHONPATH")) if p)
        runner.add("install test wheels", "ok" if code == 0 else "FAILED", f"{len(wheels)} wheels from --wheels")
        if code:
            return False
    if args.skip_install or args.dry_run:
        runner.add("install jaxprep", "skipped", "--skip-install" if args.skip_install else "dry run: not installed")
        return True
    code, output = runner.run("install", [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                          "--no-build-isolation", "-e", "."])
    runner.add("install jaxprep (--no-deps)", "ok" if code == 0 else "FAILED", last_line(output) or "editable install")
    return code == 0


def versions(runner: Runner) -> str:
    code, output = runner.run("versions", [sys.executable, "-c", (
        "import jax, numpy; print('jax', jax.__version__, 'numpy', numpy.__version__, 'backend', jax.default_backend(),"
        " 'device', jax.devices()[0].device_kind, end=' ')\n"
        "try:\n import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())\n"
        "except ImportError: print('torch missing')")])
    return output.strip().splitlines()[-1] if code == 0 and output.strip() else "unknown"


def pytest_summary(output: str) -> str:
    """The final ``N passed, M skipped ...`` line of a pytest run."""
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    return lines[-1] if lines else last_line(output)


def skip_reasons(output: str) -> str:
    reasons = re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", output, flags=re.MULTILINE)
    counts: dict[str, int] = {}
    for count, reason in reasons:
        counts[reason] = counts.get(reason, 0) + int(count)
    return "; ".join(f"{n}x {reason}" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]))


PYTEST = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m", "not bigmem"]


def timed_out_summary(output: str) -> str:
    """How far a pytest run cut off by the budget got: its last ``[ NN%]`` and the failures seen."""
    progress = re.findall(r"^([.FEsxX]+)\s+\[\s*(\d+)%\]", output, flags=re.MULTILINE)
    failures = sum(dots.count("F") + dots.count("E") for dots, _ in progress)
    reached = f"{progress[-1][1]}%" if progress else "0%"
    return f"cut off by --budget-s at {reached} of the tests, {failures} failed or errored so far"


def run_suite(runner: Runner, args) -> None:
    """The whole suite; each failure's report goes to ``LOG_DIR/failures.md`` as it happens
    (`pytest_failure_log`), so a suite the budget cuts off still names its failures."""
    if not runner.can_start("test suite"):
        return
    if args.dry_run:
        code, output = runner.run("tests (dry run)", PYTEST + DRY_RUN_TESTS)
        runner.add("tests (dry run, CPU)", "ok" if code == 0 else "FAILED", pytest_summary(output))
        return
    workers = ["-n", str(args.workers)] if args.workers and has_xdist(runner) else []
    failure_log = os.path.join(args.log_dir or ROOT, FAILURE_LOG)
    if os.path.exists(failure_log):
        os.remove(failure_log)
    code, output = runner.run("test suite", PYTEST + ["-p", "pytest_failure_log"] + workers,
                              env={ENV: failure_log, "PYTHONPATH": with_benchmarks_on_path(runner.env)})
    if code == 124:
        runner.add("test suite, JAX on the GPU", "cut off", timed_out_summary(output))
    else:
        runner.add("test suite, JAX on the GPU", "ok" if code == 0 else "FAILED", pytest_summary(output))
        reasons = skip_reasons(output)
        if reasons:
            runner.add("skipped tests", "reported", reasons)
    failed = failed_tests(failure_log)
    if failed:
        runner.add("failed tests", "FAILED", ", ".join(failed[:20]) + (" ..." if len(failed) > 20 else "")
                   + f" (reports: {FAILURE_LOG})")


def with_benchmarks_on_path(env: dict) -> str:
    """PYTHONPATH with benchmarks/ added, for ``-p pytest_failure_log``."""
    return os.pathsep.join(p for p in (os.path.join(ROOT, "benchmarks"), env.get("PYTHONPATH")) if p)


def run_bridge_tests(runner: Runner, args) -> None:
    """The CUDA torch_bridge tests (every one must run: on the dry run, without CUDA, they skip)."""
    if args.dry_run or not runner.can_start("CUDA torch_bridge tests"):
        return
    code, output = runner.run("CUDA bridge tests", PYTEST + ["-k", "cuda"] + CUDA_BRIDGE_TESTS)
    summary = pytest_summary(output)
    ran = code == 0 and " passed" in summary and "skipped" not in summary  # every CUDA test ran and passed
    runner.add("CUDA torch_bridge tests (-k cuda)", "ok" if ran else "FAILED", summary)


def has_xdist(runner: Runner) -> bool:
    return runner.run("xdist?", [sys.executable, "-c", "import xdist"])[0] == 0


def run_table_step(runner: Runner, label: str, script: list[str], log_name: str | None = None,
                   **run_options) -> str | None:
    """Runs a benchmark script (``script``: its path and arguments) whose output holds Markdown tables:
    a runbook row per result row, named ``label: ...``, or one FAILED row. Its output, or None."""
    if not runner.can_start(label):
        return None
    code, output = runner.run(log_name or label, [sys.executable, *script], **run_options)
    if code:
        runner.add(label, "FAILED", last_line(output))
        return None
    add_table_rows(runner, label, output)
    return output


def run_kernel_tests(runner: Runner, args) -> None:
    """The ragged attention kernel compiled by Triton on the GPU (on the dry run, without one: skipped)."""
    if not runner.can_start("ragged attention kernel"):
        return
    code, output = runner.run("ragged attention kernel", PYTEST + KERNEL_TESTS)
    summary = pytest_summary(output)
    ran = code == 0 and " passed" in summary and "skipped" not in summary
    result = "ok" if ran else "skipped" if code == 0 and args.dry_run else "FAILED"
    runner.add("ragged attention kernel, Triton on the GPU (tests)", result, summary)


def run_generate(runner: Runner, args, part: str) -> None:
    """bench_generate.py's ``part``: its table's rows, and FAILED if it exits non-zero (a float32 token
    that differs from transformers' beyond a near-tie)."""
    label = {"equality": "float32 greedy equality", "speed": "generate vs transformers"}[part]
    if not runner.can_start(label):
        return
    dry = ["--dry-run"] if args.dry_run else []
    code, output = runner.run(label, [sys.executable, "benchmarks/bench_generate.py", "--part", part, *dry])
    add_table_rows(runner, label, output)
    if code:
        runner.add(label, "FAILED", last_line(output))


def run_benchmark(runner: Runner, args) -> None:
    repeats = ["--dry-run", "--repeats", "5", "--profile-steps", "3", "--dispatch-steps", "5"] if args.dry_run \
        else ["--repeats", str(args.repeats)]
    output = run_table_step(runner, "bench_gpu", ["benchmarks/bench_gpu.py", *repeats], log_name="benchmark")
    if output is None:
        return
    machine = [line for line in output.splitlines() if line.startswith(("machine:", "measured:"))]
    runner.add("bench_gpu machine", "-", " / ".join(machine))


def vllm_sources(runner: Runner, dry_run: bool) -> str:
    """MRV2's kernel sources for bench_fused_step: kept if there, copied where vLLM is installed
    (not on a dry run, which reads them nowhere: MRV2's real kernels need CUDA)."""
    version_file = os.path.join(ROOT, ".vllm_src", "VLLM_VERSION")
    if not os.path.isfile(version_file) and dry_run:
        return "none (dry run: not copied)"
    if not os.path.isfile(version_file):
        code, output = runner.run("copy vLLM sources", [sys.executable, "benchmarks/vllm_sources.py"])
        if code:
            return "none (no vLLM here, no .vllm_src brought along): MRV2 real-kernel rows read n/a"
    with open(version_file) as version:
        return f"vLLM {version.read().strip()} (.vllm_src)"


def run_call_floor(runner: Runner, args) -> None:
    """call_floor.py with PJRT_NPROC unset, then set to 1: whether the CPU setting the benchmarks once
    used also slows a GPU client's calls (dry run: once, as the environment has it)."""
    settings = [("", ["--dry-run", "--repeats", "5"])] if args.dry_run else [
        ("unset", ["--repeats", str(args.repeats)]), ("1", ["--repeats", str(args.repeats)])]
    for nproc, extra in settings:
        env = {key: value for key, value in runner.env.items() if key != "PJRT_NPROC" or not nproc}
        if nproc == "1":
            env["PJRT_NPROC"] = "1"
        run_table_step(runner, "call floor" + (f" (PJRT_NPROC={nproc})" if nproc else ""),
                       ["benchmarks/call_floor.py", *extra], env=env, replace_env=True)


def run_fused_benchmark(runner: Runner, args) -> None:
    """bench_fused_step.py with XLA's command buffers off and on (dry run: once, tiny shapes)."""
    runner.add("MRV2 kernel sources", "-", vllm_sources(runner, args.dry_run))
    settings = [["--dry-run", "--repeats", "5", "--steps", "3"]] if args.dry_run else [
        ["--repeats", str(args.repeats), "--command-buffers", mode] for mode in ("off", "on")]
    for extra in settings:
        label = "bench_fused" + ("" if args.dry_run else f" (command buffers {extra[-1]})")
        run_table_step(runner, label, ["benchmarks/bench_fused_step.py", *extra])


def run_update_dispatch(runner: Runner, args) -> None:
    """`jaxprep simulate` fused and separate (bench_compile.py's simulate part: an empty cache, then the same
    cache), the warm-ups and step times ``--update-dispatch auto`` chooses between; not on the dry run (each
    process compiles for seconds on a CPU; the CPU's figures are in docs/benchmarks-history.md)."""
    if not runner.can_start("update dispatch"):
        return
    if args.dry_run:
        runner.add("update dispatch", "skipped", "dry run: the CPU's figures are in docs/benchmarks-history.md")
        return
    for mode in ("fused", "separate"):  # a row each: "update dispatch fused: HEAD+", "... separate: HEAD+"
        script = ["benchmarks/bench_compile.py", "--against", "--parts", "simulate", "--workloads", f"simulate-{mode}",
                  "--runs", "1"]
        run_table_step(runner, f"update dispatch {mode}", script)


def run_door_benchmark(runner: Runner, args) -> None:
    """bench_door.py: vLLM's SchedulerOutput to torch tensors ready, jaxprep's door against V1 with its copies
    and MRV2's kernels, at 256 decode, 256/8192 and 1024/16384 (dry run: its CPU check, decode16)."""
    extra = ["--dry-run"] if args.dry_run else ["--rounds", "3"]
    run_table_step(runner, "bench_door", ["benchmarks/bench_door.py", *extra])


def add_table_rows(runner: Runner, prefix: str, output: str) -> None:
    """One runbook row per result row of every Markdown table in ``output``, named by its first cell.
    A table's header is the row just above a ``|---|`` line; a blank line ends the table, and a line that
    is not a row inside one (a note broken over lines) is passed over."""
    lines = output.splitlines()
    header = None
    for line, after in zip(lines, lines[1:] + [""]):
        if not line.strip():
            header = None
        if not line.startswith("|") or is_separator(line):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if is_separator(after):
            header = cells
            continue
        if header is None:  # a row outside any table: not a result
            continue
        detail = "; ".join(f"{name}: {value}" for name, value in zip(header[1:], cells[1:]))
        runner.add(f"{prefix}: {cells[0]}", "goal missed" if "missed" in line else "ok", detail)


def is_separator(line: str) -> bool:
    return line.startswith("|") and "-" in line and set(line) <= set("|-: ")


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def format_table(rows, header: str) -> str:
    lines = [header, "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {check} | {result} | {detail.replace('|', '/')} |" for check, result, detail in rows]
    return "\n".join(lines)


def gpu_record(rows, commit: str, machine: str, command: str, dry_run: bool) -> dict:
    """The run as BENCHMARKS.md's GPU record (`RECORD_FILE`): date, commit, device, machine, command, rows."""
    device = re.search(r"device (.+?) torch", machine)
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit, "device": device[1] if device else "unknown",
            "machine": machine, "command": command, "dry_run": dry_run, "rows": [list(row) for row in rows]}


STEP_FUNCTIONS = {"kernel": run_kernel_tests, "equality": lambda runner, args: run_generate(runner, args, "equality"),
                  "generate": lambda runner, args: run_generate(runner, args, "speed"), "fused": run_fused_benchmark,
                  "door": run_door_benchmark,
                  "floor": run_call_floor, "gpu": run_benchmark, "bridge": run_bridge_tests,
                  "dispatch": run_update_dispatch, "suite": run_suite}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    runner = Runner(base_env(args), args.log_dir, args.budget_s)
    commit = os.environ.get("JAXPREP_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit, machine = commit or "unknown", versions(runner)
    header = f"runbook {'dry run ' if args.dry_run else ''}{time.strftime('%Y-%m-%d')}, commit {commit}: {machine}"
    command = " ".join(["bash benchmarks/accelerator_check.sh", *(sys.argv[1:] if argv is None else argv)])

    def save_table() -> None:  # after every step: a run cut short keeps the rows it has
        if args.log_dir:
            with open(os.path.join(args.log_dir, TABLE_FILE), "w") as table:
                table.write(format_table(runner.rows, header) + "\n")
            with open(os.path.join(args.log_dir, RECORD_FILE), "w") as record:
                json.dump(gpu_record(runner.rows, commit, machine, command, args.dry_run), record, indent=1,
                          ensure_ascii=False)

    if install(runner, args):
        save_table()
        for step in STEPS:
            if step in args.steps:
                STEP_FUNCTIONS[step](runner, args)
                save_table()
    save_table()
    print(format_table(runner.rows, header))
    return 1 if any(result == "FAILED" for _, result, _ in runner.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
