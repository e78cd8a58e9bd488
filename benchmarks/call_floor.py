"""What one jitted call costs the calling thread, with no work to speak of and with the prepared step, under
this process's runtime settings: the floor under the fused step's thread time.

    PYTHONPATH=. python benchmarks/call_floor.py [--repeats 200]
    PJRT_NPROC=1 PYTHONPATH=. python benchmarks/call_floor.py     # the setting the CPU benchmarks use

XLA reads ``PJRT_NPROC`` to size its clients' thread pools, the GPU client's included, so the runbook runs
this script twice, with it unset and with it set to 1. Rows: a jitted ``x + 1`` over 1 and 13 int32[256]
arrays (13: the prepared step's outputs); `prepare_padded` at 256 decoding requests on the XLA path and,
on a GPU, on the fused Pallas path. *thread µs*: calls queued back to back; *e2e µs*: one call and its wait.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import configure_benchmark_runtime, machine_line

RUNTIME = configure_benchmark_runtime()  # before JAX starts: a GPU machine keeps JAX's defaults

import jax  # noqa: E402
from bench_prepare import make_batch  # noqa: E402
from profile_gpu import dispatch_us, end_to_end_us, noop_call  # noqa: E402

from jaxprep import BatchState, prepare_padded  # noqa: E402


def calls(num_reqs: int) -> dict:
    """{row name: a call that starts one jitted computation and returns its outputs}."""
    rows = {f"x + 1 over {count} int32[256]": noop_call(count) for count in (1, 13)}
    config, arrays = make_batch(num_reqs, num_reqs, 4096, 16, True)
    state = jax.device_put(BatchState.from_numpy(**arrays))
    bucket = config.bucket_for(num_reqs)
    xla = dataclasses.replace(config, kernel="xla")  # the default ("auto") is the kernels on a GPU
    rows[f"prepare_padded, {num_reqs} decode, XLA"] = functools.partial(prepare_padded, state, xla, bucket)
    if jax.default_backend() == "gpu":
        fused = dataclasses.replace(config, kernel="pallas")
        rows[f"prepare_padded, {num_reqs} decode, Pallas"] = functools.partial(prepare_padded, state, fused, bucket)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="calls per timing round (best of 5 rounds)")
    parser.add_argument("--dry-run", action="store_true", help="16 requests, for a check of the script")
    parser.add_argument("--default-runtime", action="store_true", help="read by common.configure_benchmark_runtime")
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}")
    print(f"{RUNTIME}; PJRT_NPROC={os.environ.get('PJRT_NPROC', 'unset')}; backend {jax.default_backend()}")
    print("| call | thread µs | e2e µs |")
    print("|---|---:|---:|")
    for name, call in calls(16 if args.dry_run else 256).items():
        print(f"| {name} | {dispatch_us(call, args.repeats):.1f} | {end_to_end_us(call, args.repeats):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
