"""Soak: a long-running `Engine` keeps flat host memory and a constant set of live device arrays.

    PYTHONPATH=. python benchmarks/soak_engine.py                      # 50,000 dispatches
    PYTHONPATH=. python benchmarks/soak_engine.py --dispatches 5000    # a quick look

A small config and the tiny random model serve an endless stream of random requests (topped up
whenever fewer than ``--live`` are unfinished), handing finished ones out with `Engine.drain_finished`
as a server would. After ``--warmup-dispatches`` it samples, every ``--every`` dispatches, the
resident set size (read from /proc/self/statm, after `gc.collect`) and the live jax arrays
(`jax.live_arrays`: their count and their (shape, dtype) set). It passes (exit 0) when every RSS
sample lies within ``--rss-tolerance`` (2%) of the first one, every live-array set equals the first
one, and nothing compiled after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from jaxprep.cli import configure_runtime

configure_runtime()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import load_line, machine_line  # noqa: E402

from jaxprep import PrepConfig, count_compiles  # noqa: E402
from jaxprep.serving import Engine, ModelConfig, Request, ServingConfig  # noqa: E402

MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64)
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=48, max_num_batched_tokens=16, block_size=4,
                                       num_blocks=24), eos_token_id=1, decode_steps=4)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size: /proc/self/statm's second field (pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


def live_arrays() -> tuple[int, frozenset]:
    """The live jax arrays: their count and the set of (shape, dtype, count of that kind)."""
    kinds: dict = {}
    for array in jax.live_arrays():
        key = (array.shape, str(array.dtype))
        kinds[key] = kinds.get(key, 0) + 1
    return sum(kinds.values()), frozenset((shape, dtype, n) for (shape, dtype), n in kinds.items())


class RequestStream:
    """Random requests with increasing ids: prompts of 1..30 tokens, max_tokens 1..16."""

    def __init__(self, seed: int):
        self.rng, self.next_id = np.random.default_rng(seed), 0

    def take(self, count: int) -> list[Request]:
        out = []
        for _ in range(count):
            prompt = self.rng.integers(2, MODEL.vocab_size, size=int(self.rng.integers(1, 31))).tolist()
            out.append(Request(self.next_id, prompt, max_tokens=int(self.rng.integers(1, 17))))
            self.next_id += 1
        return out


def soak(args) -> dict:
    engine, stream = Engine(CONFIG, MODEL, seed=0), RequestStream(args.seed)
    engine.warmup()
    live, finished, samples, next_sample = 0, 0, [], args.warmup_dispatches
    with count_compiles() as compiles:
        while engine.stats.dispatches < args.dispatches:
            if live < args.live:
                engine.submit(stream.take(args.live - live))
                live = args.live
            engine.run(max_dispatches=min(next_sample, args.dispatches) - engine.stats.dispatches)
            done = len(engine.drain_finished())
            live, finished = live - done, finished + done
            if engine.stats.dispatches in (next_sample, args.dispatches):
                next_sample += args.every
                gc.collect()
                samples.append((engine.stats.dispatches, rss_bytes(), *live_arrays()))
                print(f"  dispatch {samples[-1][0]:6d}: RSS {samples[-1][1] / 2**20:7.2f} MiB, "
                      f"{samples[-1][2]} live arrays, {finished} requests finished", flush=True)
    return dict(engine=engine, samples=samples, finished=finished, compiles=compiles.compiles + compiles.traces)


def report(result: dict, tolerance: float, seconds: float) -> bool:
    samples, stats = result["samples"], result["engine"].stats
    rss = np.array([s[1] for s in samples], np.float64)
    drift = (rss - rss[0]) / rss[0]
    same_arrays = all(s[3] == samples[0][3] for s in samples)
    ok = bool(np.abs(drift).max() <= tolerance) and same_arrays and result["compiles"] == 0
    print(f"== soak: {stats.dispatches} dispatches ({stats.model_steps} model steps), {result['finished']} requests "
          f"finished and drained, {stats.output_tokens} output tokens, {seconds:.0f} s")
    print(f"  RSS: first sample {rss[0] / 2**20:.2f} MiB at dispatch {samples[0][0]}, min {rss.min() / 2**20:.2f}, "
          f"max {rss.max() / 2**20:.2f}, drift {100 * drift.min():+.2f}% .. {100 * drift.max():+.2f}% "
          f"(bound +-{100 * tolerance:.0f}%), last {100 * drift[-1]:+.2f}%")
    print(f"  live jax arrays: {sorted({s[2] for s in samples})} over {len(samples)} samples, "
          f"same (shape, dtype) set every sample: {same_arrays}")
    print(f"  compiles + traces after warm-up: {result['compiles']}")
    print(f"  {'PASS' if ok else 'FAIL'}: flat RSS within +-{100 * tolerance:.0f}%, constant live arrays, no compiles")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dispatches", type=int, default=50_000, help="dispatches to run (default 50000)")
    parser.add_argument("--warmup-dispatches", type=int, default=2_000,
                        help="dispatches before the first sample (default 2000)")
    parser.add_argument("--every", type=int, default=2_500, help="dispatches between samples (default 2500)")
    parser.add_argument("--live", type=int, default=8, help="unfinished requests kept in the engine (default 8)")
    parser.add_argument("--rss-tolerance", type=float, default=0.02, help="allowed RSS drift (default 0.02)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 0 < args.warmup_dispatches < args.dispatches or args.every < 1:
        parser.error(f"--warmup-dispatches {args.warmup_dispatches}: must lie in [1, --dispatches "
                     f"{args.dispatches}), and --every >= 1")
    print(f"== {machine_line()}; {load_line()}")
    start = time.perf_counter()
    result = soak(args)
    return 0 if report(result, args.rss_tolerance, time.perf_counter() - start) else 1


if __name__ == "__main__":
    sys.exit(main())
