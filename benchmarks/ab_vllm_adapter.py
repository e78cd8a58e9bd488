"""Two checkouts' `VllmAdapter.step` side by side in one process: what a change saves or costs on vLLM's real steps.

    PYTHONPATH=. python benchmarks/ab_vllm_adapter.py --base REV [--sizes 64,256,1024] [--steps 24] [--rounds 6]

On a small shared host the same code measures up to ~15% apart from one process to the next (the
``bench_vllm_adapter.py`` ratios of two runs in the same hour), more than a host-side change of a few
percent. Here the revision ``REV``'s ``jaxprep`` (``git archive``, imported under another package name) and
the working tree's replay the same recorded ``SchedulerOutput``s (bench_vllm_adapter.py's workload: vLLM's
real scheduler and the fake model) step by step, in one process: step i of one side, then step i of the
other, the order swapped every round, each side's samples recorded between its steps (untimed), each
step's prepared buffer checked equal across the two sides.

Reported per size: each side's median µs per decode step (no admission, one token per request) and the
median of the paired differences (this tree - ``REV``) over the decode steps of every round. The first
round compiles and is dropped. ``--base HEAD`` against an unchanged tree is the A/A control: its
difference is this method's noise (a few µs). Admission steps are not reported: the few of a replay come
first, right after each round builds its two adapters, and which side goes first moves them by hundreds of
µs.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import numpy as np
from bench_vllm_adapter import RUNTIME, record_outputs, record_step, serving_config, workload
from common import load_line, machine_line

import jaxprep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_PACKAGE = "jaxprep_base"
IMPORTS = re.compile(r"\b(from|import) jaxprep(?=[.\s])")


def import_revision(revision: str, folder: str):
    """``revision``'s ``jaxprep`` package, extracted into ``folder`` and imported as `BASE_PACKAGE` (every
    ``from jaxprep...`` / ``import jaxprep...`` of its modules renamed)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision, "jaxprep"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    package = os.path.join(folder, BASE_PACKAGE)
    os.rename(os.path.join(folder, "jaxprep"), package)
    for directory, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path) as source:
                    text = source.read()
                with open(path, "w") as source:
                    source.write(IMPORTS.sub(rf"\1 {BASE_PACKAGE}", text))
    sys.path.insert(0, folder)
    return importlib.import_module(BASE_PACKAGE)


def paired_replay(sides: dict, recorded: list, rounds: int) -> dict:
    """``{side: [rounds, steps] seconds}`` of each side's ``step`` (``sides``: name -> (adapter class,
    config)), the sides alternating step by step; the first (compiling) round dropped."""
    times = {name: [] for name in sides}
    for number in range(rounds + 1):
        order = list(sides) if number % 2 else list(sides)[::-1]
        adapters = {name: adapter(config) for name, (adapter, config) in sides.items()}
        for adapter in adapters.values():
            adapter.batch.steady_programs = True  # as after `ServingBatch.warmup`
        outputs = {name: copy.deepcopy([so for so, _ in recorded]) for name in sides}
        row = {name: [] for name in sides}
        for i, (_, sampled) in enumerate(recorded):
            words = []
            for name in order:
                start = time.perf_counter()
                step = adapters[name].step(outputs[name][i])
                jax.block_until_ready(step.buffer)
                row[name].append(time.perf_counter() - start)
                words.append(np.asarray(step.buffer.words))
                record_step(adapters[name], sides[name][1], step, sampled)
            if not np.array_equal(*words):
                raise AssertionError(f"step {i}: the two sides prepared different buffers")
        if number:
            for name in sides:
                times[name].append(row[name])
    return {name: np.array(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare the working tree with")
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    base_revision = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.base], check=True,
                                   capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        base = import_revision(args.base, folder)
        print(machine_line())
        print(RUNTIME)
        print(f"| requests | decode steps x rounds | {base_revision} µs (median) | this tree µs | paired difference µs "
              "(median) | relative |")
        print("|---:|---:|---:|---:|---:|---:|")
        for size in (int(s) for s in args.sizes.split(",")):
            work = workload(size, args.steps)
            recorded = record_outputs(work)
            sides = {package.__name__: (importlib.import_module(package.__name__ + ".serving.host.vllm").VllmAdapter,
                                        serving_config(work, package)) for package in (base, jaxprep)}
            times = paired_replay(sides, recorded, args.rounds)
            decode = np.array([not so.scheduled_new_reqs and max(so.num_scheduled_tokens.values()) == 1
                               for so, _ in recorded])
            ours, theirs = (times[name][:, decode] * 1e6 for name in ("jaxprep", BASE_PACKAGE))
            difference = float(np.median(ours - theirs))
            print(f"| {size} | {decode.sum()} x {args.rounds} | {np.median(theirs):.0f} | {np.median(ours):.0f} | "
                  f"{difference:+.1f} | {difference / np.median(theirs):+.1%} |", flush=True)
    print(load_line())


if __name__ == "__main__":
    main()
