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


def add_timing_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=100, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds over all shapes; each cell keeps its best")


def time_rows(setups, repeats: int, rounds: int) -> list[dict]:
    """Times every shape's callables together; ``setups`` holds (row, {key: fn}) per shape.

    Each row gains ``<key>_us`` for each of its callables and ``ratio`` = ours / ref. A round sweeps
    every shape, so the rounds spread over the whole run (`interleaved_us`).
    """
    fns = {(row["name"], key): fn for row, shape_fns in setups for key, fn in shape_fns.items()}
    times = interleaved_us(fns, repeats, rounds)
    rows = []
    for row, shape_fns in setups:
        row = dict(row, **{f"{key}_us": times[row["name"], key] for key in shape_fns})
        row["ratio"] = row["ours_us"] / row["ref_us"]
        rows.append(row)
    return rows


def print_goal_table(columns: list[tuple[str, str]], rows: list[dict], extra: tuple[str, str]) -> None:
    """A Markdown table: shape, one column per (title, row key) in µs, the ratio against its goal,
    then ``extra`` = (title, row key) in seconds."""
    titles = ["shape", *(title for title, _ in columns), "ratio", "goal", "met", extra[0]]
    print("| " + " | ".join(titles) + " |")
    print("|---|" + "---:|" * (len(columns) + 2) + ":-:|---:|")
    for r in rows:
        cells = [r["name"], *(f"{r[key]:.0f}" for _, key in columns), f"{r['ratio']:.2f}x", f"≤{r['goal']}x",
                 "yes" if r["ratio"] <= r["goal"] else "no", f"{r[extra[1]]:.2f}"]
        print("| " + " | ".join(cells) + " |")


def load_line() -> str:
    """The 1-minute load average (other processes share this machine's cores)."""
    return f"load average {os.getloadavg()[0]:.2f} (1 min)"


def machine_line() -> str:
    import jax
    import numpy as np

    commit = os.environ.get("JAXPREP_COMMIT")  # set where the checkout's .git is not the one measured
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
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
