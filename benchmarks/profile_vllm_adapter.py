"""Where a `VllmAdapter` step's time goes, phase by phase, on the decode steps of vLLM's real scheduler.

    PYTHONPATH=. python benchmarks/profile_vllm_adapter.py [--sizes 64,256,1024] [--steps 32] [--rounds 3]

The workload and the recorded ``SchedulerOutput``s are bench_vllm_adapter.py's. Each replayed step is the
adapter's own ``VllmAdapter.step``, its parts timed by clocks around the functions that do them (each
part's own time: a part called inside another is taken out of the outer one), so the same script times any
checkout:

- *translate*: ``VllmAdapter._plan`` (vLLM's output read: `jaxprep.serving.host.vllm_columns` for a common
  step, else the checks of `jaxprep.serving.host.vllm_checks` and the translation into one `StepUpdates`);
- *checks*: the host checks against the mirror (`jaxprep.serving.host.column_checks.check_columns`, or
  `jaxprep.serving.host.checks.check_updates`);
- *pack*: the update as its int32 buffers (`update_packing.pack_columns` / `pack_step`);
- *dispatch*: the rest of ``step``: the jitted call(s) until they return (the packed update applied and the
  step prepared);
- *wait*: ``block_until_ready`` of the prepared step.

Reported, for the decode-only steps and for the admission steps (those with ``scheduled_new_reqs``): the
median µs of each phase over those steps of the best round (the round with the least total); for the
admission steps also the median new requests per step and the host phases (translate + checks + pack) per
new request; and the function calls of one ``step`` (cProfile, median over those steps: Python functions and
the C functions they call, NumPy's included), which stay flat in the batch size on the decode steps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import numpy as np
from bench_vllm_adapter import PHASES, RUNTIME, phase_clock, record_outputs, record_step, serving_config, workload
from common import PartClock, load_line, machine_line

from jaxprep.serving.host.vllm import VllmAdapter


def timed_step(adapter: VllmAdapter, so, clock: PartClock) -> tuple[dict, object]:
    """One `VllmAdapter.step`, its parts timed apart: ({phase: seconds}, the step)."""
    clock.reset()
    start = time.perf_counter()
    step = adapter.step(so)
    stepped = time.perf_counter()
    jax.block_until_ready(step.buffer if hasattr(step, "buffer") else step.inputs)
    out = dict(clock.seconds, wait=time.perf_counter() - stepped)
    out["dispatch"] = stepped - start - sum(out[p] for p in ("translate", "checks", "pack"))
    return out, step


def step_calls(adapter: VllmAdapter, so) -> tuple[int, object]:
    """The function calls of one `VllmAdapter.step` (cProfile's count), and the step."""
    profile = cProfile.Profile()
    profile.enable()
    step = adapter.step(so)
    profile.disable()
    jax.block_until_ready(step.buffer if hasattr(step, "buffer") else step.inputs)
    return pstats.Stats(profile).total_calls, step


def replay(config, recorded: list, count_calls: bool = False) -> list:
    """Per step: its phases ({phase: seconds}), or with ``count_calls`` its function calls."""
    adapter, out, clock = VllmAdapter(config), [], phase_clock()
    adapter.batch.steady_programs = True  # as after `ServingBatch.warmup` (bench_vllm_adapter.replay_jaxprep)
    outputs = copy.deepcopy([so for so, _ in recorded])
    with contextlib.nullcontext() if count_calls else clock.timing():
        for so, (_, sampled) in zip(outputs, recorded):
            measured, step = step_calls(adapter, so) if count_calls else timed_step(adapter, so, clock)
            out.append(measured)
            record_step(adapter, config, step, sampled)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(machine_line())
    print(RUNTIME)
    print("| requests | steps | new requests | " + " | ".join(f"{p} µs" for p in PHASES)
          + " | total µs | host µs per new request | calls per step |")
    print("|---:|---|---:|" + "---:|" * (len(PHASES) + 3))
    for size in (int(s) for s in args.sizes.split(",")):
        work = workload(size, args.steps)
        recorded = record_outputs(work)
        config = serving_config(work)
        replay(config, recorded)  # compiles
        calls = replay(config, recorded, count_calls=True)
        new = [len(so.scheduled_new_reqs) for so, _ in recorded]
        kinds = {"decode": [not n and max(so.num_scheduled_tokens.values()) == 1 for n, (so, _) in zip(new, recorded)],
                 "admission": [n > 0 for n in new]}
        rounds = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            phases = replay(config, recorded)
            for kind, chosen in kinds.items():
                steps = [p for p, c in zip(phases, chosen) if c]
                if steps:
                    rounds[kind].append({phase: np.median([s[phase] for s in steps]) * 1e6 for phase in PHASES})
        for kind, chosen in kinds.items():
            if not rounds[kind]:
                continue
            best = min(rounds[kind], key=lambda r: sum(r.values()))
            count = float(np.median([n for n, c in zip(new, chosen) if c]))
            host = sum(best[p] for p in ("translate", "checks", "pack"))
            per_request = f"{host / count:.1f}" if count else "-"
            step_calls_median = float(np.median([n for n, c in zip(calls, chosen) if c]))
            print(f"| {size} | {kind} | {count:.0f} | " + " | ".join(f"{best[p]:.0f}" for p in PHASES)
                  + f" | {sum(best.values()):.0f} | {per_request} | {step_calls_median:.0f} |", flush=True)
    print(load_line())


if __name__ == "__main__":
    main()
