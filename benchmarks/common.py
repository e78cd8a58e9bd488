"""Shared timing and reporting helpers for the benchmark scripts (warm-up, medians, machine info)."""

from __future__ import annotations

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
    import os

    return (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, jax {jax.__version__}, "
            f"numpy {np.__version__}, backend {jax.default_backend()}; commit {commit}")
