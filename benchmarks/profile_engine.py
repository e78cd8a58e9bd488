"""Where the `Engine`'s host step goes, phase by phase, on ``jaxprep simulate``'s workload.

    PYTHONPATH=. python benchmarks/profile_engine.py [--rounds 5] [simulate flags, e.g. --max-num-reqs 64]

``jaxprep simulate`` reports ``step_us`` (one host iteration: schedule, pack, dispatch, read the tokens back,
update the scheduler) and ``dispatch_us`` (of it, the step's call until its tokens are host arrays); their
difference is the host's own work. Here the same loop (the `Engine` `jaxprep simulate` builds, warmed up, with
its history kept) runs ``--rounds`` times; each iteration's host time is ``step_us - dispatch_us``, and clocks
around the functions that do the host's parts split it (each part's own time, any checkout):

- *schedule*: ``Scheduler.schedule``;
- *updates*: the scheduler output as the update (``engine.scheduler_columns``, or ``engine.scheduler_updates``);
- *pack*: ``ServingBatch.pack`` (the update as its int32 buffers);
- *count*: ``Engine._count`` (the loop's statistics) and ``dispatch_log.dispatch_record``;
- *update*: ``Scheduler.update`` (the step's tokens back into the requests);
- *rest*: what is left of the host time.

Reported: the median over iterations of each part (µs, the round with the least host median), the host
median, and the function calls per iteration (cProfile, one more round: the whole loop, the host checks inside
``ServingBatch.serve`` included).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PartClock, load_line, machine_line

from jaxprep.cli import configure_runtime

configure_runtime()

import numpy as np  # noqa: E402

from jaxprep.cli import parse_args, simulate  # noqa: E402
from jaxprep.serving.host import engine  # noqa: E402
from jaxprep.serving.host.batch import ServingBatch  # noqa: E402
from jaxprep.serving.host.scheduler import Scheduler  # noqa: E402

PARTS = ("schedule", "updates", "pack", "count", "update")
TIMED = ((Scheduler, "schedule", "schedule"), (engine, "scheduler_updates", "updates"),
         (engine, "scheduler_columns", "updates"), (ServingBatch, "pack", "pack"), (engine.Engine, "_count", "count"),
         (engine, "dispatch_record", "count"), (Scheduler, "update", "update"))
"""(module or class, attribute, part): the parts of an iteration, where a checkout has them (`common.PartClock`)."""


def one_run(config, model, args, params, workload, clock: PartClock | None = None, iterations: list | None = None):
    """One serving run of the workload; with ``clock``, each iteration's parts appended to ``iterations``."""
    run_engine = simulate._engine(config, model, args, params)
    run_engine.submit(copy.deepcopy(workload.requests), workload.arrival_steps)
    if clock is None:
        run_engine.run()
    else:
        with clock.timing():
            run_engine.run(on_step=lambda _: iterations.append(clock.reset()))
    return run_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    known, rest = parser.parse_known_args()
    _, args = parse_args(["simulate", *rest])
    config, model, params, workload = simulate._setup(args)
    simulate._engine(config, model, args, params).warmup()
    one_run(config, model, args, params, workload)  # every executable run once
    print(machine_line())
    rounds = []
    for _ in range(known.rounds):
        clock, iterations = PartClock(PARTS, TIMED), []
        run_engine = one_run(config, model, args, params, workload, clock, iterations)
        host = (np.array(run_engine.stats.step_us) - np.array(run_engine.stats.dispatch_us))
        parts = {part: np.array([it[part] for it in iterations]) * 1e6 for part in PARTS}
        parts["rest"] = host - sum(parts.values())
        rounds.append(dict({part: float(np.median(v)) for part, v in parts.items()}, host=float(np.median(host)),
                           dispatches=len(host)))
    best = min(rounds, key=lambda r: r["host"])
    profile = cProfile.Profile()
    profile.enable()
    run_engine = one_run(config, model, args, params, workload)
    profile.disable()
    calls = pstats.Stats(profile).total_calls / run_engine.stats.dispatches
    print(f"simulate {' '.join(rest) or '(defaults)'}: {best['dispatches']} dispatches, rounds {known.rounds}")
    print("| " + " | ".join(f"{p} µs" for p in (*PARTS, "rest", "host")) + " | host medians of the rounds | "
          "calls per iteration |")
    print("|" + "---:|" * (len(PARTS) + 4))
    print("| " + " | ".join(f"{best[p]:.0f}" for p in (*PARTS, "rest", "host")) + " | "
          + ", ".join(f"{r['host']:.0f}" for r in rounds) + f" | {calls:.0f} |")
    print(load_line())


if __name__ == "__main__":
    main()
