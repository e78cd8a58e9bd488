"""Warm-up of the bucket ladder and a compile counter built on JAX's public monitoring hooks."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax

from jaxprep.config import PrepConfig

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCount:
    """Traces and XLA compilations seen while a `count_compiles` block ran."""

    traces: int = 0
    compiles: int = 0


@contextlib.contextmanager
def count_compiles():
    """Counts jaxpr traces and backend compilations (any function, any thread) inside the block.

    Uses `jax.monitoring` listeners only; a compile served from the persistent cache still counts.
    """
    count = CompileCount()

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == _TRACE_EVENT:
            count.traces += 1
        elif event == _COMPILE_EVENT:
            count.compiles += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def warmup(config: PrepConfig, state=None, buckets: tuple[int, ...] | None = None) -> float:
    """Compiles `prepare_inputs` for every bucket of the ladder; returns the seconds it took.

    ``state`` supplies the shapes (default: `BatchState.empty(config)`); it is only read.
    """
    from jaxprep.prepare import prepare_padded
    from jaxprep.state import BatchState

    state = BatchState.empty(config) if state is None else state
    start = time.perf_counter()
    for bucket in buckets or config.token_buckets:
        jax.block_until_ready(prepare_padded(state, config, bucket))
    return time.perf_counter() - start
