"""Every subcommand keeps JAX's persistent compilation cache (`jaxprep.cli._cache`), in fresh processes:
a second identical `jaxprep generate` compiles nothing itself (every compile of the run, loading and
warm-up included, is served from the disk), and `demo` and `walkthrough` fill the folder too.

Compiles are counted by `jaxprep.count_compiles` (JAX's monitoring events), never timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from cli.test_simulate import ROOT

GENERATE = ["--prompt-ids", "5 6 7 8 9 10 11 12", "--prompt-ids", "3 4 5", "--max-tokens", "4", "--budget", "8",
            "--decode-steps", "2", "--json"]
"""The step at bucket 8 and the update payload's program (and on the CPU, where the updates are applied apart, the
steady updates' own): two executables (three); budget 8 chunks the first prompt."""


def run_jaxprep(*args: str, cache_dir: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if cache_dir is not None:
        env["JAXPREP_CACHE_DIR"] = cache_dir
    result = subprocess.run([sys.executable, "-m", "jaxprep", *args], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_second_generate_run_compiles_nothing(tmp_path):
    pytest.importorskip("transformers", reason="the checkpoint is saved by transformers")
    from support.hf_checkpoints import SPECS, save_checkpoint

    save_checkpoint(SPECS["qwen3"], str(tmp_path / "model"))
    argv = ["generate", "--model", str(tmp_path / "model"), *GENERATE, "--compile-cache", str(tmp_path / "cache")]
    first, second = (run_jaxprep(*argv) for _ in range(2))
    first_json, second_json = (json.loads(run.stdout) for run in (first, second))  # stdout: the JSON alone
    compiles = second_json["compiles"]
    assert compiles["total"] == compiles["cache_hits"] == first_json["compiles"]["total"], second_json
    # negative control: the first run, from an empty folder, compiled everything itself
    assert first_json["compiles"]["total"] > 0 and first_json["compiles"]["cache_hits"] == 0, first_json
    warmup = second_json["warmup"]
    assert warmup["warmup_compiles"] == warmup["warmup_cache_hits"] > 0
    assert warmup["compile_cache"] == str(tmp_path / "cache") and warmup["warmup_s"] > 0
    assert second_json["outputs"] == first_json["outputs"]
    assert "== warm-up " in second.stderr and "the run compiled" in second.stderr  # the text: stderr under --json
    # stderr is a pipe: a plain line per phase (and per quarter of it), no bars
    executables = 3 if jax.default_backend() == "cpu" else 2
    for line in ("loading (float32): ", f"compiling: {executables}/{executables} executable in ",
                 "prefill: 11/11 token in ", "decode: 8/8 token in "):
        assert line in second.stderr, second.stderr
    assert "\r" not in second.stderr


def test_demo_and_walkthrough_keep_the_cache(tmp_path):
    """The default folder ($JAXPREP_CACHE_DIR here) fills; with --no-compile-cache it stays empty."""
    for name, argv in (("demo", ["demo"]), ("walkthrough", ["walkthrough", "--steps", "1"])):
        folder = tmp_path / name
        folder.mkdir()
        run_jaxprep(*argv, cache_dir=str(folder))
        assert os.listdir(folder), f"jaxprep {name} wrote nothing to the compilation cache"
    off = tmp_path / "off"
    off.mkdir()
    run_jaxprep("demo", "--no-compile-cache", cache_dir=str(off))
    assert not os.listdir(off)
