"""`jaxprep simulate`: the default subcommand; its --check passes, --json writes the summary as the only
output on stdout (the text summary goes to stderr), and every rate it prints is the division of the two
figures printed beside it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import pytest

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


RATES = {
    "tokens_per_s": ("scheduled_tokens", "wall_s"),
    "output_tokens_per_s": ("output_tokens", "wall_s"),
    "prefill_tokens_per_s": ("prefill_tokens", "prefill_s"),
    "decode_tokens_per_s": ("decode_dispatch_tokens", "decode_s"),
}
"""Each rate's tokens and seconds as docs/guides/serving.md defines them (written here, not read from the CLI)."""
SUMMARY_LINE = re.compile(r"^  (\w+) +(\S+)(?:  = (\w+) (\S+) / (\w+) (\S+))?$")


@pytest.fixture(scope="module")
def checked_run() -> subprocess.CompletedProcess:
    """``jaxprep --check --json`` at SMALL's shape (no subcommand: simulate)."""
    return run_jaxprep("--check", "--json", *SMALL)


def printed_summary(stdout: str) -> tuple[dict, dict]:
    """``({name: printed value}, {rate: (tokens name, tokens, seconds name, seconds)})`` of the text summary."""
    values, formulas = {}, {}
    for line in stdout.splitlines():
        if match := SUMMARY_LINE.match(line):
            values[match[1]] = match[2]
            if match[3]:
                formulas[match[1]] = (match[3], float(match[4]), match[5], float(match[6]))
    return values, formulas


def reconciles(rate: float, tokens: float, seconds: float) -> bool:
    """The printed rate (rounded to 0.1) is ``tokens / seconds``."""
    return abs(rate - tokens / seconds) <= 0.05 + 1e-9 * rate


def test_simulate_check_json_summary(checked_run):
    """No subcommand named: simulate runs; --check passes; stdout is the JSON summary and nothing else
    (``jaxprep simulate --json | jq`` works), the text summary is on stderr."""
    result = checked_run
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # the whole of stdout: a line of text before it fails the parse
    assert "== jaxprep simulate: tiny paged-KV model" in result.stderr
    assert summary["check_passed"] is True and summary["check_mismatches"] == 0
    assert summary["compiles_after_warmup"] == 0
    assert summary["finished"] == summary["requests"] == 10
    assert summary["steps"] >= summary["dispatches"] > 0
    assert 0 <= summary["padding_waste"] < 1
    # the prepare part alone is timed only on request (--time-prepare: one more compile per bucket)
    assert summary["prepare_us_median"] is None and summary["prepare_us_p99"] is None
    assert summary["prefill_tokens"] + summary["decode_tokens"] == summary["scheduled_tokens"]
    # stderr is a pipe, not a terminal: a line per phase and per quarter of it, no bar redraws
    # the steps at buckets 8 and 16, the updates at 2 payload rungs, and on the CPU (updates applied apart) the
    # steady updates' own program
    separate = jax.default_backend() == "cpu"
    executables = 5 if separate else 4
    assert "\r" not in result.stderr and f"warm-up: 2 buckets: {executables}/{executables} compile in " in \
        result.stderr, result.stderr
    assert "serving: 10/10 req in " in result.stderr and "check: dense recompute: 10/10 req in " in result.stderr
    # before the warm-up, one line says what it compiles and why (--budget 16: buckets 8 and 16); on the CPU
    # --update-dispatch auto applies the updates apart: the steps compile without them
    assert summary["update_dispatch"] == ("separate" if separate else "fused")
    assert (f"warm-up: {executables} executables to compile before the first step, so that no step compiles: the "
            "serving step at the 2 token buckets 8, 16 " + ("without its updates" if separate else "x ")) in \
        result.stderr, result.stderr


def test_fused_update_dispatch_gives_the_same_tokens(checked_run):
    """--update-dispatch fused (one dispatch a step, the update compiled into each bucket's step) passes --check
    with the same summary counts as the default run."""
    fused = run_jaxprep("--check", "--json", "--update-dispatch", "fused", "--no-compile-cache", *SMALL)
    assert fused.returncode == 0, fused.stderr
    summary, default = json.loads(fused.stdout), json.loads(checked_run.stdout)
    assert summary["update_dispatch"] == "fused" and summary["check_passed"] is True
    for name in ("steps", "dispatches", "scheduled_tokens", "output_tokens", "preemptions", "check_tokens"):
        assert summary[name] == default[name], name
    assert "the 2 token buckets 8, 16 (2 programs: one or two update sizes each)" in fused.stderr


def test_each_printed_rate_is_its_printed_tokens_over_its_printed_seconds(checked_run):
    """Every rate line names its tokens and seconds, which are the figures printed on their own lines,
    and the rate recomputed from them is the printed rate; --json carries the same figures and the
    same pairs. The decode rate's tokens are those of the decode dispatches, not ``decode_tokens``
    (which counts the decodes riding in prefill dispatches too). Negative control: that rate
    recomputed from ``decode_tokens``, and the throughput from ``output_tokens``, do not reconcile."""
    values, formulas = printed_summary(checked_run.stderr)  # under --json the text summary is on stderr
    summary = json.loads(checked_run.stdout)
    assert set(formulas) == set(RATES)
    for rate, (tokens_name, tokens, seconds_name, seconds) in formulas.items():
        assert (tokens_name, seconds_name) == RATES[rate]
        assert tokens == float(values[tokens_name]) == summary[tokens_name]
        assert seconds == float(values[seconds_name]) == summary[seconds_name] > 0
        assert float(values[rate]) == summary[rate]
        assert reconciles(summary[rate], tokens, seconds), (rate, summary[rate], tokens, seconds)
    assert summary["rates"] == {rate: list(pair) for rate, pair in RATES.items()}
    assert summary["prefill_dispatches"] + summary["decode_dispatches"] == summary["dispatches"]
    assert 0 < summary["decode_dispatch_tokens"] < summary["decode_tokens"]  # decodes rode in prefill dispatches
    assert summary["prefill_s"] + summary["decode_s"] <= summary["wall_s"] + 1e-5  # each rounded to the µs
    assert not reconciles(summary["decode_tokens_per_s"], summary["decode_tokens"], summary["decode_s"])
    assert not reconciles(summary["tokens_per_s"], summary["output_tokens"], summary["wall_s"])


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
    # buckets (8, 16): the updates at 2 payload rungs (64, 96 words) + 2 steps (+ the steady updates' program
    # where they are applied apart, on the CPU)
    executables = 5 if jax.default_backend() == "cpu" else 4
    assert "warm-up: 2 buckets" in err and f"{executables}/{executables}" in err
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
