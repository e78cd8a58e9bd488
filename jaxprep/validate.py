"""Bad input: host-side checks of a `BatchState` against a `PrepConfig`, and the unchecked path's
trace-time checks and device error word.

vLLM leaves most of these to its scheduler (docs/semantics.md#invalid-inputs); jaxprep rejects them with an error that
names the field, the row and the bound. Validation only reads: nothing is changed on error.

A serving loop calls `prepare_padded` without `jaxprep.validate` (a host read of every table
per step would stall it). Two things still guard it:

- what is static is checked when the step is traced, so it costs nothing per call: the state's
  shapes (and those of every feature input that is on) must match the config, and
  ``num_tokens_padded`` must be a rung of the bucket ladder (an off-ladder size would compile a
  new executable in the middle of a serving loop);
- what is dynamic is folded into ``StepInputs.errors``, a 0-d int32 of bit flags computed
  inside the step, one per bound (docs/guides/errors.md has the table). The loop reads it
  whenever it likes (one small transfer, no sync in the step), and `raise_for_errors` turns a
  nonzero word into `InvalidBatchError` naming the bound.

Whatever the input, every read of the step stays inside its array, and the step is safe to run
before ``errors`` is read: a flagged row leaves the batch (`flag_rows`), a token whose block id
is bad gets ``PAD_SLOT_ID`` (it writes no KV), and block ids outside the cache are nulled in the
block tables handed to the kernel (`safe_block_table`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep import features
from jaxprep._constants import NULL_BLOCK_ID
from jaxprep.bounds import (
    BLOCK_ID_OUT_OF_RANGE,
    CONFIG_HINT,
    NEGATIVE_COUNT,
    NULL_BLOCK,
    OVER_BUCKET,
    PAST_MAX_MODEL_LEN,
    STATE_HINT,
    InvalidBatchError,
    check_blocks,
    check_row_bound,
    core_row_flags,
    expect,
    expect_bucket,
)
from jaxprep.config import PrepConfig
from jaxprep.features import registry
from jaxprep.state import OPTIONAL_FIELDS, BatchState

CORE_FIELDS = ("token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens")


def expect_state_and_config(function: str, state, config) -> None:
    """``state`` a `BatchState` (jit tracers inside one are fine) and ``config`` a `PrepConfig`."""
    expect(function, "state", state, BatchState, "a jaxprep.BatchState", STATE_HINT)
    expect(function, "config", config, PrepConfig, "a jaxprep.PrepConfig", CONFIG_HINT)


def validate(state, config: PrepConfig, *, num_tokens_padded: int | None = None) -> None:
    """Raises `InvalidBatchError` if ``state`` cannot be prepared under ``config``.

    Checks shapes and dtypes; non-negative counts; a scheduled total in
    ``[1, max_num_batched_tokens]`` (and ``<= num_tokens_padded`` if given);
    ``num_computed + num_scheduled <= max_model_len``; ``num_tokens_padded`` (if given) a rung of
    ``config.token_buckets``; as many rows as ``config.max_num_reqs``; every scheduled token's block allocated
    (not the null block 0); every block id a request uses in ``[1, config.max_block_id]``; and the
    inputs of every feature ``config.features`` turns on (`jaxprep.features.inputs`).
    """
    expect_state_and_config("validate", state, config)
    expect_bucket("validate", num_tokens_padded)
    if num_tokens_padded is not None:
        check_bucket(config, num_tokens_padded)
    check_row_count(state, config)
    fields = state.to_numpy()
    host = {name: fields[name] for name in CORE_FIELDS}
    optional = {name: fields[name] for name in OPTIONAL_FIELDS if name in fields}
    _check_shapes(host, config)
    features.check_feature_shapes(optional, config)
    computed = host["num_computed_tokens"].astype(np.int64)
    scheduled = host["num_scheduled_tokens"].astype(np.int64)
    _check_non_negative("num_computed_tokens", computed)
    _check_non_negative("num_scheduled_tokens", scheduled)
    features.check_feature_values(optional, host, config)
    _check_total(int(scheduled.sum()), config, num_tokens_padded)
    seq_lens = computed + scheduled
    check_row_bound(seq_lens > config.max_model_len, "num_computed_tokens + num_scheduled_tokens",
                    seq_lens, f"max_model_len={config.max_model_len}")
    check_blocks(host["block_table"], computed, scheduled, config.block_size, config.max_block_id,
                 dcp_world=config.features.dcp_world_size)
    features.check_group_blocks(optional, computed, scheduled, config)


def _check_shapes(host: dict[str, np.ndarray], config: PrepConfig) -> None:
    rows = config.max_num_reqs
    expected = {
        "token_ids": (rows, config.max_model_len),
        "num_computed_tokens": (rows,),
        "num_scheduled_tokens": (rows,),
    }
    for name, shape in expected.items():
        if host[name].shape != shape:
            raise InvalidBatchError(f"BatchState.{name} has shape {host[name].shape}, config expects {shape}")
    table = host["block_table"]
    if table.ndim != 2 or table.shape[0] != rows or table.shape[1] < config.min_blocks_per_req:
        raise InvalidBatchError(
            f"BatchState.block_table has shape {table.shape}, config expects ({rows}, W) with "
            f"W >= cdiv(max_model_len, block_size) = {config.min_blocks_per_req}")
    for name, array in host.items():
        if array.dtype != np.int32:
            raise InvalidBatchError(f"BatchState.{name} has dtype {array.dtype}, expected int32")


def _check_non_negative(name: str, values: np.ndarray) -> None:
    check_row_bound(values < 0, name, values, "0 (counts are non-negative)", relation="is below")


def _check_total(total: int, config: PrepConfig, num_tokens_padded: int | None) -> None:
    if total <= 0:
        raise InvalidBatchError("sum(num_scheduled_tokens) is 0: a step needs at least 1 scheduled token")
    if total > config.max_num_batched_tokens:
        raise InvalidBatchError(f"sum(num_scheduled_tokens)={total} exceeds "
                                f"max_num_batched_tokens={config.max_num_batched_tokens}")
    if num_tokens_padded is not None and total > num_tokens_padded:
        raise InvalidBatchError(f"sum(num_scheduled_tokens)={total} exceeds num_tokens_padded={num_tokens_padded}")


# --- the unchecked path: trace-time checks and the device error word ------------------------------

# the core bits (0..4) are jaxprep.bounds', the feature bits (5..26) jaxprep.features.flags'; bits 27..30 are free


def error_messages(config, num_tokens_padded: int) -> dict[int, str]:
    """What each flag of the error word means, with the bound it names (docs/guides/errors.md)."""
    return {
        NEGATIVE_COUNT: "num_computed_tokens or num_scheduled_tokens is negative (counts are >= 0)",
        PAST_MAX_MODEL_LEN: f"num_computed_tokens + num_scheduled_tokens exceeds max_model_len={config.max_model_len}",
        BLOCK_ID_OUT_OF_RANGE: (f"block_table holds a block id outside [{NULL_BLOCK_ID}, "
                                f"max_block_id={config.max_block_id}] in a column a request uses"),
        NULL_BLOCK: f"a scheduled token's block is the null block {NULL_BLOCK_ID} (allocate its blocks first)",
        OVER_BUCKET: f"sum(num_scheduled_tokens) exceeds num_tokens_padded={num_tokens_padded}",
        **registry.messages(config),
    }


def check_bucket(config, num_tokens_padded: int) -> None:
    """``num_tokens_padded`` must be a rung of the bucket ladder (which ends at the token budget)."""
    if num_tokens_padded not in config.token_buckets:
        raise InvalidBatchError(f"num_tokens_padded={num_tokens_padded} is not a rung of PrepConfig.token_buckets "
                                f"{config.token_buckets} (max_num_batched_tokens={config.max_num_batched_tokens}): "
                                f"use config.bucket_for(total)")


def check_row_count(state, config) -> None:
    """The state's rows (its ``num_scheduled_tokens`` entries) must be ``config.max_num_reqs``."""
    rows = tuple(state.num_scheduled_tokens.shape)
    if rows != (config.max_num_reqs,):
        raise InvalidBatchError(f"row-count mismatch: BatchState has {rows[0] if len(rows) == 1 else rows} rows "
                                f"(num_scheduled_tokens has shape {rows}), config expects "
                                f"max_num_reqs={config.max_num_reqs}")


def check_static(state, config, num_tokens_padded: int) -> None:
    """Trace-time checks (free per call): the bucket on the ladder, state shapes against the config,
    every input a feature that is on needs present with its shape and dtype."""
    check_bucket(config, num_tokens_padded)
    check_row_count(state, config)
    rows = config.max_num_reqs
    expected = {"token_ids": (rows, config.max_model_len), "num_computed_tokens": (rows,),
                "num_scheduled_tokens": (rows,)}
    for name, shape in expected.items():
        if tuple(getattr(state, name).shape) != shape:
            raise InvalidBatchError(f"BatchState.{name} has shape {tuple(getattr(state, name).shape)}, "
                                    f"config expects {shape}")
    table = tuple(state.block_table.shape)
    if len(table) != 2 or table[0] != rows or table[1] < config.min_blocks_per_req:
        raise InvalidBatchError(f"BatchState.block_table has shape {table}, config expects ({rows}, W) with "
                                f"W >= cdiv(max_model_len, block_size) = {config.min_blocks_per_req}")
    features.check_traced_shapes(state, config)


def flag_rows(state, config, num_tokens_padded: int):
    """``(state without its flagged rows' work, the row-level part of the error word)``.

    Every row-level bound (the core counts of `jaxprep.bounds`, the bucket, the feature inputs of
    `jaxprep.features.registry`) gives a mask over the state rows; one reduction of their stack gives
    the bits, another the rows to drop. A dropped row schedules nothing, so it leaves the batch and
    every output of the step stays in range. Over the bucket every row is dropped: the step is empty.

    ```
    # computed [3, -1], scheduled [2, 1] -> NEGATIVE_COUNT, scheduled [2, 0]
    ```
    """
    computed, scheduled = state.num_computed_tokens, state.num_scheduled_tokens
    flags = [*core_row_flags(computed, scheduled, config.max_model_len), *registry.row_flags(state, config)]
    row_bits = functools.reduce(operator.or_, [jnp.where(mask, jnp.int32(bit), 0) for bit, mask in flags])
    # one reduction for the or of the rows' bits and the total of the counts clipped to [0, T + 1],
    # which exceeds T exactly when the true total does (no int32 wrap)
    bits, clipped_total = jax.lax.reduce(
        (row_bits, jnp.clip(scheduled, 0, num_tokens_padded + 1)), (np.int32(0), np.int32(0)),
        lambda a, b: (a[0] | b[0], a[1] + b[1]), (0,))
    over_bucket = clipped_total > num_tokens_padded
    word = bits | jnp.where(over_bucket, jnp.int32(OVER_BUCKET), 0)
    for bit, flag in registry.state_flags(state, config):
        word = word | jnp.where(flag, jnp.int32(bit), jnp.int32(0))
    kept = dataclasses.replace(state, num_scheduled_tokens=jnp.where((row_bits != 0) | over_bucket, 0, scheduled))
    return kept, word


def describe_errors(word, config, num_tokens_padded: int) -> list[str]:
    """The messages of the flags set in ``word`` (an int or a 0-d array), lowest bit first."""
    word = int(np.asarray(word))
    return [message for bit, message in error_messages(config, num_tokens_padded).items() if word & bit]


def raise_for_errors(step, config) -> None:
    """Raises `InvalidBatchError` naming every bound the step's input broke (reads ``step.errors``)."""
    problems = describe_errors(step.errors, config, step.num_tokens_padded)
    if problems:
        raise InvalidBatchError(f"step.errors={int(np.asarray(step.errors))}: " + "; ".join(problems))
