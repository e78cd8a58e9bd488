"""Where a `VllmAdapter` step's time goes, phase by phase, on the decode steps of vLLM's real scheduler.

    PYTHONPATH=. python benchmarks/profile_vllm_adapter.py [--sizes 64,256,1024] [--steps 32] [--rounds 3]

The workload and the recorded ``SchedulerOutput``s are bench_vllm_adapter.py's. Each replayed step runs the
adapter's parts one after the other with a clock between them, as `VllmAdapter.step` runs them:

- *translate*: ``VllmAdapter._plan`` (the checks of `jaxprep.serving.host.vllm_checks` and the translation into
  one `StepUpdates`);
- *checks*: `jaxprep.serving.host.checks.check_updates` (the host checks against the mirror);
- *pack*: `ServingBatch.pack` (the update as its int32 buffers);
- *dispatch*: the jitted call(s) until they return (the packed update applied and the step prepared;
  on a checkout without `ServingBatch.dispatch_prepare`, `apply_packed` then `prepare_padded`);
- *wait*: ``block_until_ready`` of the prepared step.

Reported, for the decode-only steps and for the admission steps (those with ``scheduled_new_reqs``): the
median µs of each phase over those steps of the best round (the round with the least total); for the
admission steps also the median new requests per step and the host phases (translate + checks + pack) per
new request.
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
from bench_vllm_adapter import RUNTIME, record_outputs, serving_config, workload
from common import load_line, machine_line

from jaxprep.serving import transitions
from jaxprep.serving.host import checks
from jaxprep.serving.host.vllm import GRAMMAR_NOT_GIVEN, VllmAdapter

PHASES = ("translate", "checks", "pack", "dispatch", "wait")


def timed_step(adapter: VllmAdapter, so) -> tuple[dict, object]:
    """One `VllmAdapter.step`, its parts timed apart: ({phase: seconds}, what record_sampled reads)."""
    batch, times = adapter.batch, {}
    start = time.perf_counter()
    plan = adapter._plan(so, GRAMMAR_NOT_GIVEN)
    times["translate"] = time.perf_counter()
    rows = checks.check_updates(batch.rows, plan.updates, adapter.config)
    times["checks"] = time.perf_counter()
    packed = batch.pack(plan.updates)
    times["pack"] = time.perf_counter()
    fused = getattr(batch, "dispatch_prepare", None)
    if fused is not None:
        step = fused(packed, plan.num_tokens_padded)
    else:
        for buffer in packed.buffers:
            batch.state = transitions.apply_packed(batch.state, buffer, config=adapter.config)
        step = batch.prepare(plan.num_tokens_padded)
    times["dispatch"] = time.perf_counter()
    jax.block_until_ready(step)
    times["wait"] = time.perf_counter()
    batch.rows = rows
    adapter.rows, adapter.admitted, adapter._free = plan.requests.rows, plan.requests.admitted, plan.requests.free
    adapter._verifying = plan.verifying
    previous, out = start, {}
    for phase in PHASES:
        out[phase], previous = times[phase] - previous, times[phase]
    return out, step


def idx_mapping_of(step):
    return step.idx_mapping if hasattr(step, "idx_mapping") else step


def replay(config, recorded: list) -> list[dict]:
    adapter, phases = VllmAdapter(config), []
    outputs = copy.deepcopy([so for so, _ in recorded])
    for so, (_, sampled) in zip(outputs, recorded):
        times, step = timed_step(adapter, so)
        phases.append(times)
        req_ids = sorted(so.num_scheduled_tokens, key=adapter.rows.__getitem__)
        rows = config.prep.num_reqs_padded(adapter.config.prep.bucket_for(so.total_num_scheduled_tokens))
        tokens, counts = np.zeros((rows, 1), np.int32), np.zeros(rows, np.int32)
        for b, req_id in enumerate(req_ids):
            if sampled[req_id]:
                tokens[b, 0], counts[b] = sampled[req_id][0], 1
        adapter.batch.record_sampled(idx_mapping_of(step), jax.device_put(tokens), jax.device_put(counts))
        jax.block_until_ready(adapter.batch.state)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(machine_line())
    print(RUNTIME)
    print("| requests | steps | new requests | " + " | ".join(f"{p} µs" for p in PHASES)
          + " | total µs | host µs per new request |")
    print("|---:|---|---:|" + "---:|" * (len(PHASES) + 2))
    for size in (int(s) for s in args.sizes.split(",")):
        work = workload(size, args.steps)
        recorded = record_outputs(work)
        config = serving_config(work)
        replay(config, recorded)  # compiles
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
            print(f"| {size} | {kind} | {count:.0f} | " + " | ".join(f"{best[p]:.0f}" for p in PHASES)
                  + f" | {sum(best.values()):.0f} | {per_request} |", flush=True)
    print(load_line())


if __name__ == "__main__":
    main()
