"""A large update's leading buffers at the bulk rung or at the top rung: `VllmAdapter` on vLLM's scheduler.

    PYTHONPATH=. python benchmarks/bench_leading_buffers.py [--sizes 64,256,1024] [--steps 24] [--rounds 10]

An update the step's payload rungs cannot hold is sent first as leading buffers (`PackedStep.before`), each
applied by `transitions.apply_packed`. They are cut at the bulk rung (`update_packing.bulk_rungs`: the rung that
holds a step's admission, one call for most admissions); the other side cuts them at the top rung of
`payload_buckets`, as before the bulk rung (one call per top-rung buffer, the last one widened). Both replay
bench_vllm_adapter.py's recorded ``SchedulerOutput``s (its workload: N requests at once, chunked prefills, then
decodes) through ``VllmAdapter.step`` until the step is ready, the two sides alternating replay by replay (each
compiled in a first, untimed replay). Reported: mean µs per step over all steps, over the admission steps (those
with ``scheduled_new_reqs``) and over the others, the median over ``--rounds`` replays of each side, and the
median of the paired differences of the all-steps means.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import numpy as np
from bench_vllm_adapter import RUNTIME, ready, record_outputs, record_step, serving_config, workload
from common import load_line, machine_line

from jaxprep.serving import update_packing
from jaxprep.serving.host.vllm import VllmAdapter

BULK_LADDER = update_packing._ladder


def top_ladder(config):
    """The packing ladder with the leading buffers cut at the top rung (no bulk rung)."""
    ladder = BULK_LADDER(config)
    return ladder._replace(leading=ladder.buckets)


def replay(config, recorded: list, side: str) -> np.ndarray:
    """Seconds per step of one replay, the leading buffers cut as ``side`` says ("bulk" or "top")."""
    update_packing._ladder = BULK_LADDER if side == "bulk" else top_ladder
    adapter, times = VllmAdapter(config), []
    adapter.batch.steady_programs = True  # as after `ServingBatch.warmup` (bench_vllm_adapter.replay_jaxprep)
    for so, (_, sampled) in zip(copy.deepcopy([so for so, _ in recorded]), recorded):
        start = time.perf_counter()
        step = adapter.step(so)
        jax.block_until_ready(ready(step))
        times.append(time.perf_counter() - start)
        record_step(adapter, config, step, sampled)
    return np.array(times)


def cell(top: np.ndarray, bulk: np.ndarray, steps) -> str:
    """"top -> bulk": each side's median over its replays of the mean µs of ``steps``."""
    return " -> ".join(f"{np.median(runs[:, steps].mean(axis=1)) * 1e6:.0f}" for runs in (top, bulk))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(machine_line())
    print(RUNTIME)
    print("| requests | admission steps | bulk rung (top) | all steps µs: top -> bulk | admission steps | "
          "other steps | paired difference µs |")
    print("|---:|---:|---|---|---|---|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        work = workload(size, args.steps)
        recorded, config = record_outputs(work), serving_config(work)
        admission = np.array([bool(so.scheduled_new_reqs) for so, _ in recorded])
        for side in ("top", "bulk"):
            replay(config, recorded, side)  # compiles
        runs = {"top": [], "bulk": []}
        for number in range(args.rounds):
            for side in ("top", "bulk") if number % 2 == 0 else ("bulk", "top"):
                runs[side].append(replay(config, recorded, side))
        top, bulk = np.array(runs["top"]), np.array(runs["bulk"])

        paired = np.median(bulk.mean(axis=1) - top.mean(axis=1)) * 1e6
        rungs = update_packing.bulk_rungs(config)
        print(f"| {size} | {admission.sum()} | {rungs[0] if rungs else '-'} "
              f"({update_packing.payload_buckets(config)[-1]}) | {cell(top, bulk, slice(None))} | "
              f"{cell(top, bulk, admission)} | {cell(top, bulk, ~admission)} | {paired:+.0f} |", flush=True)
    update_packing._ladder = BULK_LADDER
    print(load_line())


if __name__ == "__main__":
    main()
