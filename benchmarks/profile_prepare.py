"""Where a prepare step's time goes, shape by shape: kernels, the fixed cost of a call, the fetch.

    PYTHONPATH=. python benchmarks/profile_prepare.py [--steps 200] [--top 6] [--default-runtime]

For each of bench_prepare.py's shapes, in one process:

- the compiled `jaxprep.prepare.prepare_packed` executable: its kernel count (the instructions of the
  entry computation that run as thunks: fusions, gathers, scatters, dots, copies ...);
- per step (wall times: best of 5 interleaved medians): the kernels' summed time in a
  `jax.profiler` trace (XLA:CPU runs them on the host, so a trace event per kernel) and the most
  expensive ones; the call alone (dispatch and
  ``block_until_ready``, no fetch); the whole `prepare_to_host` (fetch and unpack included); and
  the floor of any call with this signature: a jitted function of the same state returning two
  small arrays;
- the baseline's (`vllm_v1_baseline.VllmV1HostPrep`) whole step and its block-table copy alone.

The profiler adds ~0.5 µs per kernel event; compare kernel sums with each other, and wall times
with wall times.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from common import configure_benchmark_runtime

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
from bench_prepare import SHAPES, make_batch, v1_baseline  # noqa: E402
from common import add_runtime_argument, interleaved_us, load_line, machine_line  # noqa: E402

from jaxprep import BatchState  # noqa: E402
from jaxprep.prepare import prepare_packed, prepare_to_host  # noqa: E402

NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def entry_kernels(hlo_text: str) -> list[str]:
    """Names of the entry computation's instructions that run (thunks), in program order."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    names = []
    for name, opcode in re.findall(r"^\s+(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(", entry, flags=re.MULTILINE):
        if opcode not in NOT_KERNELS:
            names.append(name)
    return names


def kernel_times(fn, kernels: list[str], steps: int) -> dict[str, float]:
    """µs per step of every kernel (by name) in a profiler trace of ``steps`` calls: its median
    duration times its runs per step (a median, so one preempted run does not count 1/steps of it)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                fn()
        paths = [os.path.join(d, f) for d, _, files in os.walk(trace_dir) for f in files if f.endswith(".xplane.pb")]
        profile = jax.profiler.ProfileData.from_file(paths[0])
    wanted, durations = set(kernels), collections.defaultdict(list)
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in wanted:
                    durations[event.name].append(event.duration_ns / 1e3)
    return {name: statistics.median(runs) * len(runs) / steps for name, runs in durations.items()}


def profile_shape(name, num_reqs, num_tokens, max_model_len, block_size, decode_only, steps, top):
    config, arrays = make_batch(num_reqs, num_tokens, max_model_len, block_size, decode_only)
    state = BatchState.from_numpy(**arrays)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    kernels = entry_kernels(prepare_packed.lower(state, config, bucket).compile().as_text())

    def call():
        return jax.block_until_ready(prepare_packed(state, config, bucket))

    floor = jax.jit(lambda s: (s.num_scheduled_tokens + 1, s.num_computed_tokens[:1]))
    baseline = v1_baseline(config, arrays)
    scheduled, num_reqs_padded = arrays["num_scheduled_tokens"], config.num_reqs_padded(bucket)
    walls = interleaved_us({
        "call": call,
        "to_host": lambda: prepare_to_host(state, config, bucket),
        "floor": lambda: jax.block_until_ready(floor(state)),
        "baseline": lambda: baseline.prepare(scheduled, bucket, num_reqs_padded),
        "baseline_bt_copy": lambda: baseline.commit_block_table(len(scheduled)),
    }, steps, rounds=5)
    times = kernel_times(call, kernels, steps)
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    print(f"\n## {name} (bucket {bucket}, {len(kernels)} kernels)")
    print(f"wall µs: prepare_to_host {walls['to_host']:.1f} = call {walls['call']:.1f} + fetch/unpack "
          f"{walls['to_host'] - walls['call']:.1f}; floor of a call {walls['floor']:.1f}; "
          f"vLLM V1 {walls['baseline']:.1f} (of which block-table copy {walls['baseline_bt_copy']:.1f})")
    print(f"kernels µs (profiled, median per kernel): sum {sum(times.values()):.1f}; top: "
          + ", ".join(f"{k} {v:.1f}" for k, v in ranked))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=6)
    add_runtime_argument(parser)
    args = parser.parse_args()
    print(f"machine: {machine_line()}; {load_line()}")
    print(RUNTIME)
    for shape in SHAPES:
        profile_shape(*shape, steps=args.steps, top=args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
