"""Handoff cost of one prepared step from JAX to torch: one packed buffer vs one DLPack capsule per field.

    PYTHONPATH=. python benchmarks/bench_bridge.py [--iters 2000] [--rounds 5] [--features]

Both strategies build the same `TorchStepInputs` (int64 positions and slot_mapping, host ints and
host mirrors) from an already prepared step. As in a serving loop, every timed call gets a step prepared just
before it (outside the
clock): the first DLPack export and the first host read of a JAX array cost more than later ones,
so bridging one step over and over flatters the per-field strategy (printed too, as "same step").
The previous step's tensors are freed outside the clock. Sets PJRT_NPROC=1 and synchronous CPU dispatch
(`jaxprep.cli.configure_runtime`) before JAX starts. Warms up first and reports the first call
(compilation) apart; rounds alternate the strategies so drift hits both alike. Prints the median
microseconds per step of each strategy and their ratio, with the machine and versions.
A third row, ``buffer``, hands over the step as the serving door prepares it, one `StepBuffer` (packed
inside the jit that prepared it, `jaxprep.step_buffer.prepare_buffer`): no pack of its own, one capsule.
``--features`` turns on `BENCH_FEATURES` (the feature inputs are `BatchState.empty`'s: the values
do not change the work), so the run shows what the features' outputs add to a handoff.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import statistics
import subprocess
import time

from jaxprep.cli import configure_runtime

configure_runtime()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.config import cdiv  # noqa: E402
from jaxprep.state import OPTIONAL_FIELDS  # noqa: E402
from jaxprep.step_buffer import prepare_buffer  # noqa: E402
from jaxprep.walkthrough.examples import sequential_block_table  # noqa: E402
from torch_bridge.step import STRATEGIES  # noqa: E402

BENCH_FEATURES = jaxprep.FeatureConfig(
    num_speculative_tokens=2, discard_request_mask=True, mrope=True, prompt_embeds=True, request_distribution=True,
    kv_groups=(jaxprep.KVCacheGroupSpec(16), jaxprep.KVCacheGroupSpec(32, kernel_block_size=16)))
"""Every feature with array outputs but DCP: 17 more bridged fields (2 groups, 8 spec-decode, ...)."""


def workload(num_decodes: int, prefill_chunk: int, features: jaxprep.FeatureConfig | None = None):
    """``num_decodes`` decodes of ~1k-token contexts plus one chunked prefill, on a 64-row state."""
    config = jaxprep.PrepConfig(max_num_reqs=64, max_model_len=4096, max_num_batched_tokens=512, block_size=16,
                                features=features or jaxprep.FeatureConfig())
    rng = np.random.default_rng(0)
    rows = config.max_num_reqs
    computed = np.zeros(rows, np.int32)
    scheduled = np.zeros(rows, np.int32)
    computed[:num_decodes] = rng.integers(500, 1500, num_decodes)
    scheduled[:num_decodes] = 1
    computed[num_decodes] = 1024
    scheduled[num_decodes] = prefill_chunk
    blocks = [cdiv(int(c + s), config.block_size) for c, s in zip(computed, scheduled)]
    state = jaxprep.BatchState.from_numpy(
        token_ids=rng.integers(1, 32000, (rows, config.max_model_len), dtype=np.int32),
        block_table=sequential_block_table(blocks, config.max_blocks_per_req),
        num_computed_tokens=computed, num_scheduled_tokens=scheduled)
    empty = jaxprep.BatchState.empty(config)
    feature_inputs = {name: getattr(empty, name) for name in OPTIONAL_FIELDS if getattr(empty, name) is not None}
    return config, dataclasses.replace(state, **feature_inputs)


def time_calls(fn, make_input, iters: int) -> list[float]:
    """Seconds of ``fn(make_input())`` (only the call is timed); CPU results are ready on return."""
    samples = []
    for _ in range(iters):
        x = make_input()
        start = time.perf_counter()
        result = fn(x)
        samples.append(time.perf_counter() - start)
        del result, x
    return samples


def describe_machine() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = "?"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__} "
            f"({jax.default_backend()}), torch {torch.__version__}, commit {commit or '?'}, "
            f"PJRT_NPROC={os.environ.get('PJRT_NPROC')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="calls per strategy per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decodes", type=int, default=48)
    parser.add_argument("--prefill-chunk", type=int, default=200)
    parser.add_argument("--features", action="store_true", help="turn on BENCH_FEATURES")
    args = parser.parse_args()
    config, state = workload(args.decodes, args.prefill_chunk, BENCH_FEATURES if args.features else None)
    step = jax.block_until_ready(jaxprep.prepare_inputs(state, config))
    print(f"machine: {describe_machine()}")
    print(f"step: {args.decodes} decodes + 1 prefill chunk of {args.prefill_chunk} -> "
          f"num_tokens_padded {step.num_tokens_padded}, num_reqs_padded {step.num_reqs_padded}, "
          f"block table width {config.max_blocks_per_req}, features {'on' if args.features else 'off'}")
    bridges = {name: functools.partial(torch_bridge.to_torch, strategy=name) for name in STRATEGIES}
    bridges["buffer"] = torch_bridge.to_torch  # the step as one StepBuffer: one handoff, views by its layout

    def fresh_step():
        return jax.block_until_ready(jaxprep.prepare_padded(state, config, step.num_tokens_padded))

    def fresh_buffer():
        return jax.block_until_ready(prepare_buffer(state, config, step.num_tokens_padded))

    buffer = fresh_buffer()
    makers = {name: (fresh_buffer if name == "buffer" else fresh_step) for name in bridges}
    same_inputs = {name: (buffer if name == "buffer" else step) for name in bridges}
    for name, bridge in bridges.items():
        start = time.perf_counter()
        bridge(same_inputs[name])
        print(f"  first call ({name}, includes compilation): {(time.perf_counter() - start) * 1e3:.1f} ms")
        time_calls(bridge, makers[name], 200)  # warm-up
    fresh = {name: [] for name in bridges}
    same = {name: [] for name in bridges}
    for _ in range(args.rounds):
        for name, bridge in bridges.items():
            fresh[name] += time_calls(bridge, makers[name], args.iters)
            same[name] += time_calls(bridge, lambda name=name: same_inputs[name], args.iters)
    prepare = time_calls(lambda x: jax.block_until_ready(jaxprep.prepare_padded(*x)),
                         lambda: (state, config, step.num_tokens_padded), args.iters)
    for label, samples in (("fresh step", fresh), ("same step", same)):
        medians = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
        for name, value in medians.items():
            print(f"  {label:10s} to_torch strategy={name:9s}: median {value:7.1f} us/step over "
                  f"{len(samples[name])} steps")
        print(f"  {label:10s} ratio per_field / packed: {medians['per_field'] / medians['packed']:.2f}; "
              f"buffer / packed: {medians['buffer'] / medians['packed']:.2f}")
    print(f"  (for scale) prepare_padded: median {statistics.median(prepare) * 1e6:7.1f} us/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
