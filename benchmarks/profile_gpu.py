"""Where a prepared step's time goes on a GPU: kernels launched per step, the slowest kernels,
the calling thread's dispatch cost, prefix-sum variants, and whether a DLPack handoff waits.

    PYTHONPATH=. python benchmarks/profile_gpu.py [--steps 50]

Run it once as is and once with XLA's command buffers (CUDA graphs) for fusions, to see how much
of the dispatch cost is kernel launches:

    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \\
        PYTHONPATH=. python benchmarks/profile_gpu.py

On a machine without a GPU it runs on the CPU backend and says so (device planes are then empty).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax
import jax.numpy as jnp
import numpy as np
from bench_prepare import make_batch
from common import load_line, machine_line

from jaxprep import BatchState, prepare_padded
from jaxprep._ragged import _f32_prefix_sum as _float_scan

SHAPES = [("256 req decode", 256, 256, 8192, 16, True), ("256 req / 8192 tok mixed", 256, 8192, 8192, 16, False)]


def kernel_profile(fn, steps: int) -> tuple[int, float, list[tuple[str, float, int]]]:
    """(kernels per step, device µs per step, [(kernel name, µs per step, launches per step)] slowest first)."""
    for _ in range(3):
        jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(fn())
        paths = [os.path.join(d, f) for d, _, files in os.walk(trace_dir) for f in files if f.endswith(".xplane.pb")]
        profile = jax.profiler.ProfileData.from_file(paths[0])
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for plane in profile.planes:
        if not plane.name.startswith("/device:") or "CPU" in plane.name:
            continue
        for line in plane.lines:
            if not line.name.lower().startswith("stream"):
                continue
            for event in line.events:
                per_name[event.name].append(event.duration_ns)
    launches = sum(len(v) for v in per_name.values()) / steps
    total_us = sum(sum(v) for v in per_name.values()) / steps / 1e3
    table = sorted(((name, sum(v) / steps / 1e3, round(len(v) / steps)) for name, v in per_name.items()),
                   key=lambda row: -row[1])
    return round(launches), total_us, table


def dispatch_us(call, steps: int) -> float:
    """Calling-thread µs per call, calls queued back to back; best of 5 rounds."""
    jax.block_until_ready(call())
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        outputs = [call() for _ in range(steps)]
        best = min(best, (time.perf_counter() - start) / steps * 1e6)
        jax.block_until_ready(outputs)
    return best


def end_to_end_us(call, steps: int) -> float:
    jax.block_until_ready(call())
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(call())
        best = min(best, (time.perf_counter() - start) / steps * 1e6)
    return best


def scan_variants(steps: int) -> None:
    """Integer cumsum against the blocked float32 scan at HIGHEST precision (exact below 2**24)."""
    print("| prefix sum of 2 x n int32 | cumsum µs (e2e) | kernels | blocked f32 HIGHEST scan µs (e2e) | kernels |")
    print("|---:|---:|---:|---:|---:|")
    for n in (257, 1025, 8193, 16385):
        values = jnp.asarray(np.random.default_rng(n).integers(0, 4, (2, n)), jnp.int32)
        cumsum = jax.jit(lambda v: jnp.cumsum(v, axis=-1, dtype=jnp.int32))
        float_scan = jax.jit(_float_scan)
        np.testing.assert_array_equal(float_scan(values), np.cumsum(np.asarray(values), axis=1))
        row = [n]
        for fn in (cumsum, float_scan):
            call = functools.partial(fn, values)
            row += [f"{end_to_end_us(call, steps):.1f}", kernel_profile(call, 10)[0]]
        print("| " + " | ".join(map(str, row)) + " |")


def noop_call(count: int):
    """A call of a jitted ``x + 1`` over ``count`` int32[256] arrays: ``count`` in, ``count`` out."""
    arrays = [jnp.full((256,), i, jnp.int32) for i in range(count)]
    return functools.partial(jax.jit(lambda *xs: tuple(x + 1 for x in xs)), *arrays)


def call_floor(steps: int) -> None:
    """What a jitted call costs with no work to speak of, by its number of array inputs and outputs."""
    print("| jitted call | dispatch µs | end to end µs |")
    print("|---|---:|---:|")
    for count in (1, 4, 13, 32):
        call = noop_call(count)
        print(f"| {count} int32[256] in, {count} out | {dispatch_us(call, 100):.1f} "
              f"| {end_to_end_us(call, steps):.1f} |")
    call = functools.partial(jax.jit(lambda *xs: sum(xs)), *[jnp.full((256,), i, jnp.int32) for i in range(13)])
    print(f"| 13 in, 1 out | {dispatch_us(call, 100):.1f} | {end_to_end_us(call, steps):.1f} |")


def packed_prepare(steps: int) -> None:
    """`prepare_padded` (13 outputs) against `jaxprep.prepare.prepare_packed` (2 outputs), same step."""
    from jaxprep.prepare import prepare_packed

    for name, *shape in SHAPES:
        config, arrays = make_batch(*shape)
        state = jax.device_put(BatchState.from_numpy(**arrays))
        bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
        for label, fn in (("prepare_padded", prepare_padded), ("prepare_packed", prepare_packed)):
            call = functools.partial(fn, state, config, bucket)
            print(f"{name}, {label}: dispatch {dispatch_us(call, 100):.1f} µs, "
                  f"end to end {end_to_end_us(call, steps):.1f} µs")


def dlpack_waits() -> None:
    """Does torch.from_dlpack of a still-running JAX array return before the array is ready?"""
    try:
        import torch
    except ImportError:
        print("dlpack: torch missing")
        return
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        print("dlpack: needs CUDA torch and JAX on a GPU")
        return

    @jax.jit
    def slow(seed):
        x = jnp.full((2048, 2048), seed, jnp.float32) * 1e-3
        return jax.lax.fori_loop(0, 300, lambda _, x: jnp.tanh(x @ x), x)[0, :8]

    jax.block_until_ready(slow(1.0))
    for label, stream in (("default stream", None), ("side stream", torch.cuda.Stream())):
        result = slow(1.0)
        context = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
        with context:
            start = time.perf_counter()
            tensor = torch.from_dlpack(result)
            handoff_us = (time.perf_counter() - start) * 1e6
            ready_after = result.is_ready()
            value = float(tensor.float().sum().cpu())
        print(f"dlpack ({label}): handoff {handoff_us:.0f} µs, JAX array ready when it returned: {ready_after}; "
              f"torch read the finished values: {np.isclose(value, float(np.asarray(result).sum()))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"machine: {machine_line()}; {load_line()}")
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); XLA_FLAGS={flags!r}")
    for name, *shape in SHAPES:
        config, arrays = make_batch(*shape)
        state = jax.device_put(BatchState.from_numpy(**arrays))
        bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))

        call = functools.partial(prepare_padded, state, config, bucket)

        launches, device_us, table = kernel_profile(call, args.steps)
        print(f"\n{name}: {launches} kernels per step, {device_us:.1f} µs device, "
              f"dispatch {dispatch_us(call, 100):.1f} µs, end to end {end_to_end_us(call, args.steps):.1f} µs")
        for kernel, us, count in table[:12]:
            print(f"  {us:7.2f} µs  x{count}  {kernel[:110]}")
    print()
    call_floor(args.steps)
    packed_prepare(args.steps)
    scan_variants(args.steps)
    dlpack_waits()
    return 0


if __name__ == "__main__":
    sys.exit(main())
