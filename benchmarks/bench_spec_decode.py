"""What n-gram speculative decoding costs and gains in the serving loop, in one process.

    PYTHONPATH=. python benchmarks/bench_spec_decode.py [--k 3] [--lookup-min 5] [--lookup-max 5] [--workload random]

1. The drafter alone: `jaxprep.serving.spec_decode.ngram.propose_ngram` jitted on random token tables
   (small vocabulary, so rows repeat), median of many calls.
2. The loop: `jaxprep simulate`'s default workload and tiny model, served without drafts and with
   ``--spec-decode ngram``; each dispatch (schedule, fused jitted step, tokens back) is timed. The
   added step cost of drafting and verification is the ratio of the median dispatch times; the gain
   is fewer dispatches for the same output tokens. Compile time (warm-up) is reported apart.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import add_runtime_argument, configure_benchmark_runtime, machine_line, median_us

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxprep.cli import simulate  # noqa: E402
from jaxprep.serving import Engine  # noqa: E402
from jaxprep.serving.spec_decode.ngram import NgramConfig, propose_ngram_jit  # noqa: E402


def drafter_us(rows: int, width: int, k: int, config: NgramConfig, repeats: int) -> float:
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.integers(0, 8, (rows, width)), jnp.int32)
    num_tokens = jnp.asarray(rng.integers(width // 2, width, rows), jnp.int32)
    active = jnp.ones(rows, bool)

    def call():
        jax.block_until_ready(propose_ngram_jit(table, num_tokens, active, k=k, config=config, max_model_len=width))

    return median_us(call, repeats)


def serve(config, model, workload, seed: int) -> dict:
    engine = Engine(config, model, seed=seed)
    warmup_s = engine.warmup()
    engine.submit(copy.deepcopy(workload.requests), workload.arrival_steps)
    times = []
    while engine._arrivals or engine.has_unfinished:  # Engine.run, with each dispatch timed
        if not engine.has_unfinished:
            engine.iteration = max(engine.iteration, engine._arrivals[0][0])
        while engine._arrivals and engine._arrivals[0][0] <= engine.iteration:
            engine.add_request(engine._arrivals.pop(0)[2])
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        engine.iteration += 1
    stats = engine.stats
    return dict(warmup_s=warmup_s, dispatches=stats.dispatches, output_tokens=stats.output_tokens,
                dispatch_us=statistics.median(times) * 1e6, total_s=sum(times),
                acceptance=stats.acceptance_rate, mean_len=stats.mean_acceptance_length,
                outputs={r.request_id: r.output_token_ids for r in engine.finished})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--lookup-min", type=int, default=5)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--workload", choices=["random", "repetitive"], default="random")
    parser.add_argument("--repeats", type=int, default=200)
    add_runtime_argument(parser)
    args = parser.parse_args()
    lookup = NgramConfig(prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max)
    print(f"== n-gram speculative decoding, k={args.k}, lookup {args.lookup_min}..{args.lookup_max}")
    print(machine_line())
    print(RUNTIME)
    print("-- drafter alone (propose_ngram, jitted)")
    for rows, width in [(16, 256), (64, 2048), (256, 4096)]:
        us = drafter_us(rows, width, args.k, lookup, args.repeats)
        print(f"  rows {rows:4d} x max_model_len {width:5d}: {us:9.1f} us")

    cli_args = argparse.Namespace(**{**simulate.DEFAULTS, "model": None, "max_prompt_len": simulate.DEFAULTS[
        "max_prompt_len"], "spec_decode": None, "num_speculative_tokens": None, "prompt_lookup_min": None,
        "prompt_lookup_max": None, "workload": args.workload, "devices": 1})
    config, model, _, workload = simulate._setup(cli_args)
    spec = dataclasses.replace(config, num_speculative_tokens=args.k, ngram=lookup)
    plain_run, spec_run = serve(config, model, workload, 0), serve(spec, model, workload, 0)
    assert plain_run["outputs"] == spec_run["outputs"], "greedy outputs differ with speculation"
    print(f"-- serving loop: jaxprep simulate defaults, --workload {args.workload} ({len(workload.requests)} requests)")
    print(f"  {'':10s} {'warmup s':>9s} {'dispatches':>11s} {'out tokens':>11s} {'median us':>10s} {'total s':>8s}")
    for name, run in (("plain", plain_run), ("ngram", spec_run)):
        print(f"  {name:10s} {run['warmup_s']:9.1f} {run['dispatches']:11d} {run['output_tokens']:11d} "
              f"{run['dispatch_us']:10.0f} {run['total_s']:8.2f}")
    ratio = {key: spec_run[key] / plain_run[key] for key in ("dispatch_us", "dispatches", "total_s")}
    print(f"  added cost per dispatch: {ratio['dispatch_us']:.2f}x; dispatches {ratio['dispatches']:.2f}x; "
          f"total {ratio['total_s']:.2f}x")
    print(f"  acceptance rate {spec_run['acceptance']:.3f}, mean acceptance length {spec_run['mean_len']:.2f}; "
          "outputs identical: yes")


if __name__ == "__main__":
    main()
