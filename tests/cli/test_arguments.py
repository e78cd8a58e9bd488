"""Every flag of every subcommand: a bad value, or a combination that cannot work, ends in one line
naming the flag, the value and the bound, with exit status 2 and no traceback, before any compile."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from jaxprep import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_A_FOLDER = os.path.join(ROOT, "README.md")

# (argv, the flag the message names, what the message says after the flag)
SAMPLING_BAD = [  # flag, value, the bound the error names
    ("--temperature", "-1", "-1.0: must be finite and >= 0"), ("--top-k", "-2", "-2: must be an int >= -1"),
    ("--top-p", "1.5", "1.5: must be in (0, 1]"), ("--min-p", "2", "2.0: must be in [0, 1]"),
    ("--repetition-penalty", "0", "0.0: must be finite and > 0"),
    ("--sampling-seed", "x", "x: must be an integer"),
    ("--sampling-seed", str(10**23), f"{10**23}: must be <= 9223372036854775807"),  # was reported as --seed
    ("--sampling-seed", str(-(2**63) - 1), "must be >= -9223372036854775808"),
]
BAD = [
    (["demo", "--check=yes"], "--check", "ignored explicit argument 'yes'"),
    (["simulate", "--requests", "0"], "--requests", "0: must be >= 1"),
    (["simulate", "--requests", "ten"], "--requests", "ten: must be an integer"),
    (["simulate", "--budget", "0"], "--budget", "0: must be >= 1"),
    (["simulate", "--block-size", "0"], "--block-size", "0: must be >= 1"),
    (["simulate", "--max-num-reqs", "0"], "--max-num-reqs", "0: must be >= 1"),
    (["simulate", "--max-model-len", "1"], "--max-model-len", "1: must be >= 2"),
    (["simulate", "--num-blocks", "1"], "--num-blocks", "1: must be >= 2"),
    (["simulate", "--num-blocks", "3"], "--num-blocks", "3: must be >= 11"),  # 160 tokens in blocks of 16
    (["simulate", "--num-blocks", "70000", "--block-size", "40000"], "--num-blocks", "must be <= 2147483647"),
    (["simulate", "--layers", "0"], "--layers", "0: must be >= 1"),
    (["simulate", "--d-model", "0"], "--d-model", "0: must be >= 2"),
    (["simulate", "--d-model", "30"], "--d-model", "30: must split into --heads 4 heads of an even size"),
    (["simulate", "--d-model", "12", "--heads", "4"], "--d-model", "12: must split into --heads 4"),  # head dim 3
    (["simulate", "--heads", "0"], "--heads", "0: must be >= 1"),
    (["simulate", "--heads", "128"], "--d-model", "64: must split into --heads 128"),
    (["simulate", "--vocab-size", "2"], "--vocab-size", "2: must be >= 3"),
    (["simulate", "--decode-steps", "0"], "--decode-steps", "0: must be >= 1"),
    (["simulate", "--max-prompt-len", "0"], "--max-prompt-len", "0: must be >= 1"),
    (["simulate", "--max-prompt-len", "256"], "--max-prompt-len", "256: must be < --max-model-len 256"),
    (["simulate", "--max-tokens", "0"], "--max-tokens", "0: must be >= 1"),
    (["simulate", "--arrival-spread", "-1"], "--arrival-spread", "-1: must be >= 0"),
    (["simulate", "--seed", "-1"], "--seed", "-1: must be >= 0"),
    (["simulate", "--devices", "0"], "--devices", "0: must be >= 1"),
    (["simulate", "--devices", "4096"], "--devices", "4096: must be <= "),  # more than this process's JAX sees
    (["simulate", "--compile-cache", NOT_A_FOLDER], "--compile-cache", "exists and is not a folder"),
    (["simulate", "--no-compile-cache=1"], "--no-compile-cache", "ignored explicit argument '1'"),
    (["simulate", "--compile-cache", "x", "--no-compile-cache"], "--no-compile-cache", "not allowed with argument"),
    # every subcommand compiles, so every one takes the cache flags (`jaxprep.cli._cache`)
    *[(command + ["--compile-cache", NOT_A_FOLDER], "--compile-cache", "exists and is not a folder")
      for command in (["demo"], ["walkthrough"], ["generate", "--model", ROOT, "--prompt-ids", "1"])],
    *[(command + ["--no-compile-cache=1"], "--no-compile-cache", "ignored explicit argument '1'")
      for command in (["demo"], ["walkthrough"], ["generate", "--model", ROOT, "--prompt-ids", "1"])],
    (["simulate", "--check=1"], "--check", "ignored explicit argument '1'"),
    (["simulate", "--async-scheduling=1"], "--async-scheduling", "ignored explicit argument '1'"),
    (["simulate", "--time-prepare=yes"], "--time-prepare", "ignored explicit argument 'yes'"),
    (["simulate", "--update-dispatch", "both"], "--update-dispatch", "both: must be one of auto, fused, separate"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--update-dispatch", "both"], "--update-dispatch",
     "both: must be one of auto, fused, separate"),
    (["simulate", "--json=1"], "--json", "ignored explicit argument '1'"),
    (["simulate", "--plot", "chart.txt"], "--plot", "chart.txt: must end in .png"),
    (["simulate", "--plot", os.path.join(ROOT, "no-such-folder", "chart.png")], "--plot", "does not exist"),
    (["simulate", "--progress", "sometimes"], "--progress", "sometimes: must be one of auto, always, never"),
    (["simulate", "--no-progress=1"], "--no-progress", "ignored explicit argument '1'"),
    (["simulate", "--model", NOT_A_FOLDER], "--model", "README.md: is not a folder"),
    *[(["simulate", name, value], name, bound) for name, value, bound in SAMPLING_BAD],
    *[(["generate", "--model", ROOT, "--prompt-ids", "1", name, value], name, bound)
      for name, value, bound in SAMPLING_BAD],
    (["simulate", "--spec-decode", "eagle"], "--spec-decode", "eagle: must be one of ngram"),
    (["simulate", "--num-speculative-tokens", "2"], "--num-speculative-tokens", "2: needs --spec-decode ngram"),
    (["simulate", "--spec-decode", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens",
     "0: must be >= 1"),
    (["simulate", "--prompt-lookup-max", "3"], "--prompt-lookup-max", "3: needs --spec-decode ngram"),
    (["simulate", "--spec-decode", "ngram", "--prompt-lookup-min", "4", "--prompt-lookup-max", "2"],
     "--prompt-lookup-min", "4: must be <= --prompt-lookup-max 2"),
    (["simulate", "--async-scheduling", "--spec-decode", "ngram"], "--async-scheduling",
     "runs without speculative decoding, not --spec-decode ngram"),
    (["simulate", "--update-dispatch", "separate", "--devices", "2"], "--update-dispatch",
     "separate: runs on one device, not --devices 2"),
    (["simulate", "--workload", "loops"], "--workload", "loops: must be one of random, repetitive"),
    (["generate"], "--model", ": required"),
    (["generate", "--model", NOT_A_FOLDER, "--prompt-ids", "1"], "--model", "README.md: is not a folder"),
    (["generate", "--model", ROOT], "--prompt-ids", ": give at least one prompt (--prompt-ids or --prompt)"),
    (["generate", "--model", ROOT, "--prompt-ids", "1 x"], "--prompt-ids", "'1 x': must be token ids >= 0"),
    (["generate", "--model", ROOT, "--prompt-ids", "1 2147483648"], "--prompt-ids",
     "token id 2147483648 must be <= 2147483647 (token ids are int32)"),  # issue 31: the bound was not told
    (["generate", "--model", ROOT, "--prompt", "hello"], "--prompt", "'hello': needs"),  # no tokenizer here
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens", "0: must be >= 1"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--ignore-eos=1"], "--ignore-eos", "ignored explicit"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--budget", "0"], "--budget", "0: must be >= 1"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--block-size", "0"], "--block-size", "0: must be >= 1"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--max-num-reqs", "0"], "--max-num-reqs", "0: must be >= 1"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--num-blocks", "1"], "--num-blocks", "1: must be >= 2"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--num-blocks", "70000", "--block-size", "40000"],
     "--num-blocks", "must be <= 2147483647"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--max-model-len", "1"], "--max-model-len", "1: must be >= 2"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--decode-steps", "0"], "--decode-steps", "0: must be >= 1"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--json=1"], "--json", "ignored explicit argument '1'"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--prompt-ids", "2", "--temperature", "1", "--sampling-seed",
      str(2**63 - 1)], "--sampling-seed", "request 1 would get seed 9223372036854775808"),
    (["simulate", "--requests", "3", "--temperature", "1", "--sampling-seed", str(2**63 - 2)], "--sampling-seed",
     "request 2 would get seed 9223372036854775808"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--dtype", "float16"], "--dtype",
     "float16: must be one of float32, bfloat16"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--threads", "0"], "--threads", "0: must be >= 1"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--progress", "x"], "--progress", "x: must be one of auto"),
    (["generate", "--model", ROOT, "--prompt-ids", "1", "--no-progress=1"], "--no-progress", "ignored explicit"),
    (["simulate", "--dtype", "float16"], "--dtype", "float16: must be one of float32, bfloat16"),
    (["simulate", "--dtype", "bfloat16"], "--dtype", "bfloat16: needs --model (the tiny built-in model computes"),
    (["simulate", "--threads", "0"], "--threads", "0: must be >= 1"),
    (["walkthrough", "--prompt-lens", "3", "0"], "--prompt-lens", "0: must be >= 1"),
    (["walkthrough", "--prompt-lens", "12"], "--prompt-lens", "12: must be < --max-model-len 12"),
    (["walkthrough", "--max-tokens", "0"], "--max-tokens", "0: must be >= 1"),
    (["walkthrough", "--max-tokens", "1", "2"], "--max-tokens", "1 2: give one value or one per prompt (3)"),
    (["walkthrough", "--block-size", "0"], "--block-size", "0: must be >= 1"),
    (["walkthrough", "--max-model-len", "1"], "--max-model-len", "1: must be >= 2"),
    (["walkthrough", "--max-model-len", "9999999"], "--max-model-len", "9999999: must be <= 1048576"),
    (["walkthrough", "--budget", "0"], "--budget", "0: must be >= 1"),
    (["walkthrough", "--steps", "-1"], "--steps", "-1: must be >= 1"),
    (["walkthrough", "--steps", "0"], "--steps", "0: must be >= 1"),
    (["walkthrough", "--max-columns", "3"], "--max-columns", "3: must be >= 4"),
    (["walkthrough", "--plot-dir", NOT_A_FOLDER], "--plot-dir", "exists and is not a folder"),
]


@pytest.fixture(autouse=True)
def _keep_xla_flags(monkeypatch):
    """`configure_runtime` may add a host-device count to XLA_FLAGS; put it back after each test."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


@pytest.mark.parametrize(("argv", "flag", "bound"), BAD, ids=[" ".join(case[0]) for case in BAD])
def test_bad_flag_is_one_line_exit_2(argv, flag, bound, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert re.match(rf"jaxprep {argv[0]}: error: {flag}[ :]", lines[0]), lines[0]
    assert bound in lines[0]
    assert "Traceback" not in captured.err


def test_every_flag_has_a_bad_case():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    covered = {(argv[0], flag) for argv, flag, _ in BAD}
    for name, module_path in cli.COMMANDS.items():
        module = __import__(module_path, fromlist=["add_arguments"])
        subparser = subparsers.add_parser(name)
        module.add_arguments(subparser)
        for action in subparser._actions:  # argparse has no public list of its options
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert (name, option) in covered, f"jaxprep {name} {option} has no bad-value case"


@pytest.mark.parametrize("argv", [
    ["simulate", "--max-model-len", "2", "--requests", "1", "--budget", "1", "--block-size", "1", "--num-blocks",
     "3", "--max-num-reqs", "1", "--layers", "1", "--d-model", "2", "--heads", "1", "--vocab-size", "3",
     "--decode-steps", "1", "--max-tokens", "1", "--arrival-spread", "0", "--seed", "0"],
    ["simulate", "--max-model-len", "64", "--max-prompt-len", "63", "--max-tokens", "1", "--block-size", "16",
     "--num-blocks", "5"],
    ["walkthrough", "--prompt-lens", "1", "--max-model-len", "2", "--block-size", "1", "--budget", "1", "--steps",
     "1", "--max-columns", "4", "--max-tokens", "1"],
])
def test_the_bounds_are_tight(argv, tmp_path):
    """The smallest accepted values parse and pass the combination checks."""
    module, _ = cli.parse_args([*argv, "--plot-dir" if argv[0] == "walkthrough" else "--compile-cache",
                                   str(tmp_path / "out")])
    assert module.__name__ == f"jaxprep.cli.{argv[0]}"


def test_max_prompt_len_follows_a_short_max_model_len():
    _, args = cli.parse_args(["simulate", "--max-model-len", "40"])
    assert args.max_prompt_len == 39


def test_a_fresh_process_exits_2_at_once_without_a_traceback():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "jaxprep", "--requests", "0"], capture_output=True, text=True,
                            env=env, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr == "jaxprep simulate: error: --requests 0: must be >= 1\n"
    assert result.stdout == ""


@pytest.mark.parametrize(("environ", "kwargs", "scheduled_in_order"), [
    ({}, {}, True),  # one XLA:CPU thread: programs run in their depth-first order
    ({"PJRT_NPROC": "1"}, dict(single_thread_cpu=False), True),  # an explicit one thread, too
    ({}, dict(single_thread_cpu=False), False),  # a checkpoint's steps use every core
    ({}, dict(threads=2), False),
    ({"PJRT_NPROC": "4"}, {}, False),  # an explicit thread count wins
    ({"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"}, {}, False),  # a schedule named wins
])
def test_one_cpu_thread_gets_the_sequential_schedule(environ, kwargs, scheduled_in_order, monkeypatch):
    """`configure_runtime` adds `SEQUENTIAL_CPU_SCHEDULE` to XLA_FLAGS exactly when XLA:CPU gets one thread and
    XLA_FLAGS names no schedule; the flags already there are kept, the host-device count added after it."""
    import jax

    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # the process's own dispatch setting stays
    for name in ("PJRT_NPROC", "XLA_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    cli.configure_runtime(**kwargs, host_devices=2)
    flags = os.environ["XLA_FLAGS"].split()
    assert (cli.SEQUENTIAL_CPU_SCHEDULE in flags) == scheduled_in_order
    assert flags[-1] == "--xla_force_host_platform_device_count=2"
    assert environ.get("XLA_FLAGS", "") in os.environ["XLA_FLAGS"]
