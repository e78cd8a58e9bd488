"""The serving loop over a device mesh: one host scheduler per DP rank, one jitted call per step.

Like vLLM's data parallelism, every rank is a whole engine (its own requests, rows, blocks and
KV cache) and a coordinator only routes requests and keeps the ranks in step: a new request goes
to the rank with the fewest unfinished requests, and each step pads every rank to the bucket of
the busiest one (an idle rank runs a padding-only batch, vLLM's dummy batch). All ranks then run
in one `serve_step_sharded` dispatch.
"""

from __future__ import annotations

import itertools
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jaxprep.serving.config import ServingConfig
from jaxprep.serving.dispatch_log import dispatch_record
from jaxprep.serving.engine import Engine, LoopStats, split_updates
from jaxprep.serving.model import ServingModel, init_params
from jaxprep.serving.scheduler import Request, Scheduler, SchedulerOutput
from jaxprep.serving.sharded import (ShardedServingBatch, apply_updates_sharded, prepare_step_sharded, replicated,
                                     serve_step_sharded, sharded_kv_cache)
from jaxprep.serving.state import StepUpdates
from jaxprep.sharding import dp_bucket


class DataParallelEngine(Engine):
    """`Engine` with one `Scheduler` per device of ``mesh``; ``config`` describes one rank."""

    def __init__(self, config: ServingConfig, model: ServingModel, mesh: Mesh, *, seed: int = 0,
                 time_prep: bool = False, params=None):
        self.config, self.model, self.mesh, self.time_prep = config, model, mesh, time_prep
        self.batch = ShardedServingBatch(config, mesh)
        self.schedulers = [Scheduler(config) for _ in range(mesh.size)]
        self.params = replicated(init_params(model, seed) if params is None else params, mesh)
        self.kv_cache = sharded_kv_cache(model, config, mesh)
        self.stats = LoopStats()
        self.iteration = 0
        self._arrivals: list[tuple[int, int, Request]] = []
        self._order = itertools.count()

    @property
    def num_ranks(self) -> int:
        return self.mesh.size

    def _lowered(self):
        """Every executable the loop can use, lowered from the live arrays (so with their shardings)."""
        config, mesh, state = self.config, self.mesh, self.batch.state
        packed = self.batch.packed([StepUpdates.build(config)] * self.num_ranks)
        yield apply_updates_sharded.lower(state, packed, config=config, mesh=mesh)
        for bucket in config.prep.token_buckets:
            yield serve_step_sharded.lower(state, self.kv_cache, self.params, packed, config=config,
                                           model=self.model, num_tokens_padded=bucket, mesh=mesh)
            if self.time_prep:
                yield prepare_step_sharded.lower(state, packed, config=config, num_tokens_padded=bucket, mesh=mesh)

    def add_request(self, request: Request) -> None:
        """Routes ``request`` to the least loaded rank (fewest unfinished requests; ties: lowest rank)."""
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        self.schedulers[int(np.argmin(loads))].add_request(request)

    @property
    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.schedulers)

    @property
    def finished(self) -> list[Request]:
        return [request for s in self.schedulers for request in s.finished]

    def step(self) -> list[Request]:
        """One host iteration on every rank: schedule, send the updates, run, take the tokens back."""
        outs = [s.schedule() for s in self.schedulers]
        totals = [out.total_num_scheduled_tokens for out in outs]
        if not any(totals):
            raise RuntimeError("no rank found anything to run (a request cannot fit the KV cache?)")
        updates = self._rank_updates(outs)
        bucket = dp_bucket(self.config.prep, totals)
        packed = self.batch.packed(updates)
        if self.time_prep:
            begin = time.perf_counter()
            jax.block_until_ready(prepare_step_sharded(self.batch.state, packed, config=self.config,
                                                       num_tokens_padded=bucket, mesh=self.mesh))
            self.stats.prep_us.append((time.perf_counter() - begin) * 1e6)
        self.kv_cache, tokens = self.batch.serve(self.kv_cache, self.params, updates, model=self.model,
                                                 num_tokens_padded=bucket, packed=packed)
        per_rank = self.batch.rank_tokens(tokens)
        self._count_ranks(outs, per_rank, bucket)
        eos = self.config.eos_token_id
        return [r for s, out, part in zip(self.schedulers, outs, per_rank) for r in s.update(out, part, eos)]

    def _rank_updates(self, outs: list[SchedulerOutput]) -> list[StepUpdates]:
        """Every rank's fused payload; extra adds and appends go first, all ranks in each dispatch."""
        split = [split_updates(self.config, out) for out in outs]
        empty = StepUpdates.build(self.config)
        for i in range(max(len(extra) for extra, _ in split)):
            self.batch.apply_updates([extra[i] if i < len(extra) else empty for extra, _ in split])
        return [updates for _, updates in split]

    def _count_ranks(self, outs: list[SchedulerOutput], tokens: list[np.ndarray], bucket: int) -> None:
        """Every rank pads to ``bucket`` in every iteration it runs (an idle rank runs one, all padding);
        a dispatch's model steps are those of its longest-running rank."""
        stats = self.stats
        stats.dispatches += 1
        iterations = []
        for out, part in zip(outs, tokens):
            later = (part[1:] >= 0).sum(axis=1)
            iterations.append(1 + int(np.count_nonzero(later)))
            stats.preemptions += out.num_preempted
            stats.output_tokens += int((part >= 0).sum())
            stats.scheduled_tokens += out.total_num_scheduled_tokens + int(later.sum())
            stats.padded_tokens += bucket * iterations[-1]
        stats.multi_step_dispatches += int(any(out.decode_steps > 1 for out in outs))
        stats.model_steps += max(iterations)
        stats.dispatches_log.append(dispatch_record([out.num_scheduled_tokens for out in outs], tokens, bucket))
