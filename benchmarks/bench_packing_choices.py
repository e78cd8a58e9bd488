"""Two packing choices of the door, each against what came before it: `VllmAdapter` on vLLM's scheduler, one process.

    PYTHONPATH=. python benchmarks/bench_packing_choices.py [--choice leading|door|admissions] [--sizes 64,256,1024]
        [--steps 24] [--rounds 10]

- ``--choice leading`` (default): a large update's leading buffers (`PackedStep.before`) cut at the bulk rung
  (`update_packing.bulk_rungs`: the rung that holds a step's admission, one `apply_packed` call for most
  admissions) against cutting them at the top rung of `payload_buckets` (one call per top-rung buffer, the last
  one widened);
- ``--choice door``: the step's buffer padded to the first of its bucket's door rungs (`batch.door_rungs`: at
  most two per bucket, so the warm-up compiles at most two door programs per bucket) against the buffer at its
  own rung (a door program per bucket and step rung);
- ``--choice admissions``: at the buckets that take a step's admissions whole (`batch.takes_admissions_whole`:
  more tokens than the top step rung has words) the door's general program at the bulk rung, so an admission's
  update and the step go in one call, against the top step rung there (a bulk `apply_packed`, then the door).

Both sides replay bench_vllm_adapter.py's recorded ``SchedulerOutput``s (its workload: N requests at once,
chunked prefills, then decodes) through ``VllmAdapter.step`` until the step is ready, alternating replay by
replay (each compiled in a first, untimed replay). Reported: mean µs per step over all steps, over the admission
steps (those with ``scheduled_new_reqs``) and over the others, each side's median over ``--rounds`` replays, the
median of the paired differences of the all-steps means, and what a warm-up of the configuration compiles on
each side (`ServingBatch.warmup`'s executables).
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

from jaxprep.serving import ServingBatch, update_packing
from jaxprep.serving.host import batch as batch_module
from jaxprep.serving.host.vllm import VllmAdapter

BULK_LADDER, DOOR_BUFFER, DOOR_RUNGS = update_packing._ladder, batch_module.door_buffer, batch_module.door_rungs


def top_ladder(config):
    """The packing ladder with the leading buffers cut at the top rung (no bulk rung)."""
    ladder = BULK_LADDER(config)
    return ladder._replace(leading=ladder.buckets)


def own_rung(config, bucket, buffer, steady=False):
    """The step's buffer at its own rung, as before the door rungs."""
    return buffer


def every_rung(config, bucket, steady=False):
    """Every step rung, as before the door rungs (the warm-up's door programs)."""
    return update_packing.step_payload_buckets(config)


def step_rungs(config, bucket, steady=False):
    """The door rungs without the bulk rung (the steady programs' for every program), as before a bucket took a
    step's admissions whole."""
    return DOOR_RUNGS(config, bucket, steady=True)


def use(choice: str, after: bool) -> None:
    """The packing of ``choice``: as it is now (``after``) or as before it."""
    update_packing._ladder = BULK_LADDER if after or choice != "leading" else top_ladder
    batch_module.door_buffer = DOOR_BUFFER if after or choice != "door" else own_rung
    batch_module.door_rungs = DOOR_RUNGS if after or choice not in ("door", "admissions") else \
        every_rung if choice == "door" else step_rungs


def replay(config, recorded: list) -> np.ndarray:
    """Seconds per step of one replay, with the packing `use` set."""
    adapter, times = VllmAdapter(config), []
    adapter.batch.steady_programs = True  # as after `ServingBatch.warmup` (bench_vllm_adapter.replay_jaxprep)
    for so, (_, sampled) in zip(copy.deepcopy([so for so, _ in recorded]), recorded):
        start = time.perf_counter()
        step = adapter.step(so)
        jax.block_until_ready(ready(step))
        times.append(time.perf_counter() - start)
        record_step(adapter, config, step, sampled)
    return np.array(times)


def cell(before: np.ndarray, after: np.ndarray, steps) -> str:
    """"before -> after": each side's median over its replays of the mean µs of ``steps``."""
    return " -> ".join(f"{np.median(runs[:, steps].mean(axis=1)) * 1e6:.0f}" for runs in (before, after))


def warmup_size(config, after: bool, choice: str) -> int:
    use(choice, after)
    return len(list(ServingBatch(config)._warmup_executables()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--choice", default="leading", choices=("leading", "door", "admissions"))
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(machine_line())
    print(RUNTIME)
    print(f"choice: {args.choice}")
    print("| requests | admission steps | all steps µs: before -> after | admission steps | other steps | "
          "paired difference µs | warm-up executables |")
    print("|---:|---:|---|---|---|---:|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        work = workload(size, args.steps)
        recorded, config = record_outputs(work), serving_config(work)
        admission = np.array([bool(so.scheduled_new_reqs) for so, _ in recorded])
        runs = {False: [], True: []}
        for number in range(args.rounds + 1):  # the first round compiles
            for after in (False, True) if number % 2 == 0 else (True, False):
                use(args.choice, after)
                times = replay(config, recorded)
                if number:
                    runs[after].append(times)
        before, after = np.array(runs[False]), np.array(runs[True])
        paired = np.median(after.mean(axis=1) - before.mean(axis=1)) * 1e6
        warm = " -> ".join(str(warmup_size(config, side, args.choice)) for side in (False, True))
        print(f"| {size} | {admission.sum()} | {cell(before, after, slice(None))} | {cell(before, after, admission)} | "
              f"{cell(before, after, ~admission)} | {paired:+.0f} | {warm} |", flush=True)
    use(args.choice, True)
    print(load_line())


if __name__ == "__main__":
    main()
