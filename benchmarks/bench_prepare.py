"""jaxprep.prepare vs vLLM V1's host-side preparation, in one process: median µs per step and the ratio.

    PYTHONPATH=. python benchmarks/bench_prepare.py [--repeats 100] [--rounds 7] [--default-runtime] [--step-only]

Each cell is the best of ``--rounds`` medians of ``--repeats`` calls; a round times every shape
and both sides in turn, so the rounds spread over the run and load from other processes hits
every cell alike.

The state is already on the device; jaxprep's time includes fetching every output back as host
NumPy arrays (`jaxprep.prepare_to_host`: one packed buffer plus the block table; the
per-field column fetches the 12 arrays of `prepare_padded` one by one). The baseline is vLLM V1's
host-side preparation as vLLM writes it (`vllm_v1_baseline.VllmV1HostPrep`: persistent buffers,
``out=`` arguments, the batch's block-table rows copied each step) on host arrays, padded to the
same bucket; before timing, its step is checked equal to jaxprep's. Compile time is reported apart.

A second table times the step alone on the device (`prepare_padded`, ``block_until_ready``, no
fetch) against the same step built without its fast-path checks (`common.unchecked_step`: no error
word, no dropped rows, no nulled block ids; the benchmark's build only): what the checks cost.
``--step-only`` times just `prepare_padded` (no baseline, no fetch, no unchecked build), for
comparing commits that predate the checks: run it with ``PYTHONPATH`` at each checkout in turn.

Runtime: `jaxprep.cli.configure_runtime()` (one XLA:CPU thread, synchronous dispatch) unless
``--default-runtime``, which keeps JAX's defaults. Goals: ratio ≤ 1.0 at every shape with the
configured runtime, ≤ 1.5 with the defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import configure_benchmark_runtime, uses_default_runtime

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    add_timing_arguments,
    assert_same_step,
    interleaved_us,
    load_line,
    machine_line,
    print_goal_table,
    time_rows,
    unchecked_step,
)
from vllm_v1_baseline import VllmV1HostPrep  # noqa: E402

from jaxprep import BatchState, PrepConfig, prepare_padded  # noqa: E402
from jaxprep.config import cdiv  # noqa: E402
from jaxprep.prepare import prepare_to_host  # noqa: E402

# (name, requests, scheduled tokens, max_model_len, block_size, decode_only)
SHAPES = [
    ("8 req / 512 tok", 8, 512, 4096, 16, False),
    ("64 req / 2048 tok", 64, 2048, 8192, 16, False),
    ("256 req / 8192 tok", 256, 8192, 8192, 16, False),
    ("1024 req / 16384 tok", 1024, 16384, 32768, 16, False),
    ("256 req decode", 256, 256, 8192, 16, True),
]
GOAL, DEFAULT_RUNTIME_GOAL = 1.0, 1.5  # jaxprep time / baseline time, at every shape
CHECKS_GOAL = 1.10  # the step with its fast-path checks / the same step without them, at every shape


def goal() -> float:
    return DEFAULT_RUNTIME_GOAL if uses_default_runtime() else GOAL


def v1_baseline(config: PrepConfig, arrays: dict) -> VllmV1HostPrep:
    """vLLM V1's host path over the batch's tables (adopted, not copied): every row is scheduled."""
    return VllmV1HostPrep(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                          config.block_size, config.max_num_batched_tokens)


def make_batch(num_reqs: int, num_tokens: int, max_model_len: int, block_size: int, decode_only: bool, seed=0):
    """A mixed step: every row scheduled; prefill chunks share the budget, the rest decode at long contexts."""
    rng = np.random.default_rng(seed)
    if decode_only:
        scheduled = np.ones(num_reqs, np.int64)
    else:
        weights = rng.random(num_reqs) + 0.05
        scheduled = np.maximum(1, np.floor(weights / weights.sum() * num_tokens)).astype(np.int64)
        scheduled[0] += num_tokens - scheduled.sum()
    computed = np.array([rng.integers(0, max_model_len - s + 1) for s in scheduled], np.int64)
    config = PrepConfig(max_num_reqs=num_reqs, max_model_len=max_model_len, max_num_batched_tokens=num_tokens,
                        block_size=block_size)
    token_ids = rng.integers(0, 32000, (num_reqs, max_model_len), dtype=np.int32)
    block_table = np.zeros((num_reqs, config.max_blocks_per_req), np.int32)
    ids = rng.permutation(num_reqs * config.min_blocks_per_req) + 1
    for row in range(num_reqs):
        count = cdiv(int(computed[row] + scheduled[row]), block_size)
        block_table[row, :count] = ids[row * config.min_blocks_per_req:][:count]
    arrays = dict(token_ids=token_ids, block_table=block_table, num_computed_tokens=computed.astype(np.int32),
                  num_scheduled_tokens=scheduled.astype(np.int32))
    return config, arrays


def setup_shape(name, num_reqs, num_tokens, max_model_len, block_size, decode_only):
    """Compiles the shape's executables; returns its row of results so far and the callables to time."""
    config, arrays = make_batch(num_reqs, num_tokens, max_model_len, block_size, decode_only)
    state = BatchState.from_numpy(**arrays)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    start = time.perf_counter()
    jax.block_until_ready(prepare_padded(state, config, bucket))
    prepare_to_host(state, config, bucket)
    compile_s = time.perf_counter() - start

    def jaxprep_step():
        return prepare_to_host(state, config, bucket)

    def jaxprep_step_per_field():
        return jax.tree.map(np.asarray, prepare_padded(state, config, bucket))

    baseline = v1_baseline(config, arrays)
    scheduled, num_reqs_padded = arrays["num_scheduled_tokens"], config.num_reqs_padded(bucket)

    def baseline_step():
        return baseline.prepare(scheduled, bucket, num_reqs_padded)

    assert_same_step(jaxprep_step(), baseline_step())
    unchecked = unchecked_step(state, config, bucket)
    assert_same_step(jax.tree.map(np.asarray, unchecked()), baseline_step())  # valid input: the same step
    row = dict(name=name, compile_s=compile_s, goal=goal())
    return row, {"ours": jaxprep_step, "per_field": jaxprep_step_per_field, "base": baseline_step,
                 "device": device_step(state, config, bucket), "unchecked": unchecked}


def device_step(state, config, bucket):
    """`prepare_padded` until its outputs are ready on the device (no fetch)."""
    return lambda: jax.block_until_ready(prepare_padded(state, config, bucket))


def print_checks_table(rows: list[dict]) -> None:
    """The device step with and without its fast-path checks, shape by shape."""
    print("| shape | step µs (checks) | step µs (no checks) | extra µs | ratio | goal | met |")
    print("|---|---:|---:|---:|---:|---:|:-:|")
    for r in rows:
        ratio = r["device_us"] / r["unchecked_us"]
        print(f"| {r['name']} | {r['device_us']:.1f} | {r['unchecked_us']:.1f} | "
              f"{r['device_us'] - r['unchecked_us']:+.1f} | {ratio:.2f}x | ≤{CHECKS_GOAL}x | "
              f"{'yes' if ratio <= CHECKS_GOAL else 'no'} |")


def step_only(args) -> None:
    """``--step-only``: `prepare_padded` alone at every shape, in interleaved rounds."""
    calls = {}
    for name, *shape in SHAPES:
        config, arrays = make_batch(*shape)
        state = BatchState.from_numpy(**arrays)
        calls[name] = device_step(state, config, config.bucket_for(int(arrays["num_scheduled_tokens"].sum())))
        calls[name]()  # compiled before the rounds
    times = interleaved_us(calls, args.repeats, args.rounds)
    print(f"machine: {machine_line()}; {load_line()}")
    print(RUNTIME)
    print("| shape | prepare_padded µs |")
    print("|---|---:|")
    for name, us in times.items():
        print(f"| {name} | {us:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--step-only", action="store_true",
                        help="time only prepare_padded at each shape (any commit: no baseline, no unchecked build)")
    args = parser.parse_args()
    if args.step_only:
        step_only(args)
        return 0
    rows = time_rows([setup_shape(*shape) for shape in SHAPES], args.repeats, args.rounds)
    print(f"machine: {machine_line()}; {load_line()}")
    print(RUNTIME)
    print_goal_table([("jaxprep µs (packed fetch)", "ours_us"), ("jaxprep µs (12 fetches)", "per_field_us"),
                      ("vLLM V1 µs", "base_us")], rows,
                     ("compile s (both)", "compile_s"))
    print()
    print_checks_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
