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
    assert summary["prep_us_median"] > 0 and 0 <= summary["padding_waste"] < 1
    assert "10/10 requests" in result.stderr  # the progress line
