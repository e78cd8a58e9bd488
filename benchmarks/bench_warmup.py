"""Warm-up of the whole bucket ladder: cold, and again with JAX's persistent compilation cache warm.

    PYTHONPATH=. python benchmarks/bench_warmup.py [--budget 8192] [--runs 3]

Each measurement is a fresh Python process (nothing compiled, nothing cached in memory) that calls
`jaxprep.warmup(config)` for the default ladder of a 256-request, 8192-token-budget config:

- cold: no persistent cache;
- cold, filling a cache: ``cache_dir`` set to a new, empty directory;
- warm cache: a new process with the directory the previous one filled.

The time is `warmup`'s own (lowering from shapes and compiling every bucket), best and median of
``--runs`` processes; the import of JAX and the backend start are not included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from common import load_line, machine_line

CHILD = """
import json, sys
from jaxprep.cli import configure_runtime
configure_runtime()
import jax
import jaxprep
config = jaxprep.PrepConfig(max_num_reqs=256, max_model_len=8192, max_num_batched_tokens={budget}, block_size=16)
jax.devices()  # start the backend before the clock
with jaxprep.count_compiles() as count:
    seconds = jaxprep.warmup(config, cache_dir={cache_dir!r})
print(json.dumps(dict(seconds=seconds, buckets=len(config.token_buckets), compiles=count.compiles)))
"""


def run_child(budget: int, cache_dir: str | None) -> dict:
    code = CHILD.format(budget=budget, cache_dir=cache_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens (default 8192)")
    parser.add_argument("--runs", type=int, default=3, help="processes per measurement")
    args = parser.parse_args()
    results = {"cold (no cache)": [], "cold, filling the cache": [], "warm cache": []}
    for _ in range(args.runs):
        results["cold (no cache)"].append(run_child(args.budget, None))
        with tempfile.TemporaryDirectory() as cache_dir:
            results["cold, filling the cache"].append(run_child(args.budget, cache_dir))
            results["warm cache"].append(run_child(args.budget, cache_dir))
    print(f"machine: {machine_line()}; {load_line()}")
    buckets = results["warm cache"][0]["buckets"]
    print(f"| warm-up of {buckets} buckets (budget {args.budget}) | best s | median s | compiles |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        print(f"| {name} | {min(seconds):.2f} | {statistics.median(seconds):.2f} | {runs[0]['compiles']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
