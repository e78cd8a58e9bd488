"""Data parallelism over a device mesh: the batch state split by request rows, one DP rank per device.

Each rank is a vLLM data-parallel rank (docs/semantics.md#tpu-data-parallel): it owns a contiguous slice of
``config.max_num_reqs`` state rows and prepares its own step from them with the same `PrepConfig`
(its own token budget and bucket ladder), so its metadata indexes its own slice: ``idx_mapping``
holds rows of the slice and ``query_start_loc`` starts at 0 on every rank. All ranks pad to one
bucket, the one holding the busiest rank's tokens (vLLM's ``coordinate_batch_across_dp``).

One jitted call prepares every rank: ``shard_map`` runs `prepare_body` on each device's rows.
Every array of the returned `StepInputs` gains a leading rank axis ``[num_ranks, ...]`` sharded
over the mesh; ``x.reshape(-1)`` of a token field is tpu-inference's flat layout, rank r's tokens
at ``[r * T_pad, (r + 1) * T_pad)``, and of ``query_start_loc`` its ``max_num_reqs + dp_size`` array.

```
# 2 ranks of 3 rows, S [2,0,1 | 0,0,4], bucket 4 -> idx_mapping [[0,2,-1], [2,-1,-1]],
#   query_start_loc [[0,2,3,3], [0,4,4,4]], positions [[C0, C0+1, C2, 0], [C5, C5+1, C5+2, C5+3]]
```
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxprep.bounds import expect, expect_bucket
from jaxprep.config import PrepConfig
from jaxprep.metadata import StepInputs
from jaxprep.prepare import prepare_body
from jaxprep.state import BatchState
from jaxprep.validate import InvalidBatchError, expect_state_and_config, validate

DATA_AXIS = "data"
"""Name of the mesh axis the request rows are split over."""


def data_mesh(num_devices: int | None = None, devices=None) -> Mesh:
    """A 1-D mesh over ``devices`` (default: the first ``num_devices`` of `jax.devices`, all by default)."""
    if devices is None:
        available = jax.devices()
        num_devices = len(available) if num_devices is None else num_devices
        if num_devices > len(available):
            raise ValueError(f"asked for {num_devices} devices, JAX sees {len(available)} "
                             f"({available[0].platform}); on CPU start the process with "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices}")
        devices = available[:num_devices]
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (row) axis split over the mesh, the rest whole on each device."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def shard_rows(tree, mesh: Mesh):
    """Every array of ``tree`` placed with its rows split evenly over ``mesh`` (rank r: the r-th slice)."""
    for leaf in jax.tree.leaves(tree):
        if leaf.shape[0] % mesh.size:
            raise ValueError(f"{leaf.shape[0]} rows do not split evenly over {mesh.size} devices")
    return jax.device_put(tree, row_sharding(mesh))


def stack_ranks(rank_states: list[BatchState], mesh: Mesh) -> BatchState:
    """One sharded `BatchState` whose rank r holds ``rank_states[r]`` (host or device arrays)."""
    host = jax.tree.map(lambda *leaves: np.concatenate([np.asarray(x) for x in leaves]), *rank_states)
    return shard_rows(host, mesh)


def rank_slice(tree, rank: int, num_ranks: int):
    """Rank ``rank``'s rows of a row-stacked (or rank-stacked) pytree, as host arrays."""
    def take(leaf):
        leaf = np.asarray(leaf)
        size = leaf.shape[0] // num_ranks
        return leaf[rank * size:(rank + 1) * size]

    return jax.tree.map(take, tree)


def dp_bucket(config: PrepConfig, tokens_per_rank) -> int:
    """The bucket every rank pads to: the one holding the busiest rank (at least the smallest rung)."""
    busiest = int(np.max(tokens_per_rank))
    return config.bucket_for(busiest) if busiest > 0 else config.token_buckets[0]


def prepare_data_parallel(state: BatchState, config: PrepConfig, mesh: Mesh, num_tokens_padded: int | None = None,
                          *, check: bool = False) -> StepInputs:
    """Prepares every rank's step in one jitted call; ``config`` describes one rank.

    ``state`` holds ``config.max_num_reqs`` rows per device of ``mesh`` (`stack_ranks`,
    `shard_rows`). ``num_tokens_padded=None`` reads the per-rank totals back and picks `dp_bucket`;
    ``check`` validates every rank's rows on the host (`validate_ranks`). Both read every rank's
    counts, so on several hosts pass the agreed bucket and validate each host's rows yourself
    (README, "Multi-host").
    """
    expect_state_and_config("prepare_data_parallel", state, config)
    expect("prepare_data_parallel", "mesh", mesh, Mesh, "a jax.sharding.Mesh", "data_mesh(n) makes one")
    expect_bucket("prepare_data_parallel", num_tokens_padded)
    rows = state.num_scheduled_tokens.shape[0]
    if rows != config.max_num_reqs * mesh.size:
        raise ValueError(f"BatchState has {rows} rows; {mesh.size} ranks of max_num_reqs={config.max_num_reqs} "
                         f"need {config.max_num_reqs * mesh.size}")
    if num_tokens_padded is None:
        scheduled = np.asarray(state.num_scheduled_tokens, np.int64).reshape(mesh.size, -1)
        num_tokens_padded = dp_bucket(config, scheduled.sum(axis=1))
    if check:
        validate_ranks(state, config, mesh.size, num_tokens_padded)
    return prepare_sharded(state, config, int(num_tokens_padded), mesh)


def validate_ranks(state: BatchState, config: PrepConfig, num_ranks: int, num_tokens_padded: int) -> None:
    """`jaxprep.validate` on every rank's rows; a rank with nothing scheduled is an idle (dummy) rank.

    Raises `InvalidBatchError` naming the rank, or if every rank is idle.
    """
    scheduled = np.asarray(state.num_scheduled_tokens).reshape(num_ranks, -1)
    idle = ~scheduled.any(axis=1)
    if idle.all():
        raise InvalidBatchError("sum(num_scheduled_tokens) is 0 on every rank: a step needs at least 1 token")
    for rank in np.flatnonzero(~idle):
        try:
            validate(rank_slice(state, int(rank), num_ranks), config, num_tokens_padded=num_tokens_padded)
        except InvalidBatchError as error:
            raise InvalidBatchError(f"rank {rank}: {error}") from None


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded", "mesh"))
def prepare_sharded(state: BatchState, config: PrepConfig, num_tokens_padded: int, mesh: Mesh) -> StepInputs:
    """The compiled core of `prepare_data_parallel`: `prepare_body` on each device's rows."""

    def per_rank(rows: BatchState) -> StepInputs:
        step = prepare_body(rows, config, num_tokens_padded)
        return jax.tree.map(lambda leaf: leaf[None], step)  # a leading rank axis, scalars included

    spec = PartitionSpec(DATA_AXIS)
    return jax.shard_map(per_rank, mesh=mesh, in_specs=spec, out_specs=spec)(state)
