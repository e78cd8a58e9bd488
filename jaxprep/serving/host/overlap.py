"""Async scheduling: the host schedules step N+1 while the device runs step N.

As in vLLM's async scheduling (``vllm/v1/core/sched/async_scheduler.py::AsyncScheduler``,
``vllm/v1/engine/core.py::EngineCore.step_with_batch_queue``), the host learns a step's tokens one
step late. Sampled tokens never wait for the host: `serve_step` records them in the device's token
table, and the next step reads its ``input_ids`` from there. What the host needs to schedule the
next step is only *how many* tokens each row appends, and in a single step that is known: a row
appends one token exactly when its scheduled tokens reach the end of its known tokens
(`predicted_tokens`). The scheduler counts those as output placeholders (`Scheduler.after_schedule`)
and swaps in the real ids when the step's tokens arrive (`Scheduler.resolve`).

Stops: a request reaching max_tokens or max_model_len is not scheduled past it (the host counts its
placeholders); one that samples EOS in step N is already scheduled in step N+1, whose token is
discarded: a stop wastes at most one step. Multi-step decode is off (its iterations depend on
tokens the host has not seen).
"""

from __future__ import annotations

import time

import numpy as np

from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host import dp_policy
from jaxprep.serving.host.batch import check_dispatchable
from jaxprep.serving.host.engine import Engine
from jaxprep.serving.host.scheduler import Request, SchedulerOutput, StepTokens
from jaxprep.serving.step import NO_TOKEN

PLACEHOLDER_TOKEN = 0
"""What `predicted_tokens` writes for a token the host has not seen (any id but NO_TOKEN)."""


def predicted_tokens(config: ServingConfig, out: SchedulerOutput) -> np.ndarray:
    """[1, max_num_reqs]: PLACEHOLDER_TOKEN at the rows whose scheduled tokens reach the end of their
    tokens (they sample), NO_TOKEN elsewhere. Read before `Scheduler.after_schedule` advances them.

    ```
    # row 0 computed 4 of 6 tokens, scheduled 2 -> samples; row 1 computed 0 of 9, scheduled 4 -> not
    #   -> [[0, -1, ...]]
    ```
    """
    tokens = np.full((1, config.max_num_reqs), NO_TOKEN, np.int32)
    for row, request in out.requests.items():
        if request.num_computed_tokens + int(out.num_scheduled_tokens[row]) >= request.num_tokens_with_placeholders:
            tokens[0, row] = PLACEHOLDER_TOKEN
    return tokens


class AsyncEngine(Engine):
    """`Engine` (one device) that dispatches step N+1 before it reads step N's tokens.

    `LoopStats.host_s` adds up the host's time per iteration (schedule, pack, dispatch, and taking
    the previous step's tokens once they are ready, the wait excluded); ``overlapped_host_s`` the
    part of it spent while the previous step had not finished on the device: what the overlap hides.
    """

    def __init__(self, config: ServingConfig, model, **kwargs):
        check_dispatchable(config)  # at construction, before any request is taken
        super().__init__(config, model, **kwargs)
        self._in_flight = None  # (SchedulerOutput, device tokens, bucket, predicted) of the step not read yet

    @property
    def has_unfinished(self) -> bool:
        return super().has_unfinished or self._in_flight is not None

    def step(self) -> list[Request]:
        """Schedules and dispatches the next step (if anything can run before the tokens in flight
        arrive), then takes the tokens of the step dispatched before it."""
        start = time.perf_counter()
        launched = self._launch()
        if launched is None and self._in_flight is None:
            raise RuntimeError("the scheduler found nothing to run (a request cannot fit the KV cache?)")
        previous, self._in_flight = self._in_flight, launched
        host_s = time.perf_counter() - start
        if previous is None:
            self.stats.host_s += host_s
            return []
        overlapped = not previous[1].is_ready()
        tokens = np.asarray(previous[1])  # waits for the device
        start = time.perf_counter()
        done = self._resolve(previous, tokens)
        self.stats.host_s += host_s + time.perf_counter() - start
        self.stats.overlapped_host_s += host_s if overlapped else 0.0
        return done

    def _launch(self):
        out = self.scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            self.scheduler._rows_to_free[:0] = out.finished_rows  # nothing dispatched: free them next time
            return None
        out.decode_steps = 1
        bucket = dp_policy.coordinate(self.config.prep, self.schedulers, [out])
        (updates,) = self._rank_updates([out])
        predicted = predicted_tokens(self.config, out)
        self.scheduler.after_schedule(out, predicted)
        self.kv_cache, tokens = self.batch.dispatch(self.kv_cache, self.params, updates, predicted, model=self.model,
                                                    num_tokens_padded=bucket, packed=self._pack([updates], bucket))
        return out, tokens, bucket, predicted

    def _resolve(self, in_flight, tokens: np.ndarray) -> list[Request]:
        out, _, bucket, predicted = in_flight
        tokens = StepTokens(tokens)  # each array read once
        appended = tokens.appended  # [iterations, max_num_reqs]
        if appended[1:].any() or not np.array_equal(appended[0], predicted[0] != NO_TOKEN):
            raise RuntimeError("the device appended tokens to other rows than the host predicted")
        self._count([out], [tokens], bucket)
        done = self.scheduler.resolve(out, tokens, self.config.eos_token_id)
        self._live_ids.difference_update(r.request_id for r in done)
        return done
