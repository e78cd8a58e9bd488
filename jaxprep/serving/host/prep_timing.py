"""The prepare part of each serving step, timed after the loop on a donated twin of the state.

The fused `serve_step` updates the donated state in place, prepares the step and runs the model
in one call, so the loop itself cannot time its preparation. An `Engine` built with ``time_prep``
keeps each dispatch's packed updates and bucket (`Engine.prep_replay`); `time_prepare` then copies
the batch state once (before any clock starts) and replays every dispatch, in order, through
`update_and_prepare_donated`: unpack the updates, apply them to the donated state in place,
`prepare_padded`, until both are ready. No table is copied inside the timed call, as in the loop.
The sequence is replayed several times and each dispatch keeps its best time, so that one pass
disturbed by another process does not decide the figure.

The twin's state follows the updates only (it records no sampled tokens), so its values drift
from the loop's; the padded shapes and the work are the loop's, which is what the time depends on.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep.executables import warm

MIN_CALLS = 200
"""`time_prepare` replays the dispatches at least 3 times, and until it has made this many calls."""


def time_prepare(engine) -> np.ndarray:
    """Times the prepare part of every dispatch ``engine`` recorded; returns µs per dispatch, the
    best of several replays of the whole sequence (also stored in ``engine.stats.prep_us``). Each
    bucket's twin executable compiles first, untimed, all buckets at once (`jaxprep.executables.warm`)."""
    replay = engine.prep_replay
    if not replay:
        return np.zeros(0)
    shapes = {(packed.step.shape[-1], bucket): packed for packed, bucket in replay}  # one per executable
    twins = [engine._twin_executable(packed, bucket) for (_, bucket), packed in sorted(shapes.items(), reverse=True)]
    engine.batch.executables.update(warm(twins, why="the prepare part of each step shape alone, to time it"))
    state = jax.block_until_ready(jax.tree.map(jnp.copy, engine.batch.state))
    for (_, bucket), packed in shapes.items():  # touch every executable first
        state = jax.block_until_ready(engine._prepare_twin(state, packed, bucket))[0]
    passes = max(3, -(-MIN_CALLS // len(replay)))
    times = np.empty((passes, len(replay)))
    for i in range(passes):
        for j, (packed, bucket) in enumerate(replay):
            start = time.perf_counter()
            state, step = jax.block_until_ready(engine._prepare_twin(state, packed, bucket))
            times[i, j] = (time.perf_counter() - start) * 1e6
    best = times.min(axis=0)
    engine.stats.prep_us = best.tolist()
    return best
