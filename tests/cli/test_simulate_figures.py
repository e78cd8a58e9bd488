"""`jaxprep simulate`'s figures: the prepare figure agrees with benchmarks/bench_serving_step.py's
number for the same shape, measured in the same test; a second run warms up from the persistent
compilation cache the CLI keeps by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli.test_simulate import ROOT, SMALL

FACTOR = 4.0
"""How far apart the two prepare figures may be: they time the same work (apply one step's updates to
the donated tables, prepare the padded step) with different payloads (the serving loop's `StepUpdates`
against the benchmark's counters and two scatters) and different endings (ready on the device against
fetched to the host)."""

BENCHMARK = """
import sys
sys.path.insert(0, "benchmarks")
import bench_serving_step as bench

config, arrays = bench.make_batch(num_reqs=4, num_tokens=16, max_model_len=64, block_size=16, decode_only=False)
row, fns = bench.setup_batch("simulate shape", config, arrays, steps=16)
print(bench.time_rows([(row, fns)], repeats=100, rounds=5)[0]["ours_us"])
"""
"""bench_serving_step.py's jaxprep figure (update + prepare + fetch, µs) at SMALL's shape: 4 rows, budget 16
(bucket 16), max_model_len 64, blocks of 16."""


def run_python(*args: str, cache_home: str) -> str:
    """Runs python with ``args`` in the repository root, the CLI's default cache under ``cache_home``
    (as $XDG_CACHE_HOME); returns the last stdout line."""
    env = dict(os.environ, XDG_CACHE_HOME=cache_home,
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("JAXPREP_CACHE_DIR", None)  # the default folder is under $XDG_CACHE_HOME
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The CLI run twice at SMALL's shape with one cache folder, the prepare part timed (--time-prepare): (folder,
    first figures, second figures)."""
    cache_home = tmp_path_factory.mktemp("cache_home")
    first, second = (json.loads(run_python("-m", "jaxprep", "--json", "--time-prepare", *SMALL,
                                                 cache_home=str(cache_home)))
                     for _ in range(2))
    return cache_home, first, second


def test_the_cache_serves_the_second_warmup(two_runs):
    cache_home, first, second = two_runs
    assert first["compile_cache"] == second["compile_cache"] == str(cache_home / "jaxprep")
    # the updates at 2 payload rungs + the step at buckets 8 and 16 (+ the steady updates' program, applied apart
    # on the CPU: --update-dispatch auto)
    executables = 5 if first["update_dispatch"] == "separate" else 4
    assert first["warmup_compiles"] == executables and first["warmup_cache_hits"] == 0, first
    assert second["warmup_compiles"] == second["warmup_cache_hits"] == executables, second
    assert second["compiles_after_warmup"] == 0
    for name in ("step_us", "dispatch_us", "prepare_us"):
        assert 0 < second[f"{name}_median"] <= second[f"{name}_p99"]
    assert set(second["figures"]) == {"step_us", "dispatch_us", "prepare_us", "tokens_per_s", "prefill_tokens_per_s",
                                      "decode_tokens_per_s", "warmup_s"}


@pytest.mark.cpu_only("the band is set for the CPU, where both figures end on the host; on a GPU the "
                      "benchmark's figure adds a device-to-host fetch the CLI's does not wait for")
def test_prepare_figure_matches_the_benchmark(two_runs):
    cache_home, _, second = two_runs
    assert second["prepare_us_median"] < second["dispatch_us_median"] < second["step_us_median"]
    bench_us = float(run_python("-c", BENCHMARK, cache_home=str(cache_home)))
    assert 1 / FACTOR <= second["prepare_us_median"] / bench_us <= FACTOR, (second["prepare_us_median"], bench_us)
    # negative control: the dispatch figure, which adds the model's forward pass, falls outside the band
    assert second["dispatch_us_median"] / bench_us > FACTOR, (second["dispatch_us_median"], bench_us)
