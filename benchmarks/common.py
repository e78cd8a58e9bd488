"""Shared timing and reporting helpers for the benchmark scripts (warm-up, medians, machine info)."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

DEFAULT_RUNTIME_FLAG = "--default-runtime"


def uses_default_runtime() -> bool:
    return DEFAULT_RUNTIME_FLAG in sys.argv[1:]


CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def has_cuda_plugin() -> bool:
    """Whether jax's CUDA plugin is installed (JAX then starts on the GPU unless JAX_PLATFORMS says
    otherwise); found without starting JAX."""
    import importlib.util

    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return False
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # the parent package (jax_plugins) is not there
            continue
    return False


def configure_benchmark_runtime() -> str:
    """Call before JAX starts. `jaxprep.cli.configure_runtime()` (one XLA:CPU thread, synchronous
    dispatch, as the CLI) unless ``--default-runtime`` is on the command line, which keeps JAX's
    defaults (XLA:CPU's thread pool over every core, asynchronous dispatch), or jax's CUDA plugin is
    installed: ``PJRT_NPROC`` also sizes the GPU client's thread pool, so on a GPU machine JAX keeps
    its defaults, as a serving process would. Returns a line naming the settings, for the report."""
    if uses_default_runtime():
        return "runtime: JAX defaults (XLA:CPU thread pool, async dispatch; --default-runtime)"
    if has_cuda_plugin():
        return "runtime: JAX defaults (jax's CUDA plugin is installed: PJRT_NPROC left alone)"
    from jaxprep.cli import configure_runtime

    configure_runtime()
    return ("runtime: PJRT_NPROC=1, sequential schedule, synchronous dispatch (jaxprep.cli.configure_runtime)"
            if "concurrency_optimized_scheduler=false" in os.environ.get("XLA_FLAGS", "") else
            "runtime: PJRT_NPROC=1, synchronous dispatch (jaxprep.cli.configure_runtime)")


def add_runtime_argument(parser) -> None:
    parser.add_argument(DEFAULT_RUNTIME_FLAG, action="store_true",
                        help="keep JAX's default CPU runtime instead of jaxprep.cli.configure_runtime()")


STEP_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table",
               "logits_indices", "num_actual_tokens", "num_reqs", "max_query_len", "max_seq_len")


def assert_same_step(step, baseline: dict) -> None:
    """A jaxprep `StepInputs` (host or device arrays) equals a baseline's padded step, field by field."""
    meta = step.attn_metadata
    ours = {"input_ids": step.input_ids, "positions": step.positions, "logits_indices": step.logits_indices,
            **{name: getattr(meta, name) for name in STEP_FIELDS if hasattr(meta, name)}}
    for name in STEP_FIELDS:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(baseline[name]), err_msg=name)


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
    add_runtime_argument(parser)


def time_rows(setups, repeats: int, rounds: int) -> list[dict]:
    """Times every shape's callables together; ``setups`` holds (row, {key: fn}) per shape.

    Each row gains ``<key>_us`` for each of its callables and ``ratio`` = ours / base (jaxprep's
    time over the vLLM baseline's). A round sweeps every shape, so the rounds spread over the whole
    run (`interleaved_us`).
    """
    fns = {(row["name"], key): fn for row, shape_fns in setups for key, fn in shape_fns.items()}
    times = interleaved_us(fns, repeats, rounds)
    rows = []
    for row, shape_fns in setups:
        row = dict(row, **{f"{key}_us": times[row["name"], key] for key in shape_fns})
        row["ratio"] = row["ours_us"] / row["base_us"]
        rows.append(row)
    return rows


def print_goal_table(columns: list[tuple[str, str]], rows: list[dict], extra: tuple[str, str]) -> None:
    """A Markdown table: shape, one column per (title, row key) in µs, the ratio against its goal
    (``None``: no goal at this shape), then ``extra`` = (title, row key) in seconds."""
    titles = ["shape", *(title for title, _ in columns), "ratio", "goal", "met", extra[0]]
    print("| " + " | ".join(titles) + " |")
    print("|---|" + "---:|" * (len(columns) + 2) + ":-:|---:|")
    for r in rows:
        goal, met = "-", "-"
        if r["goal"] is not None:
            goal, met = f"≤{r['goal']}x", "yes" if r["ratio"] <= r["goal"] else "no"
        cells = [r["name"], *(f"{r[key]:.0f}" for _, key in columns), f"{r['ratio']:.2f}x", goal, met,
                 f"{r[extra[1]]:.2f}"]
        print("| " + " | ".join(cells) + " |")


def load_line() -> str:
    """The 1-minute load average (other processes share this machine's cores)."""
    return f"load average {os.getloadavg()[0]:.2f} (1 min)"


def machine_line() -> str:
    import jax

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
    try:
        import torch

        torch_version = f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        torch_version = ""
    return (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, jax {jax.__version__}, "
            f"numpy {np.__version__}{torch_version}, backend {jax.default_backend()}; commit {commit}")


UNCHECKED = ("jaxprep.prepare.flag_rows", "jaxprep.prepare.safe_block_table", "jaxprep.prepare.token_flags",
             "jaxprep.features.kv_groups.safe_block_table", "jaxprep.features.kv_groups.token_flags")
"""jaxprep's fast-path check functions, as the step's modules import them."""


def unchecked_step(state, config, num_tokens: int):
    """The same step with the fast-path checks traced out (no error word, no dropped rows, no nulled
    block ids): jaxprep's own check functions replaced by identities while one fresh jit traces, for
    the benchmarks only (the block table is gathered as before the checks: the null block for a
    padded row). The M-RoPE bit (one reduction inside its own output) stays. Returns the timed call."""
    from unittest import mock

    import jax
    import jax.numpy as jnp

    from jaxprep._constants import NULL_BLOCK_ID
    from jaxprep._ragged import take_rows
    from jaxprep.prepare import prepare_body

    identities = {
        "flag_rows": lambda state, config, num_tokens_padded: (state, jnp.int32(0)),
        "safe_block_table": lambda table, rows, *args: (take_rows(table, rows, fill_value=NULL_BLOCK_ID),
                                                        jnp.int32(0)),
        "token_flags": lambda *args: jnp.int32(0),
    }
    def body(state, config, num_tokens_padded):  # a new function: JAX's trace cache holds none of its traces
        return prepare_body(state, config, num_tokens_padded)

    with contextlib.ExitStack() as stack:
        for target in UNCHECKED:
            stack.enter_context(mock.patch(target, identities[target.rsplit(".", 1)[1]]))
        step = jax.jit(body, static_argnames=("config", "num_tokens_padded"))
        jax.block_until_ready(step(state, config, num_tokens))  # traced and compiled under the patch
    return lambda: jax.block_until_ready(step(state, config, num_tokens))


class PartClock:
    """Each part's own time, from clocks around the functions ``timed`` names ((module, class or module name,
    attribute, part); one a checkout lacks is skipped), while ``timing()`` is on: a part called inside another
    is taken out of the outer one. ``seconds`` adds up since it was last reset."""

    def __init__(self, parts: tuple[str, ...], timed: tuple):
        self.parts, self.timed = parts, timed
        self.seconds, self._stack = dict.fromkeys(parts, 0.0), []

    def reset(self) -> dict:
        """The seconds so far, and a fresh count."""
        seconds, self.seconds = self.seconds, dict.fromkeys(self.parts, 0.0)
        return seconds

    def wrap(self, function, part: str):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            self._stack.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                inner, spent = self._stack.pop(), time.perf_counter() - start
                self.seconds[part] += spent - inner
                if self._stack:
                    self._stack[-1] += spent
        return timed

    @contextlib.contextmanager
    def timing(self):
        patched = []
        for owner, name, part in self.timed:
            if isinstance(owner, str):
                owner = sys.modules.get(owner)
            if owner is not None and hasattr(owner, name):
                original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
                patched.append((owner, name, original))
                setattr(owner, name, self.wrap(original, part))
        try:
            yield
        finally:
            for owner, name, original in patched:
                setattr(owner, name, original)
