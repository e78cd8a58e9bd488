"""Warm-up of the bucket ladder and a compile counter built on JAX's public monitoring hooks.

Every warm-up (`warmup`, `jaxprep.serving.Engine.warmup`, `jaxprep.serving.ServingBatch.warmup`) says what
it compiles: on the ``jaxprep.warmup`` logger (INFO; quiet unless the application turns logging on, as
``logging.basicConfig(level=logging.INFO)`` does) a line when it starts, naming how many executables and
why, one per executable compiled with how many remain, and one at the end with the seconds and how many
came from the persistent compilation cache; ``on_compiled(done, total, what)`` gets the same per
executable (the CLI's progress bars). ``cache_dir`` turns that cache on first (`use_compile_cache`), so a
second process loads what the first compiled.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time

import jax

from jaxprep.config import PrepConfig

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""`jax.monitoring` duration event JAX records for each backend compile (none for one it hands back from memory)."""
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""`jax.monitoring` event JAX records each time its persistent cache serves a compile."""
log = logging.getLogger("jaxprep.warmup")
"""What each warm-up compiles and how many remain (INFO); the library adds no handler."""


@dataclasses.dataclass
class CompileCount:
    """Traces and XLA compilations seen while a `count_compiles` block ran; ``cache_hits``: how many
    of the compilations the persistent compilation cache served."""

    traces: int = 0
    compiles: int = 0
    cache_hits: int = 0


@contextlib.contextmanager
def count_compiles():
    """Counts jaxpr traces and backend compilations (any function, any thread) inside the block.

    Uses `jax.monitoring` listeners only; a compile served from the persistent cache still counts, and so
    does an executable a warm-up loads from jaxprep's store beside it (`jaxprep.executables`), a cache hit
    with no trace.
    """
    from jaxprep.executables import STORE_HIT_EVENT

    count = CompileCount()

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == _TRACE_EVENT:
            count.traces += 1
        elif event == COMPILE_EVENT:
            count.compiles += 1

    def hit_listener(event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            count.cache_hits += 1
        elif event == STORE_HIT_EVENT:
            count.compiles += 1
            count.cache_hits += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(hit_listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(hit_listener)


def warmup(config: PrepConfig, state=None, buckets: tuple[int, ...] | None = None, *,
           cache_dir: str | os.PathLike | None = None, threads: int | None = None, on_compiled=None) -> float:
    """Compiles `prepare_inputs` for every bucket a step can reach (``buckets``, default
    `PrepConfig.reachable_buckets`); returns the seconds it took.

    Each bucket is lowered from shapes alone (nothing is allocated or run) and compiled on
    ``threads`` threads (default: the CPU count) while the next one is lowered, the largest first; XLA
    compiles outside the GIL, and an ahead-of-time compile fills the cache the jitted calls read. What it
    compiles is logged (the module docstring).

    Args:
      config: the `PrepConfig` whose ladder (``token_buckets``) is compiled, up to the rungs a step reaches.
      state: supplies the shapes (a `BatchState` or a pytree of ``jax.ShapeDtypeStruct``; default: those
        of `BatchState.empty(config)`); it is only read.
      buckets: the buckets to compile (default: ``config.reachable_buckets``).
      cache_dir: turn on JAX's persistent compilation cache there first (`use_compile_cache`), so a later
        process warms up from disk.
      threads: compile threads (default: the CPU count).
      on_compiled: ``on_compiled(done, total, what)`` after each executable compiles.
    """
    from jaxprep.bounds import CONFIG_HINT, expect

    expect("warmup", "config", config, PrepConfig, "a jaxprep.PrepConfig", CONFIG_HINT)
    buckets = tuple(sorted(buckets or config.reachable_buckets))
    return compile_all(prepare_lowerings(config, state, buckets), threads, on_compiled, total=len(buckets),
                       why=f"prepare_padded at {describe_buckets(buckets)}", cache_dir=cache_dir)


def prepare_lowerings(config: PrepConfig, state=None, buckets: tuple[int, ...] | None = None):
    """``(what, lowered)`` of `prepare_padded` at each bucket (default: the reachable ones, the largest first),
    lowered from shapes."""
    from jaxprep.prepare import prepare_padded

    shapes = _empty_state_shapes(config) if state is None else state
    for bucket in sorted(buckets or config.reachable_buckets, reverse=True):
        yield f"prepare_padded at {bucket} tokens", prepare_padded.trace(shapes, config, bucket).lower()


def counted(n: int, noun: str) -> str:
    """``3 update sizes``, ``1 update size``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def describe_buckets(buckets) -> str:
    """``the 18 token buckets 8, 16, ..., 8192`` (``the token bucket 64`` for one)."""
    buckets = list(buckets)
    if len(buckets) == 1:
        return f"the token bucket {buckets[0]}"
    shown = ", ".join(map(str, buckets)) if len(buckets) <= 4 else f"{buckets[0]}, {buckets[1]}, ..., {buckets[-1]}"
    return f"the {len(buckets)} token buckets {shown}"


@functools.lru_cache(maxsize=16)
def _empty_state_shapes(config: PrepConfig):
    """`BatchState.empty(config)` as ``jax.ShapeDtypeStruct`` leaves (traced once per config)."""
    from jaxprep.state import BatchState

    return jax.eval_shape(lambda: BatchState.empty(config))


def compile_all(lowered, threads: int | None = None, on_compiled=None, *, total: int, why: str,
                cache_dir: str | os.PathLike | None = None) -> float:
    """Compiles ``(what, jax.stages.Lowered)`` pairs on ``threads`` threads (default: the CPU count); returns
    the seconds it took.

    ``lowered`` may be a generator: each module starts compiling as soon as it is lowered, so the
    tracing and lowering of the next one (Python, under the GIL) overlaps the compiles. The ``total``
    modules are logged (``why`` they are compiled, then each one with how many remain) and
    ``on_compiled(done, total, what)`` is called (from a worker thread, one call at a time) each time one
    has compiled. ``cache_dir``: `use_compile_cache` there first.
    """
    start = time.perf_counter()
    if cache_dir is not None:
        use_compile_cache(cache_dir)
    progress = WarmupProgress(total, why, on_compiled)
    with count_compiles() as count, concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        futures = [pool.submit(_compile, what, stage, progress.compiled) for what, stage in lowered]
        for future in futures:
            future.result()
    seconds = time.perf_counter() - start
    progress.finish(seconds, count.cache_hits)
    return seconds


class WarmupProgress:
    """What one warm-up says as it goes (the module docstring): a line naming its ``total`` executables and
    ``why`` when made, one per executable `compiled` (thread-safe) with ``on_compiled(done, total, what)``,
    and one at the `finish`."""

    def __init__(self, total: int, why: str, on_compiled=None):
        self.total, self.done, self.on_compiled, self._lock = total, 0, on_compiled, threading.Lock()
        cache = jax.config.jax_compilation_cache_dir
        log.info("warm-up: compiling %d executables, %s, before the first step so that no step compiles%s", total,
                 why, "" if cache is None else f"; the persistent compilation cache in {cache} keeps them")

    def compiled(self, what: str) -> None:
        with self._lock:
            self.done += 1
            log.info("warm-up: %d/%d compiled, %d to go: %s", self.done, self.total, max(self.total - self.done, 0),
                     what)
            if self.on_compiled is not None:
                self.on_compiled(self.done, self.total, what)

    def finish(self, seconds: float, cache_hits: int) -> None:
        log.info("warm-up: %d executables in %.1f s, %d of them from the persistent compilation cache", self.done,
                 seconds, cache_hits)


def _compile(what: str, stage, compiled) -> None:
    stage.compile()
    compiled(what)


def use_compile_cache(cache_dir: str | os.PathLike) -> None:
    """Turns on JAX's persistent compilation cache in ``cache_dir`` (``~`` expanded) for this process.

    Process-wide (it sets JAX's ``jax_compilation_cache_dir``), so jaxprep never calls it on its
    own: only a warm-up's ``cache_dir=...`` and the CLI's ``--compile-cache`` do. Every executable is
    cached, however fast it compiled (``jax_persistent_cache_min_compile_time_secs = 0``: many prepare
    buckets compile in less than JAX's default 1 s threshold; docs/benchmarks-history.md, "Warm-up of
    the bucket ladder"). The cache is trusted code: keep it in a directory only you can write.
    """
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(os.fspath(cache_dir)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # a process that compiled before looks at the cache again
