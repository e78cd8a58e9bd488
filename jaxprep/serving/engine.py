"""The serving loop: scheduler on the host, one donated jitted `serve_step` per iteration."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import jax
import numpy as np

from jaxprep.compilation import compile_all
from jaxprep.serving import transitions
from jaxprep.serving.batch import ServingBatch
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.dispatch_log import DispatchRecord, dispatch_record
from jaxprep.serving.model import KVCache, ServingModel, init_params
from jaxprep.serving.packing import pack_updates
from jaxprep.serving.scheduler import Request, Scheduler, SchedulerOutput
from jaxprep.serving.state import StepUpdates
from jaxprep.serving.step import prepare_step, serve_step


@dataclasses.dataclass
class LoopStats:
    """What the loop measured, one entry per host iteration (dispatch) unless said otherwise."""

    dispatches: int = 0
    model_steps: int = 0  # forward passes, counting every iteration of a multi-step decode
    multi_step_dispatches: int = 0
    scheduled_tokens: int = 0  # real tokens through the model
    padded_tokens: int = 0  # bucketed tokens through the model
    output_tokens: int = 0
    preemptions: int = 0
    prep_us: list[float] = dataclasses.field(default_factory=list)
    dispatches_log: list[DispatchRecord] = dataclasses.field(default_factory=list)  # one per dispatch

    @property
    def padding_waste(self) -> float:
        """Share of the model's token slots that were padding: 1 - real / padded."""
        return 1.0 - self.scheduled_tokens / self.padded_tokens if self.padded_tokens else 0.0


class Engine:
    """A `Scheduler`, a `ServingBatch`, a model's weights and its paged KV cache.

    ``model`` is a model config with a ``forward`` (the tiny `ModelConfig`, or a checkpoint's
    `jaxprep.models.DecoderConfig`); ``params`` defaults to the tiny model's random weights from ``seed``.
    """

    def __init__(self, config: ServingConfig, model: ServingModel, *, seed: int = 0, time_prep: bool = False,
                 params=None):
        self.config, self.model, self.time_prep = config, model, time_prep
        self.batch = ServingBatch(config)
        self.scheduler = Scheduler(config)
        self.params = init_params(model, seed) if params is None else params
        self.kv_cache = KVCache.zeros(model, config.num_blocks, config.block_size)
        self.stats = LoopStats()
        self.iteration = 0  # host iterations, the clock of request arrivals
        self._arrivals: list[tuple[int, int, Request]] = []  # (arrival iteration, submit order, request)
        self._order = itertools.count()

    def warmup(self, threads: int | None = None, on_compiled=None) -> float:
        """Compiles every executable the loop can use; returns the seconds taken.

        Lowers each one (ahead of time, nothing runs, nothing is donated) and compiles it on one of
        ``threads`` threads (default: the CPU count) while the next is lowered; XLA compiles outside
        the GIL, and an ahead-of-time compile fills the same cache the jitted calls read.
        ``on_compiled(done, total)`` is called after each compile (a progress display).
        """
        start = time.perf_counter()
        compile_all(self._lowered(), threads, _counter(self.num_executables, on_compiled))
        return time.perf_counter() - start

    @property
    def num_executables(self) -> int:
        """What `warmup` compiles: the updates alone, and per bucket the step (and the timed prep)."""
        return 1 + len(self.config.prep.token_buckets) * (2 if self.time_prep else 1)

    def _lowered(self):
        packed = pack_updates(StepUpdates.build(self.config))
        state, config = self.batch.state, self.config
        yield transitions.apply_updates_jit.lower(state, StepUpdates.build(config))
        for bucket in config.prep.token_buckets:
            yield serve_step.lower(state, self.kv_cache, self.params, packed, config=config, model=self.model,
                                   num_tokens_padded=bucket)
            if self.time_prep:
                yield prepare_step.lower(state, packed, config=config, num_tokens_padded=bucket)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> list[Request]:
        """One host iteration: schedule, send the updates, run the step, take the tokens back."""
        out = self.scheduler.schedule()
        if out.total_num_scheduled_tokens == 0:
            raise RuntimeError("the scheduler found nothing to run (a request cannot fit the KV cache?)")
        updates = self._updates(out)
        bucket = self.config.prep.bucket_for(out.total_num_scheduled_tokens)
        packed = pack_updates(updates)
        if self.time_prep:
            start = time.perf_counter()
            jax.block_until_ready(prepare_step(self.batch.state, packed, config=self.config, num_tokens_padded=bucket))
            self.stats.prep_us.append((time.perf_counter() - start) * 1e6)
        self.kv_cache, tokens = self.batch.serve(self.kv_cache, self.params, updates, model=self.model,
                                                 num_tokens_padded=bucket, packed=packed)
        self._count(out, tokens, bucket)
        return self.scheduler.update(out, tokens, self.config.eos_token_id)

    def submit(self, requests, arrival_steps=None) -> None:
        """Queues ``requests``; request i joins the scheduler at host iteration ``arrival_steps[i]``
        (default: the current one)."""
        steps = [self.iteration] * len(requests) if arrival_steps is None else arrival_steps
        self._arrivals = sorted(self._arrivals + [(int(s), next(self._order), r) for s, r in zip(steps, requests)],
                                key=lambda item: item[:2])

    def run(self, max_dispatches: int | None = None, on_step=None) -> list[Request]:
        """Steps until every submitted request finished (or ``max_dispatches`` more dispatches);
        calls ``on_step(engine)`` after each. Returns the finished requests so far."""
        stop_at = None if max_dispatches is None else self.stats.dispatches + max_dispatches
        while self._arrivals or self.has_unfinished:
            if stop_at is not None and self.stats.dispatches >= stop_at:
                break
            if not self.has_unfinished:
                self.iteration = max(self.iteration, self._arrivals[0][0])  # idle: jump to the next arrival
            while self._arrivals and self._arrivals[0][0] <= self.iteration:
                self.add_request(self._arrivals.pop(0)[2])
            self.step()
            self.iteration += 1
            if on_step is not None:
                on_step(self)
        return self.finished

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def finished(self) -> list[Request]:
        """Finished requests, in finishing order."""
        return self.scheduler.finished

    def _updates(self, out: SchedulerOutput) -> StepUpdates:
        """The fused step's payload; adds and appends beyond its static sizes go first, separately."""
        extra, updates = split_updates(self.config, out)
        for chunk in extra:
            self.batch.apply_updates(chunk)
        return updates

    def _count(self, out: SchedulerOutput, tokens: np.ndarray, bucket: int) -> None:
        """Iteration 0 runs the scheduled tokens; each later iteration that ran decoded one token per row."""
        stats = self.stats
        stats.dispatches += 1
        stats.preemptions += out.num_preempted
        stats.output_tokens += int((tokens >= 0).sum())
        later = (tokens[1:] >= 0).sum(axis=1)
        iterations = 1 + int(np.count_nonzero(later))
        stats.multi_step_dispatches += int(out.decode_steps > 1)
        stats.model_steps += iterations
        stats.scheduled_tokens += out.total_num_scheduled_tokens + int(later.sum())
        stats.padded_tokens += bucket * iterations
        stats.dispatches_log.append(dispatch_record([out.num_scheduled_tokens], [tokens], bucket))


def split_updates(config: ServingConfig, out: SchedulerOutput) -> tuple[list[StepUpdates], StepUpdates]:
    """``out`` as payloads of the static sizes: the extra updates to apply first (adds and appends
    beyond ``max_new_reqs_per_step`` / ``max_block_appends_per_step``), then the fused step's."""
    adds, appends = out.new_requests, list(out.new_block_ids.items())
    size_add, size_append = config.max_new_reqs_per_step, config.max_block_appends_per_step
    finish, extra = out.finished_rows, []
    while len(adds) > size_add or sum(len(b) for _, b in appends) > size_append:
        chunk, appends = _take_blocks(appends, size_append)
        extra.append(StepUpdates.build(config, finish=finish, add=adds[:size_add], append=chunk))
        finish, adds = (), adds[size_add:]
    return extra, StepUpdates.build(config, finish=finish, add=adds, append=dict(appends),
                                    num_scheduled_tokens=out.num_scheduled_tokens, decode_steps=out.decode_steps)


def _take_blocks(appends: list[tuple[int, list[int]]], size: int):
    """Splits (row, blocks) items into a chunk {row: blocks} of at most ``size`` blocks and the rest,
    keeping each row's blocks in order.
    # [(0, [5, 6]), (2, [7])], size 1 -> {0: [5]}, [(0, [6]), (2, [7])]
    """
    chunk, rest, room = {}, [], size
    for row, blocks in appends:
        taken = blocks[:room]
        if taken:
            chunk[row], room = taken, room - len(taken)
        if len(taken) < len(blocks):
            rest.append((row, blocks[len(taken):]))
    return chunk, rest


def _counter(total: int, on_compiled):
    """``on_compiled(done, total)`` wrapped as the no-argument, thread-safe callback of `compile_all`."""
    if on_compiled is None:
        return None
    lock, done = threading.Lock(), [0]

    def count() -> None:
        with lock:
            done[0] += 1
            on_compiled(done[0], total)

    return count
