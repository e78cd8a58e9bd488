"""Padding waste of bucket ladders on `jaxprep simulate` traces, and what each ladder costs to compile.

    PYTHONPATH=. python benchmarks/bench_padding.py            # the default simulate trace
    PYTHONPATH=. python benchmarks/bench_padding.py --large    # plus a 2048-token-budget trace

Runs the serving loop once per trace (the default `jaxprep simulate` workload; ``--large``: 300
requests of up to 1500 prompt tokens, 128 rows, budget 2048, a 1-layer model), records the real
tokens of every model iteration, and replays them through each ladder offline: padding waste =
1 - real tokens / bucketed tokens, the loop's own definition (`LoopStats.padding_waste`).
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from jaxprep.cli import configure_runtime

configure_runtime()

from common import load_line, machine_line  # noqa: E402

from jaxprep.cli.simulate import DEFAULTS  # noqa: E402
from jaxprep.config import PrepConfig, default_token_buckets  # noqa: E402
from jaxprep.serving import Engine, ModelConfig, ServingConfig, random_workload  # noqa: E402

LARGE = dict(budget=2048, max_num_reqs=128, max_model_len=2048, num_blocks=4096, requests=300, max_prompt_len=1500,
             max_tokens=200, arrival_spread=200, layers=1, d_model=32, heads=2)


def ladder(budget: int, rungs_per_octave: int, split_from: int) -> tuple[int, ...]:
    """Powers of two from 8, split into ``rungs_per_octave`` from ``split_from`` up, capped at ``budget``."""
    rungs, power = {budget}, 8
    while power < budget:
        rungs.add(power)
        if power >= split_from:
            rungs.update(power + k * power // rungs_per_octave for k in range(1, rungs_per_octave))
        power *= 2
    return tuple(sorted(r for r in rungs if r <= budget))


LADDERS = {
    "default (x1, x1.5 from 64)": default_token_buckets,
    "x1, x1.5 from 32": lambda budget: ladder(budget, 2, 32),
    "powers of two": lambda budget: ladder(budget, 1, 10**9),
    "x1, x1.25, x1.5, x1.75 from 64 (before)": lambda budget: ladder(budget, 4, 64),
}


def run_recorded(sizes: dict, on_dispatch, token_buckets=None) -> PrepConfig:
    """Serves the simulate workload of ``sizes`` (over `DEFAULTS`), calling ``on_dispatch(out, tokens)``
    for every dispatch (the scheduler output and the tokens of each iteration); returns the prep config."""
    args = dict(DEFAULTS, **sizes)
    prep = PrepConfig(max_num_reqs=args["max_num_reqs"], max_model_len=args["max_model_len"],
                      max_num_batched_tokens=args["budget"], block_size=args["block_size"],
                      num_blocks=args["num_blocks"], token_buckets=token_buckets)
    config = ServingConfig(prep=prep, eos_token_id=1, decode_steps=args["decode_steps"])
    model = ModelConfig(vocab_size=args["vocab_size"], num_layers=args["layers"], d_model=args["d_model"],
                        num_heads=args["heads"], d_ff=2 * args["d_model"])
    workload = random_workload(args["seed"], num_requests=args["requests"], vocab_size=args["vocab_size"],
                               prompt_len=(4, min(args["max_prompt_len"], args["max_model_len"] - 1)),
                               max_tokens=(1, args["max_tokens"]), arrival_spread=args["arrival_spread"])
    engine = Engine(config, model, seed=args["seed"])
    count = engine._count

    def recording_count(out, tokens, bucket):
        on_dispatch(out, tokens)
        count(out, tokens, bucket)

    engine._count = recording_count
    engine.submit(workload.requests, workload.arrival_steps)
    engine.run()
    return prep


def record_trace(sizes: dict) -> list[tuple[int, int]]:
    """Per dispatch: (tokens of its first iteration, [tokens of each later decode iteration])."""
    trace = []

    def record(out, tokens):
        later = (tokens[1:] >= 0).sum(axis=1)
        trace.append((out.total_num_scheduled_tokens, [int(n) for n in later if n > 0]))

    budget = dict(DEFAULTS, **sizes)["budget"]
    run_recorded(sizes, record, token_buckets=ladder(budget, 1, 10**9))
    return trace


def waste(trace, buckets: tuple[int, ...]) -> float:
    real = padded = 0
    for first, later in trace:
        bucket = buckets[bisect.bisect_left(buckets, first)]
        real += first + sum(later)
        padded += bucket * (1 + len(later))
    return 1 - real / padded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also a 2048-token-budget trace (~1 min)")
    args = parser.parse_args()
    traces = {f"simulate default (budget {DEFAULTS['budget']})": (record_trace({}), DEFAULTS["budget"])}
    if args.large:
        traces[f"--large (budget {LARGE['budget']})"] = (record_trace(LARGE), LARGE["budget"])
    print(f"machine: {machine_line()}; {load_line()}")
    print("| ladder | rungs at budget 8192 | " + " | ".join(f"waste, {name}" for name in traces) + " |")
    print("|---|---:|" + "---:|" * len(traces))
    for name, make in LADDERS.items():
        cells = [f"{waste(trace, make(budget)):.1%}" for trace, budget in traces.values()]
        print(f"| {name} | {len(make(8192))} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
