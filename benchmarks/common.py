"""Shared timing and reporting helpers for the benchmark scripts (warm-up, medians, machine info)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time


def median_us(fn, repeats: int, warmup: int = 5) -> float:
    """Median wall time of ``fn()`` in microseconds; ``fn`` must block until its results are ready."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def interleaved_us(fns: dict, repeats: int, rounds: int = 5) -> dict:
    """For each ``fn`` (name -> callable), the best of ``rounds`` medians of ``repeats`` calls (µs).

    The callables take turns round by round, so a burst of load from another process hits them
    alike, and the best round is the one least disturbed.
    """
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], median_us(fn, repeats))
    return best


def load_line() -> str:
    """The 1-minute load average (other processes share this machine's cores)."""
    return f"load average {os.getloadavg()[0]:.2f} (1 min)"


def machine_line() -> str:
    import jax
    import numpy as np

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, jax {jax.__version__}, "
            f"numpy {np.__version__}, backend {jax.default_backend()}; commit {commit}")
