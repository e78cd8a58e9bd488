"""The serving state split over a device mesh by request rows: one vLLM DP rank per device.

Rank r owns rows ``[r * R, (r + 1) * R)`` of the global `ServingState` (R = the per-rank
``ServingConfig.max_num_reqs``) and blocks ``[r * NB, (r + 1) * NB)`` of the global KV cache
(NB = the per-rank ``num_blocks``). Inside one jitted ``shard_map`` call every device sees only its
slices, so the per-rank code is the single-device code (`serve_body`): row indices, block ids and
slots in payloads and metadata are local to their rank. Each rank sends its own packed
`StepUpdates`; they travel as one [num_ranks, words] array sharded by rank (every rank's buffer
padded to the longest rung of the step).

On several processes (`jax.distributed.initialize`, README "Multi-host") every array is assembled
with `jax.make_array_from_callback`, so each process places only the slices of its own devices'
ranks, and the step's tokens come back to every process through `process_allgather`: the host
loop (routing, the shared bucket, the schedulers) then runs the same on every process.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxprep.executables import run
from jaxprep.models.tiny import KVCache, ServingModel
from jaxprep.prepare import prepare_padded
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.host import checks
from jaxprep.serving.host.batch import advance_rows, apply_buffer, door_step_words, door_words, update_executables
from jaxprep.serving.state import ServingState, StepUpdates
from jaxprep.serving.step import serve_body, update_and_prepare_body
from jaxprep.serving.transitions import apply_updates_body
from jaxprep.serving.update_packing import pack_step, pad_to, unpack_updates
from jaxprep.sharding import DATA_AXIS

ROWS = PartitionSpec(DATA_AXIS)  # leading axis split by rank
SLOTS = PartitionSpec(None, DATA_AXIS)  # KV cache [layers, slots, heads, head_dim]: slots split by rank
WHOLE = PartitionSpec()  # replicated (model weights)


def _per_rank(fn, mesh: Mesh, in_specs, out_specs):
    # check_vma off: the serving loop's carries start as constants and become per-rank values
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@functools.partial(jax.jit, static_argnames=("config", "model", "num_tokens_padded", "mesh"),
                   donate_argnames=("state", "kv_cache"))
def serve_step_sharded(state: ServingState, kv_cache: KVCache, params, packed: jax.Array, *, config: ServingConfig,
                       model: ServingModel, num_tokens_padded: int, mesh: Mesh):
    """`serve_step` on every rank at once; ``packed`` [num_ranks, packed_size]. Returns the state, the
    KV cache and the tokens [config.decode_steps, num_ranks * max_num_reqs] by global row."""

    def rank_step(state, kv_cache, params, packed):
        return serve_body(state, kv_cache, params, packed[0], config, model, num_tokens_padded)

    return _per_rank(rank_step, mesh, (ROWS, SLOTS, WHOLE, ROWS), (ROWS, SLOTS, SLOTS))(state, kv_cache, params,
                                                                                      packed)


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames="state")
def apply_updates_sharded(state: ServingState, packed: jax.Array, *, config: ServingConfig, mesh: Mesh):
    """`apply_updates_body` on every rank at once (the extra adds and appends of a crowded step)."""

    def rank_update(state, packed):
        return apply_updates_body(state, unpack_updates(packed[0], config))

    return _per_rank(rank_update, mesh, (ROWS, ROWS), ROWS)(state, packed)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded", "mesh"))
def update_and_prepare_sharded(state: ServingState, packed: jax.Array, *, config: ServingConfig, num_tokens_padded: int,
                         mesh: Mesh):
    """The preparation part of `serve_step_sharded` alone, not donating (what the simulator times)."""

    def rank_prepare(state, packed):
        step = update_and_prepare_body(state, packed[0], config, num_tokens_padded)
        return jax.tree.map(lambda leaf: leaf[None], step)

    return _per_rank(rank_prepare, mesh, (ROWS, ROWS), ROWS)(state, packed)


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded", "mesh"), donate_argnames="state")
def update_and_prepare_sharded_donated(state: ServingState, packed: jax.Array, *, config: ServingConfig,
                                       num_tokens_padded: int, mesh: Mesh):
    """`update_and_prepare_donated` on every rank at once: returns ``(state, step)``, the state
    updated in place (what the simulator times as the prepare part of a step)."""

    def rank_prepare(state, packed):
        state = apply_updates_body(state, unpack_updates(packed[0], config))
        step = prepare_padded(state.batch, config.prep, num_tokens_padded)
        return state, jax.tree.map(lambda leaf: leaf[None], step)

    return _per_rank(rank_prepare, mesh, (ROWS, ROWS), (ROWS, ROWS))(state, packed)


@dataclasses.dataclass(frozen=True)
class ShardedPacked:
    """`PackedStep` of every rank: each buffer a [num_ranks, words] array sharded by rank."""

    before: tuple[jax.Array, ...]
    step: jax.Array

    @property
    def buffers(self) -> tuple[jax.Array, ...]:
        return (*self.before, self.step)


class ShardedServingBatch:
    """`ServingBatch` over a mesh: the global state and one host mirror (`HostRows`) per rank.

    ``config`` describes one rank. Each call takes one `StepUpdates` per rank, checks every rank's
    payload against its mirror and raises `InvalidUpdateError` (naming the rank) before anything
    is dispatched; on success the old state is donated.
    """

    def __init__(self, config: ServingConfig, mesh: Mesh):
        self.config, self.mesh, self.num_ranks = config, mesh, mesh.size
        # every rank's rows (its row 0 holds its error word and LoRA slots: `state_layout.SHARED`)
        self.state = put_global(ServingState.empty(_global(config, self.num_ranks)), NamedSharding(mesh, ROWS))
        self.rows = [checks.HostRows.for_config(config) for _ in range(self.num_ranks)]
        self.h2d_bytes = self.changed_words = 0
        self.separate_updates = False  # every rank's updates travel with its step (`ServingBatch`'s option)
        self.executables: dict = {}  # what a warm-up compiled or loaded, by key (`jaxprep.executables.run`)

    def packed(self, updates: list[StepUpdates], num_tokens_padded: int | None = None) -> ShardedPacked:
        """Every rank's packed updates: the buffers applied before the step (as many as the rank
        that needs most; an empty buffer for the others) and the step's, each one array sharded by rank.
        ``num_tokens_padded``: the step's bucket, whose door rungs (`batch.door_rungs`) the step's buffers are
        padded to, as `serve` runs them (None: to the longest rank's rung, for `apply_updates`)."""
        words = door_step_words(self.config, num_tokens_padded)
        packs = [pack_step(self.config, u, rows.table_blocks, words)
                 for u, rows in zip(updates, self.rows, strict=True)]
        depth = max(len(p.before) for p in packs)
        before = [self._stacked([p.before[i] if i < len(p.before) else p.step[:0] for p in packs])
                  for i in range(depth)]
        step = self._stacked([p.step for p in packs], num_tokens_padded)
        self.h2d_bytes += sum(b.size * 4 for b in before) + step.size * 4
        self.changed_words += sum(p.changed_words for p in packs)
        return ShardedPacked(before=tuple(before), step=step)

    def _stacked(self, buffers: list[np.ndarray], bucket: int | None = None) -> jax.Array:
        words = max(64, max(len(b) for b in buffers))
        if bucket is not None:  # a step's buffers: at one of the bucket's two door rungs
            words = door_words(self.config, bucket, words)
        stacked = np.stack([pad_to(b, words) for b in buffers]).astype(np.int32)
        return put_global(stacked, NamedSharding(self.mesh, ROWS))

    def apply_updates(self, updates: list[StepUpdates]) -> None:
        rows = self._checked(updates)
        packed = self.packed(updates)
        for buffer in packed.buffers:
            self.state = self._apply(buffer)
        self.rows = rows

    def serve(self, kv_cache: KVCache, params, updates: list[StepUpdates], *, model: ServingModel,
              num_tokens_padded: int, packed: ShardedPacked | None = None) -> tuple[KVCache, np.ndarray]:
        """Runs `serve_step_sharded`; returns the KV cache and the tokens [decode_steps, num_ranks * R]."""
        rows = self._checked(updates)
        for rank, (rank_rows, rank_updates) in enumerate(zip(rows, updates)):
            try:
                checks.check_step(rank_rows, int(np.asarray(rank_updates.decode_steps)[0]), num_tokens_padded,
                                  self.config)
            except checks.InvalidUpdateError as error:
                raise checks.InvalidUpdateError(f"rank {rank}: {error}") from None
        packed = self.packed(updates, num_tokens_padded) if packed is None else packed
        for buffer in packed.before:
            self.state = self._apply(buffer)
        key = ("serve_step", model, num_tokens_padded, packed.step.shape[-1])
        self.state, kv_cache, tokens = run(self.executables, key, serve_step_sharded, self.state, kv_cache, params,
                                           packed.step, config=self.config, model=model,
                                           num_tokens_padded=num_tokens_padded, mesh=self.mesh)
        tokens = to_host(tokens)
        k = self.config.num_speculative_tokens
        self.rows = [advance_rows(r, part, k) for r, part in zip(rows, self.rank_tokens(tokens))]
        return kv_cache, tokens

    def _apply(self, buffer: jax.Array) -> ServingState:
        """Every rank's buffer of one rung applied by the one top-rung executable (`batch.apply_buffer`)."""
        return apply_buffer(self.executables, self.state, buffer, self.config, apply_updates_sharded, mesh=self.mesh)

    def update_executables(self, empty):
        return update_executables(self.state, self.config, empty, apply_updates_sharded, mesh=self.mesh)

    def rank_tokens(self, tokens: np.ndarray) -> list[np.ndarray]:
        """[iterations, num_ranks * R] -> one [iterations, R] block per rank."""
        return np.split(tokens, self.num_ranks, axis=1)

    def _checked(self, updates: list[StepUpdates]) -> list[checks.HostRows]:
        if len(updates) != self.num_ranks:
            raise ValueError(f"got {len(updates)} StepUpdates for {self.num_ranks} ranks")
        checked = []
        for rank, (rows, rank_updates) in enumerate(zip(self.rows, updates)):
            try:
                checked.append(checks.check_updates(rows, rank_updates, self.config))
            except checks.InvalidUpdateError as error:
                raise checks.InvalidUpdateError(f"rank {rank}: {error}") from None
        return checked


def _global(config: ServingConfig, num_ranks: int) -> ServingConfig:
    """The configuration of all ranks' rows together (only its sizes are used: the empty state)."""
    prep = dataclasses.replace(config.prep, max_num_reqs=config.max_num_reqs * num_ranks)
    return dataclasses.replace(config, prep=prep)


def sharded_kv_cache(model: ServingModel, config: ServingConfig, mesh: Mesh) -> KVCache:
    """Zeros for every rank's ``config.num_blocks`` blocks, each rank's slots on its device."""
    cache = KVCache.zeros(model, config.num_blocks * mesh.size, config.block_size)
    return put_global(cache, NamedSharding(mesh, SLOTS))


def replicated(tree, mesh: Mesh):
    """``tree`` on every device of ``mesh`` (the model weights; the same on every process)."""
    return put_global(tree, NamedSharding(mesh, WHOLE))


def put_global(tree, sharding: NamedSharding):
    """Every leaf of ``tree`` (the whole value, the same on every process) as an array with
    ``sharding``. On several processes each one places only its own devices' slices
    (`jax.make_array_from_callback`); on one it is `jax.device_put`."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def put(leaf):
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def to_host(array: jax.Array) -> np.ndarray:
    """The whole of ``array`` on this host: every process's shards gathered (`process_allgather`)
    when it spans several processes."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
