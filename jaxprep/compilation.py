"""Warm-up of the bucket ladder and a compile counter built on JAX's public monitoring hooks."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time

import jax

from jaxprep.config import PrepConfig

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


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
        elif event == _COMPILE_EVENT:
            count.compiles += 1

    def hit_listener(event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
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
           cache_dir: str | os.PathLike | None = None, threads: int | None = None) -> float:
    """Compiles `prepare_inputs` for every bucket a step can reach (``buckets``, default
    `PrepConfig.reachable_buckets`); returns the seconds it took.

    Each bucket is lowered from shapes alone (nothing is allocated or run) and compiled on
    ``threads`` threads (default: the CPU count) while the next one is lowered, the largest first; XLA
    compiles outside the GIL, and an ahead-of-time compile fills the cache the jitted calls read.

    ``state`` supplies the shapes (a `BatchState` or a pytree of ``jax.ShapeDtypeStruct``;
    default: those of `BatchState.empty(config)`); it is only read.
    ``cache_dir``: turn on JAX's persistent compilation cache there first (`use_compile_cache`),
    so a later process warms up from disk.
    """
    from jaxprep.bounds import CONFIG_HINT, expect
    from jaxprep.prepare import prepare_padded

    expect("warmup", "config", config, PrepConfig, "a jaxprep.PrepConfig", CONFIG_HINT)
    start = time.perf_counter()
    if cache_dir is not None:
        use_compile_cache(cache_dir)
    shapes = _empty_state_shapes(config) if state is None else state
    buckets = sorted(buckets or config.reachable_buckets, reverse=True)
    compile_all((prepare_padded.trace(shapes, config, bucket).lower() for bucket in buckets), threads)
    return time.perf_counter() - start


@functools.lru_cache(maxsize=16)
def _empty_state_shapes(config: PrepConfig):
    """`BatchState.empty(config)` as ``jax.ShapeDtypeStruct`` leaves (traced once per config)."""
    from jaxprep.state import BatchState

    return jax.eval_shape(lambda: BatchState.empty(config))


def compile_all(lowered, threads: int | None = None, on_compiled=None) -> None:
    """Compiles ``jax.stages.Lowered`` modules on ``threads`` threads (default: the CPU count).

    ``lowered`` may be a generator: each module starts compiling as soon as it is lowered, so the
    tracing and lowering of the next one (Python, under the GIL) overlaps the compiles.
    ``on_compiled()`` is called (from a worker thread) each time one module has compiled.
    """
    with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        futures = [pool.submit(_compile, stage, on_compiled) for stage in lowered]
        for future in futures:
            future.result()


def _compile(stage, on_compiled) -> None:
    stage.compile()
    if on_compiled is not None:
        on_compiled()


def use_compile_cache(cache_dir: str | os.PathLike) -> None:
    """Turns on JAX's persistent compilation cache in ``cache_dir`` for this process.

    Process-wide (it sets JAX's ``jax_compilation_cache_dir``), so jaxprep never calls it on its
    own: only `warmup(..., cache_dir=...)` and the CLI's ``--compile-cache`` do. Every executable
    is cached, however fast it compiled (``jax_persistent_cache_min_compile_time_secs = 0``: many
    prepare buckets compile in less than JAX's default 1 s threshold; BENCHMARKS.md, "Warm-up").
    The cache is trusted code:
    keep it in a directory only you can write.
    """
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", os.fspath(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # a process that compiled before looks at the cache again
