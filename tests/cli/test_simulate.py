"""`jaxprep simulate`: the default subcommand; its --check passes and --json ends with the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxprep import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--requests", "10", "--budget", "16", "--max-num-reqs", "4", "--max-model-len", "64", "--num-blocks", "20",
         "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64", "--max-prompt-len", "24",
         "--max-tokens", "12", "--arrival-spread", "4", "--decode-steps", "4"]


def run_jaxprep(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "jaxprep", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_simulate_is_the_default_command():
    assert cli.COMMANDS["simulate"] == "jaxprep.cli.simulate"
    assert cli.DEFAULT_COMMAND == "simulate"


def test_simulate_check_json_summary():
    """No subcommand named: simulate runs; --check passes, the last stdout line is the JSON summary."""
    result = run_jaxprep("--check", "--json", *SMALL)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["check_passed"] is True and summary["check_mismatches"] == 0
    assert summary["compiles_after_warmup"] == 0
    assert summary["finished"] == summary["requests"] == 10
    assert summary["steps"] >= summary["dispatches"] > 0
    assert summary["prepare_us_median"] > 0 and 0 <= summary["padding_waste"] < 1
    assert summary["prefill_tokens"] + summary["decode_tokens"] == summary["scheduled_tokens"]
    # stderr is a pipe, not a terminal: a line per phase and per quarter of it, no bar redraws
    assert "\r" not in result.stderr and "warm-up: 2 buckets: 4/4 compile in " in result.stderr, result.stderr
    assert "serving: 10/10 req in " in result.stderr and "check: dense recompute: 10/10 req in " in result.stderr


def test_simulate_spec_decode_reports_acceptance_and_checks():
    """--spec-decode ngram: the greedy outputs still equal a dense recomputation, and the summary
    reports the drafts, the accepted ones and their rate."""
    result = run_jaxprep("--check", "--json", *SMALL, "--spec-decode", "ngram", "--num-speculative-tokens", "3",
                         "--prompt-lookup-min", "2", "--prompt-lookup-max", "3", "--workload", "repetitive")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["check_passed"] is True and summary["compiles_after_warmup"] == 0
    assert summary["spec_decode"] == "ngram (k 3, lookup 2..3)" and summary["workload"] == "repetitive"
    assert 0 < summary["accepted_draft_tokens"] <= summary["draft_tokens"]
    assert summary["acceptance_rate"] == round(summary["accepted_draft_tokens"] / summary["draft_tokens"], 4)
    assert summary["mean_acceptance_length"] > 1


def test_progress_bars_and_plot(tmp_path, capsys):
    """Forced bars show the warm-up's buckets and compiles, the served requests and the check;
    --plot writes a PNG chart of every forward pass."""
    path = tmp_path / "steps.png"
    argv = ["simulate", *SMALL, "--check", "--progress", "always", "--plot", str(path), "--no-compile-cache"]
    assert cli.main(argv) == 0  # no cache: it would be on for the rest of this process
    err = capsys.readouterr().err
    # buckets (8, 16): the updates at 2 payload rungs (64, 96 words) + 2 steps
    assert "warm-up: 2 buckets" in err and "4/4" in err
    assert "serving" in err and "10/10" in err
    assert "check: dense recompute" in err
    with open(path, "rb") as file:
        data = file.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_lines_when_stderr_is_not_a_terminal(capsys):
    """--progress auto off a terminal: a line at the start, at each quarter and at the end; never: nothing."""
    from jaxprep.cli import _progress

    bar = _progress.progress_bar("auto", "warm-up: 2 buckets", "compile", total=8)
    for _ in range(8):
        bar.update(1)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "warm-up: 2 buckets: 0/8 compile"
    assert [line.split(",")[0] for line in lines[1:-1]] == [f"warm-up: 2 buckets: {n}/8 compile" for n in (2, 4, 6)]
    assert lines[-1].startswith("warm-up: 2 buckets: 8/8 compile in ") and len(lines) == 5
    with _progress.progress_bar("never", "warm-up: 2 buckets", "compile", total=5) as bar:
        bar.update(5)
    assert capsys.readouterr().err == ""
    bar = _progress.progress_bar("always", "warm-up: 2 buckets", "compile", total=5)
    bar.update(5)
    bar.close()
    assert "warm-up: 2 buckets" in capsys.readouterr().err  # a tqdm bar, even under capture


def test_async_scheduling_checks_and_reports_overlap():
    """--async-scheduling: greedy tokens still the dense ones, single steps only, and the overlap share
    reported; with several devices it is a usage error (exit 2, one line naming both flags)."""
    result = run_jaxprep("--async-scheduling", "--check", "--json", *SMALL)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["check_passed"] is True and summary["compiles_after_warmup"] == 0
    assert summary["multi_step_dispatches"] == 0 and summary["steps"] == summary["dispatches"]
    assert 0 <= summary["async_overlap"] <= 1 and summary["host_us_per_dispatch"] > 0
    refused = run_jaxprep("--async-scheduling", "--devices", "2", *SMALL)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].endswith("--async-scheduling: runs on one device, not --devices 2")
