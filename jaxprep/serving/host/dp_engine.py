"""The serving loop over a device mesh: one host scheduler per DP rank, one jitted call per step.

Like vLLM's data parallelism, every rank is a whole engine (its own requests, rows, blocks and
KV cache) and a coordinator only routes requests and keeps the ranks in step: a new request goes
to the rank with the fewest tokens still to compute, and each step pads every rank to one shared
bucket (an idle rank runs a padding-only batch, vLLM's dummy batch), chosen to waste little
(`jaxprep.serving.host.dp_policy`). All ranks then run in one `serve_step_sharded` dispatch. The loop is
`Engine`'s; only the device hooks differ.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from jaxprep.executables import Executable
from jaxprep.models.tiny import ServingModel, init_params
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host.engine import Engine, scheduler_updates, with_vocab_size
from jaxprep.serving.host.sharded import (
    ShardedServingBatch,
    replicated,
    serve_step_sharded,
    sharded_kv_cache,
    update_and_prepare_sharded_donated,
)
from jaxprep.serving.state import StepUpdates


class DataParallelEngine(Engine):
    """`Engine` with one `Scheduler` per device of ``mesh``; ``config`` describes one rank."""

    def __init__(self, config: ServingConfig, model: ServingModel, mesh: Mesh, *, seed: int = 0,
                 time_prep: bool = False, params=None, keep_history: bool = False):
        self.mesh = mesh
        config = with_vocab_size(config, model)
        params = init_params(model, seed) if params is None else params
        self._start(config, model, time_prep, batch=ShardedServingBatch(config, mesh), num_ranks=mesh.size,
                    params=replicated(params, mesh), kv_cache=sharded_kv_cache(model, config, mesh),
                    keep_history=keep_history)

    def _rank_updates(self, outs) -> list[StepUpdates]:
        """Every rank's `StepUpdates` (what `ShardedServingBatch` checks and packs, rank by rank)."""
        return [scheduler_updates(self.config, out) for out in outs]

    def _pack(self, updates: list[StepUpdates], bucket: int):
        return self.batch.packed(updates, bucket)

    def _apply_updates(self, updates: list[StepUpdates]) -> None:
        self.batch.apply_updates(updates)

    def _serve(self, updates: list[StepUpdates], bucket: int, packed):
        self.kv_cache, tokens = self.batch.serve(self.kv_cache, self.params, updates, model=self.model,
                                                 num_tokens_padded=bucket, packed=packed)
        return self.batch.rank_tokens(tokens)

    def _twin_executable(self, packed, bucket: int) -> Executable:
        return Executable(("twin", bucket, packed.step.shape[-1]), update_and_prepare_sharded_donated,
                          (self.batch.state, packed.step),
                          dict(config=self.config, num_tokens_padded=bucket, mesh=self.mesh),
                          f"prepare alone at {bucket} tokens, updates of {packed.step.shape[-1]} words (timed apart)")

    def _empty_buffers(self, words: int):
        """An empty update of ``words`` words per rank, sharded as the live buffers are."""
        return self.batch._stacked([np.zeros(words, np.int32)] * self.num_ranks)

    def _step_executable(self, packed, bucket: int) -> Executable:
        """Lowered from the live arrays, so with their shardings."""
        return Executable(("serve_step", self.model, bucket, packed.shape[-1]), serve_step_sharded,
                          (self.batch.state, self.kv_cache, self.params, packed),
                          dict(config=self.config, model=self.model, num_tokens_padded=bucket, mesh=self.mesh),
                          f"serving step at {bucket} tokens, updates of {packed.shape[-1]} words per rank")
