"""``PrepConfig.kernel="auto"`` (the default) against ``"xla"`` on this machine, in one process.

    PYTHONPATH=. python benchmarks/bench_kernel_auto.py [--repeats 200] [--dry-run]

For each step that `bench_prepare.py` runs (256 decode, 256 requests / 8192 tokens, 1024 requests /
16384 tokens; `bench_prepare.make_batch`), plain and with spec decode under ``runner="v2"`` (K = 3):

- whether the two settings compile to the same executable (StableHLO text equal): on a machine
  without a CUDA device ``"auto"`` must be exactly the XLA step;
- the trace time of each setting (best of 3), and of ``"pallas"`` (what tracing the kernels costs, which
  ``"auto"`` paid on every backend before it was decided at trace time);
- `prepare_padded`'s time per call (median of ``--repeats`` calls, best of 5 rounds, the two
  settings interleaved round by round).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import add_runtime_argument, configure_benchmark_runtime, interleaved_us, load_line, machine_line

RUNTIME = configure_benchmark_runtime()

import jax  # noqa: E402
from bench_prepare import make_batch  # noqa: E402

from jaxprep import BatchState, FeatureConfig, PrepConfig, prepare_padded  # noqa: E402

SHAPES = [("256 decode", 256, 256, True), ("256 req / 8192 tok", 256, 8192, False),
          ("1024 req / 16384 tok", 1024, 16384, False)]
DRY_RUN_SHAPES = [("16 decode", 16, 16, True)]
FEATURES = {"plain": FeatureConfig(), "spec decode, runner v2": FeatureConfig(num_speculative_tokens=3, runner="v2")}


def trace_ms(state, config, bucket: int, **changes) -> float:
    """Milliseconds to trace `prepare_padded` once under ``config`` with ``changes`` (a fresh config: no
    cached trace); NaN where the config is refused (a jaxprep whose kernels do not cover its features)."""
    try:
        config = dataclasses.replace(config, **changes)
    except ValueError:
        return float("nan")
    start = time.perf_counter()
    prepare_padded.trace(state, config, bucket)
    return (time.perf_counter() - start) * 1e3


def row(name: str, shape: tuple, features: FeatureConfig, repeats: int) -> dict:
    num_reqs, num_tokens, decode_only = shape
    if features.spec_decode:  # decodes with 0-3 drafts (and, mixed, prefill chunks)
        from mrv2_triton_baseline import make_draft_batch

        arrays, budget = make_draft_batch(num_reqs, num_tokens, features.num_speculative_tokens, decode_only, 4096, 16)
        config = PrepConfig(max_num_reqs=num_reqs, max_model_len=4096, max_num_batched_tokens=budget, block_size=16)
    else:
        config, arrays = make_batch(num_reqs, num_tokens, 4096, 16, decode_only)
    state = BatchState.from_numpy(**arrays)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    configs = {kernel: dataclasses.replace(config, features=features, kernel=kernel) for kernel in ("xla", "auto")}
    texts = {k: prepare_padded.trace(state, c, bucket).lower().as_text() for k, c in configs.items()}
    # the best of 3 traces of configs no trace is cached for (an unused KV-cache bound changes the key,
    # not the shapes)
    traces = {kernel: min(trace_ms(state, configs["xla"], bucket, kernel=kernel, num_blocks=2**20 + 3 * i + attempt)
                          for attempt in range(3))
              for i, kernel in enumerate(("xla", "auto", "pallas"))}
    calls = {k: (lambda c=c: jax.block_until_ready(prepare_padded(state, c, bucket))) for k, c in configs.items()}
    times = interleaved_us(calls, repeats)
    return dict(name=f"{name}, {'plain' if not features.any_on else 'spec decode, runner v2'}",
                same=texts["xla"] == texts["auto"], traces=traces, times=times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="calls per round (best of 5 rounds)")
    parser.add_argument("--dry-run", action="store_true", help="16 requests, for a check of the script")
    add_runtime_argument(parser)
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}; {load_line()}\n{RUNTIME}; backend {jax.default_backend()}")
    print("| step | same executable | trace ms xla / auto / pallas | xla µs | auto µs | auto / xla |\n"
          "|---|---|---:|---:|---:|---:|")
    for name, *shape in (DRY_RUN_SHAPES if args.dry_run else SHAPES):
        for features in FEATURES.values():
            r = row(name, tuple(shape), features, args.repeats)
            traces, times = r["traces"], r["times"]
            print(f"| {r['name']} | {'yes' if r['same'] else 'NO'} | {traces['xla']:.0f} / {traces['auto']:.0f} / "
                  f"{traces['pallas']:.0f} | {times['xla']:.1f} | {times['auto']:.1f} "
                  f"| {times['auto'] / times['xla']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
