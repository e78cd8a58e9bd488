"""The serving loop: scheduler on the host, one donated jitted `serve_step` per iteration."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time

import numpy as np

from jaxprep.compilation import counted, describe_buckets
from jaxprep.executables import Executable, warm
from jaxprep.models.tiny import KVCache, ServingModel, init_params
from jaxprep.serving._values import integer
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host import column_checks, dp_policy
from jaxprep.serving.host.batch import ColumnsUpdate, ServingBatch, door_programs
from jaxprep.serving.host.dispatch_log import DispatchRecord, dispatch_record
from jaxprep.serving.host.scheduler import Request, Scheduler, SchedulerOutput, StepTokens, step_tokens
from jaxprep.serving.host.scheduler_columns import scheduler_columns
from jaxprep.serving.state import StepUpdates
from jaxprep.serving.step import run_step, serve_step, update_and_prepare_donated
from jaxprep.serving.update_packing import PackedStep, bulk_rungs, payload_buckets, step_payload_buckets


@dataclasses.dataclass
class LoopStats:
    """What the loop measured, one entry per host iteration (dispatch) unless said otherwise."""

    dispatches: int = 0
    model_steps: int = 0  # forward passes, counting every iteration of a multi-step decode
    multi_step_dispatches: int = 0
    scheduled_tokens: int = 0  # real tokens through the model
    prefill_tokens: int = 0  # of those, tokens of requests running more than one token in a pass
    decode_tokens: int = 0  # of those, one-token runs (vLLM's split_decodes_and_prefills rule, threshold 1)
    padded_tokens: int = 0  # bucketed tokens through the model
    output_tokens: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts scheduled (and verified)
    accepted_draft_tokens: int = 0  # drafts kept (those cut at a stop count as not kept)
    draft_steps: int = 0  # request-steps with at least one draft
    h2d_bytes: int = 0  # bytes of the update buffers sent to the device (`jaxprep.serving.update_packing`)
    changed_words: int = 0  # state entries those updates wrote (new tokens, block ids, counters)
    host_s: float = 0.0  # async scheduling: host time per iteration, waits for the device excluded
    overlapped_host_s: float = 0.0  # async scheduling: the part spent while the previous step still ran
    # per-dispatch history, kept only by an engine built with ``keep_history`` (it grows every dispatch)
    step_us: list[float] = dataclasses.field(default_factory=list)  # the whole host iteration: schedule, pack,
    # dispatch, token read, scheduler update
    dispatch_us: list[float] = dataclasses.field(default_factory=list)  # of it: the step's call until its tokens
    # are host arrays (with synchronous dispatch, as on CPU, that includes the device running the step)
    prep_us: list[float] = dataclasses.field(default_factory=list)  # ``time_prep``: `prep_timing.time_prepare`
    h2d_bytes_log: list[int] = dataclasses.field(default_factory=list)  # update bytes of each dispatch
    dispatches_log: list[DispatchRecord] = dataclasses.field(default_factory=list)

    @property
    def overlap(self) -> float:
        """Async scheduling: share of the host's time spent while the device ran the previous step."""
        return self.overlapped_host_s / self.host_s if self.host_s else 0.0

    @property
    def padding_waste(self) -> float:
        """Share of the model's token slots that were padding: 1 - real / padded."""
        return 1.0 - self.scheduled_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / scheduled drafts (vLLM's spec-decode ``acceptance rate``)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a request gains per verifying step: 1 + accepted drafts per request-step with drafts
        (vLLM's ``mean acceptance length``)."""
        return 1.0 + self.accepted_draft_tokens / self.draft_steps if self.draft_steps else 1.0


class Engine:
    """A `Scheduler`, a `ServingBatch`, a model's weights and its paged KV cache, on one device.

    ``model`` is a model config with a ``forward`` (the tiny `ModelConfig`, or a checkpoint's
    `jaxprep.models.DecoderConfig`); ``params`` defaults to the tiny model's random weights from ``seed``.
    ``config.vocab_size`` defaults to the model's: every token id submitted is checked against it.

    Memory stays flat however long the engine runs: finished requests wait in `finished` until
    `drain_finished` hands them out, and per-dispatch records (`LoopStats.dispatches_log`,
    ``step_us``, ``dispatch_us``) are kept only with ``keep_history`` (what ``jaxprep simulate`` reports
    and plots). With ``time_prep`` every dispatch's packed updates are kept too, for
    `jaxprep.serving.host.prep_timing.time_prepare` to replay after the loop.

    ``separate_updates`` (one device): each step's updates go in dispatches of their own before the step
    (`ServingBatch`'s option of that name): a warm-up compiles every bucket's step without the update program
    (about half the compile, ``benchmarks/bench_compile.py --parts update``) and one update executable for all
    of them; each step then costs two more dispatches. The tokens are the same either way.

    The loop itself (arrivals, scheduling, the fused dispatch, counting) is written for any number
    of DP ranks, each with its own scheduler; `DataParallelEngine` overrides only the device hooks
    (``_pack``, ``_apply_updates``, ``_serve``, ``_twin_executable``, ``_step_executable``) to run all ranks in
    one sharded dispatch.
    """

    def __init__(self, config: ServingConfig, model: ServingModel, *, seed: int = 0, time_prep: bool = False,
                 params=None, keep_history: bool = False, separate_updates: bool = False):
        config = with_vocab_size(config, model)
        self._start(config, model, time_prep, batch=ServingBatch(config, separate_updates=separate_updates),
                    num_ranks=1,
                    params=init_params(model, seed) if params is None else params,
                    kv_cache=KVCache.zeros(model, config.num_blocks, config.block_size), keep_history=keep_history)

    def _start(self, config: ServingConfig, model: ServingModel, time_prep: bool, *, batch, num_ranks: int, params,
               kv_cache: KVCache, keep_history: bool) -> None:
        self.config, self.model, self.time_prep, self.batch = config, model, time_prep, batch
        self.keep_history = keep_history
        self.prep_replay: list[tuple[np.ndarray, int]] = []  # ``time_prep``: (packed updates, bucket) per dispatch
        self.schedulers = [Scheduler(config) for _ in range(num_ranks)]
        # the scheduler's output read straight into the buffer's columns where the configuration allows
        self._columns = column_checks.covers(config)
        self.params, self.kv_cache = params, kv_cache
        self.stats = LoopStats()
        self.iteration = 0  # host iterations, the clock of request arrivals
        self._arrivals: list[tuple[int, int, Request]] = []  # (arrival iteration, submit order, request)
        self._order = itertools.count()
        self._live_ids: set = set()  # ids submitted and not finished yet: a duplicate is rejected

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of rank 0 (the only one on a single device)."""
        return self.schedulers[0]

    @property
    def num_ranks(self) -> int:
        return len(self.schedulers)

    def warmup(self, threads: int | None = None, on_compiled=None, *,
               cache_dir: str | os.PathLike | None = None) -> float:
        """Compiles every executable the loop can use (`num_executables`: `warmup_plan` says which);
        returns the seconds taken.

        Lowers each one (ahead of time, nothing runs, nothing is donated) and compiles it on one of
        ``threads`` threads (default: the CPU count) while the next is lowered, the largest first; the loop
        then runs them directly (`jaxprep.executables`). Where the persistent compilation cache is on and
        holds them, they are loaded from disk without tracing. What it compiles is logged on
        ``jaxprep.warmup`` (INFO; `jaxprep.compilation`).

        Args:
          threads: compile threads (default: the CPU count).
          on_compiled: ``on_compiled(done, total, what)`` after each compile (a progress display).
          cache_dir: turn on JAX's persistent compilation cache there first (`jaxprep.use_compile_cache`):
            a second process loads the executables instead of compiling them.
        """
        start = time.perf_counter()
        self.batch.executables.update(warm(self._warmup_executables(), threads, on_compiled, why=self.warmup_plan(),
                                           cache_dir=cache_dir))
        self.batch.steady_programs = True  # compiled with the rest (`batch.update_executables`)
        return time.perf_counter() - start

    def warmup_plan(self) -> str:
        """What `warmup` compiles, in words: the serving step at each token bucket a step can reach and its door
        rungs (`batch.door_rungs`: one or two payload sizes, the bulk rung on top where a bucket takes admissions
        whole; each bucket once with ``separate_updates``), and the state updates alone at the top payload size (a
        widening for each other)."""
        separate = self.batch.separate_updates
        steps = "without its updates" if separate else \
            f"({counted(self._num_steps, 'program')}: one or two update sizes each)"
        return (f"the serving step at {describe_buckets(self.config.prep.reachable_buckets)} {steps}, and the state "
                f"updates alone at the top of {counted(len(payload_buckets(self.config)), 'size')} (a widening for "
                f"each other){', applied before each step (the steady ones by a smaller program)' if separate else ''}"
                f"{''.join(f', and a large update at {words} words' for words in bulk_rungs(self.config))}")

    @property
    def num_executables(self) -> int:
        """What `warmup` compiles: per token bucket a step can reach (`PrepConfig.reachable_buckets`) the step
        at each of its door rungs (`batch.door_rungs`; once, without its updates, with ``separate_updates``); the
        updates a crowded step sends first, one executable at the top payload rung and a widening of each smaller
        rung (`batch.apply_buffer`), and one at the bulk rung of a large update (`update_packing.bulk_rungs`);
        with ``separate_updates`` the steady updates' program at each step rung (`step_payload_buckets`).
        (`prep_timing` compiles its twin apart.)"""
        separate = self.batch.separate_updates  # and the steady updates' program per step rung (`update_executables`)
        return (len(payload_buckets(self.config)) + len(bulk_rungs(self.config))
                + (len(step_payload_buckets(self.config)) if separate else 0) + self._num_steps)

    @property
    def _num_steps(self) -> int:
        """The serving step's executables: one per bucket with ``separate_updates``, else one per door rung."""
        buckets = self.config.prep.reachable_buckets
        if self.batch.separate_updates:
            return len(buckets)
        return sum(map(len, door_programs(self.config, buckets).values()))

    def _warmup_executables(self):
        """The executables of `warmup`, the largest first: the steps (the largest buckets first, each at its door
        rungs; with ``separate_updates`` each bucket's once, without its updates), the updates at the top rung,
        then the widening of each smaller rung."""
        buckets = tuple(reversed(self.config.prep.reachable_buckets))
        if self.batch.separate_updates:
            yield from map(self._bare_step_executable, buckets)
        else:
            for words, door_buckets in door_programs(self.config, buckets).items():
                packed = self._empty_buffers(words)
                yield from (self._step_executable(packed, bucket) for bucket in door_buckets)
        yield from self.batch.update_executables(self._empty_buffers)

    def add_request(self, request: Request) -> None:
        """Routes ``request`` to the rank with the fewest tokens still to compute (`dp_policy.route`)."""
        self.schedulers[dp_policy.route(self.schedulers)].add_request(request)

    def step(self) -> list[Request]:
        """One host iteration on every rank: schedule, send the updates, run the step, take the tokens back."""
        start = time.perf_counter()
        outs = [s.schedule() for s in self.schedulers]
        if not any(out.total_num_scheduled_tokens for out in outs):
            raise RuntimeError("the scheduler found nothing to run (a request cannot fit the KV cache?)")
        bucket = dp_policy.coordinate(self.config.prep, self.schedulers, outs)  # every rank pads to it
        updates = self._rank_updates(outs)
        packed = self._pack(updates, bucket)
        if self.time_prep:  # replayed after the loop, on a donated copy of the state (`prep_timing`)
            self.prep_replay.append((packed, bucket))
        dispatched = time.perf_counter()
        tokens = self._serve(updates, bucket, packed)
        read = time.perf_counter()
        tokens = [StepTokens(part, self.config.num_speculative_tokens) for part in tokens]  # each array read once
        self._count(outs, tokens, bucket)
        eos = self.config.eos_token_id
        done = [r for s, out, part in zip(self.schedulers, outs, tokens, strict=True) for r in s.update(out, part, eos)]
        self._live_ids.difference_update(r.request_id for r in done)
        if self.keep_history:
            self.stats.dispatch_us.append((read - dispatched) * 1e6)
            self.stats.step_us.append((time.perf_counter() - start) * 1e6)
        return done

    def submit(self, requests, arrival_steps=None) -> None:
        """Queues ``requests``; request i joins the scheduler at host iteration ``arrival_steps[i]``
        (default: the current one).

        Raises ValueError, with nothing queued, if the two lengths differ, an arrival step is not an
        integer >= 0, a request id is already live (submitted and not finished) or repeated, or a
        request is malformed or can never run (`Scheduler.check_request`: its fields' types and ranges,
        its length, its token ids against vocab_size, its blocks).
        """
        if isinstance(requests, Request):
            raise ValueError("Engine.submit takes a list of requests, got one Request: submit([request])")
        requests = list(requests)
        steps = [self.iteration] * len(requests) if arrival_steps is None else list(arrival_steps)
        if len(steps) != len(requests):
            raise ValueError(f"Engine.submit: {len(requests)} requests but {len(steps)} arrival_steps; "
                             "give one arrival step per request")
        seen = set(self._live_ids)
        for i, (step, request) in enumerate(zip(steps, requests)):
            steps[i] = integer(f"Engine.submit: arrival_steps[{i}]", step, minimum=0)
            self.scheduler.check_request(request)  # types first: an unhashable id fails here, named
            if request.request_id in seen:
                raise ValueError(f"Engine.submit: requests[{i}] has request_id {request.request_id!r}, "
                                 "which is already submitted and not finished")
            seen.add(request.request_id)
        self._live_ids = seen
        queued = [(s, next(self._order), r) for s, r in zip(steps, requests)]
        self._arrivals = sorted(self._arrivals + queued, key=lambda item: item[:2])

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
        return any(s.has_unfinished for s in self.schedulers)

    @property
    def finished(self) -> list[Request]:
        """Finished requests not drained yet, rank by rank, each rank's in finishing order."""
        return [request for s in self.schedulers for request in s.finished]

    def drain_finished(self) -> list[Request]:
        """The finished requests (as `finished` orders them), handed out and forgotten by the engine:
        call it as a long-running engine goes, so its memory stays flat."""
        return [request for s in self.schedulers for request in s.drain_finished()]

    def _rank_updates(self, outs: list[SchedulerOutput]) -> list[StepUpdates | ColumnsUpdate]:
        """Every rank's payload (any number of adds and appends: the buffers grow with them): the scheduler's
        output read straight into the buffer's columns (`scheduler_columns`) where the configuration allows,
        else a `StepUpdates`."""
        if not self._columns:
            return [scheduler_updates(self.config, out) for out in outs]
        table_blocks = self.batch.rows.table_blocks
        payloads = []
        for out in outs:
            columns = scheduler_columns(self.config, out, table_blocks)
            payloads.append(scheduler_updates(self.config, out) if columns is None else
                            ColumnsUpdate(columns, functools.partial(scheduler_updates, self.config, out)))
        return payloads

    def _count(self, outs: list[SchedulerOutput], tokens: list[np.ndarray | StepTokens], bucket: int) -> None:
        """Every rank pads to ``bucket`` in every iteration it runs (an idle rank runs one, all padding);
        a dispatch's model steps are those of its longest-running rank."""
        stats = self.stats
        stats.dispatches += 1
        k = self.config.num_speculative_tokens
        tokens = [step_tokens(part, k) for part in tokens]
        scheduled = [out.num_scheduled_tokens for out in outs]
        # the first pass's prefill and decode tokens: the dispatch's record has them (kept with the history)
        record = dispatch_record(scheduled, [part.tokens[k:part.tokens.shape[0] - k] for part in tokens], bucket) \
            if self.keep_history else None
        iterations = []
        for out, appended, counts in zip(outs, tokens, scheduled, strict=True):
            iterations.append(appended.num_iterations)
            stats.preemptions += out.num_preempted
            drafts = out.num_draft_tokens
            if drafts.any():
                stats.draft_tokens += int(drafts.sum())
                stats.accepted_draft_tokens += int((drafts - appended.num_rejected(drafts))[drafts > 0].sum())
                stats.draft_steps += int((drafts > 0).sum())
            stats.output_tokens += int(appended.num_appended.sum())
            decoded = int(appended.num_decoded.sum())  # later iterations' tokens, one decode each
            stats.scheduled_tokens += out.total_num_scheduled_tokens + decoded
            stats.decode_tokens += decoded
            if record is None:
                stats.prefill_tokens += int(counts[counts > 1].sum())
                stats.decode_tokens += int((counts == 1).sum())
            stats.padded_tokens += bucket * iterations[-1]
        stats.multi_step_dispatches += int(any(out.decode_steps > 1 for out in outs))
        step_bytes = self.batch.h2d_bytes - stats.h2d_bytes
        stats.h2d_bytes, stats.changed_words = self.batch.h2d_bytes, self.batch.changed_words
        stats.model_steps += max(iterations)
        if record is not None:
            stats.prefill_tokens += record.prefill_tokens
            stats.decode_tokens += record.decode_tokens
            stats.dispatches_log.append(record)
            stats.h2d_bytes_log.append(step_bytes)

    # --- device hooks: one rank on one device ---------------------------------------------------

    def _pack(self, updates: list[StepUpdates], bucket: int) -> PackedStep:
        """The step's packed updates for its token bucket ``bucket`` (a step's admissions whole where the bucket takes
        them so, `batch.door_rungs`; `ServingBatch.serve` pads the step's buffer to one of its door rungs, the
        sharded batch while it stacks the ranks)."""
        return self.batch.pack(updates[0], bucket)

    def _empty_buffers(self, words: int):
        """An empty update of ``words`` words (what warm-up lowers each rung with)."""
        return np.zeros(words, np.int32)

    def _apply_updates(self, updates: list[StepUpdates]) -> None:
        self.batch.apply_updates(updates[0])

    def _serve(self, updates: list[StepUpdates], bucket: int, packed) -> list[np.ndarray]:
        """Runs the fused step; returns each rank's appended tokens [iterations, max_num_reqs]."""
        self.kv_cache, tokens = self.batch.serve(self.kv_cache, self.params, updates[0], model=self.model,
                                                 num_tokens_padded=bucket, packed=packed)
        return [tokens]

    def _prepare_twin(self, state, packed, bucket: int):
        """The prepare part of the step on ``state`` (donated): ``(state, step)``; the step's own buffer
        only (the extra buffers applied before it in a crowded step are left out)."""
        compiled = self.batch.executables.get(("twin", bucket, packed.step.shape[-1]))  # `prep_timing` warmed it
        if compiled is not None:
            return compiled(state, packed.step)
        twin = self._twin_executable(packed, bucket)
        return twin.function(state, packed.step, **twin.kwargs)

    def _twin_executable(self, packed, bucket: int) -> Executable:
        """`_prepare_twin`'s executable (`prep_timing` warms every bucket's at once)."""
        return Executable(("twin", bucket, packed.step.shape[-1]), update_and_prepare_donated,
                          (self.batch.state, packed.step), dict(config=self.config, num_tokens_padded=bucket),
                          f"prepare alone at {bucket} tokens, updates of {packed.step.shape[-1]} words (timed apart)")

    def _bare_step_executable(self, bucket: int) -> Executable:
        """`run_step` at ``bucket`` (``separate_updates``: the step without its updates)."""
        return Executable(("run_step", self.model, bucket), run_step,
                          (self.batch.state, self.kv_cache, self.params, np.int32(1)),
                          dict(config=self.config, model=self.model, num_tokens_padded=bucket),
                          f"serving step at {bucket} tokens, its updates applied apart")

    def _step_executable(self, packed, bucket: int) -> Executable:
        return Executable(("serve_step", self.model, bucket, packed.shape[-1]), serve_step,
                          (self.batch.state, self.kv_cache, self.params, packed),
                          dict(config=self.config, model=self.model, num_tokens_padded=bucket),
                          f"serving step at {bucket} tokens, updates of {packed.shape[-1]} words")


def with_vocab_size(config: ServingConfig, model: ServingModel) -> ServingConfig:
    """``config`` with the model's vocab_size filled in (token ids are checked against it); raises
    ValueError if ``config.vocab_size`` exceeds the model's."""
    if config.vocab_size is None:
        return dataclasses.replace(config, vocab_size=model.vocab_size)
    if config.vocab_size > model.vocab_size:
        raise ValueError(f"ServingConfig.vocab_size={config.vocab_size} exceeds the model's vocab_size="
                         f"{model.vocab_size}")
    return config


def scheduler_updates(config: ServingConfig, out: SchedulerOutput) -> StepUpdates:
    """The `StepUpdates` of one `Scheduler.schedule` output."""
    return StepUpdates.build(config, finish=out.finished_rows, add=out.new_requests, append=out.new_block_ids,
                             num_scheduled_tokens=out.num_scheduled_tokens, decode_steps=out.decode_steps,
                             num_draft_tokens=out.num_draft_tokens, draft_token_ids=out.draft_token_ids)
