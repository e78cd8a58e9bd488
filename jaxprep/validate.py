"""Bad input: host-side checks of a `BatchState` against a `PrepConfig`, and the unchecked path's
trace-time checks and device error word.

vLLM leaves most of these to its scheduler (docs/semantics.md#invalid-inputs); jaxprep rejects them with an error that
names the field, the row and the bound. Validation only reads: nothing is changed on error.

A serving loop calls `prepare_padded` without `jaxprep.validate` (a host read of every table
per step would stall it). Two things still guard it:

- what is static is checked when the step is traced, so it costs nothing per call: the state's
  shapes must match the config, and ``num_tokens_padded`` must be a rung of the bucket ladder
  (an off-ladder size would compile a new executable in the middle of a serving loop);
- what is dynamic is folded into ``StepInputs.errors``, a 0-d int32 of bit flags computed
  inside the step. The loop reads it whenever it likes (one small transfer, no sync in the
  step), and `raise_for_errors` turns a nonzero word into `InvalidBatchError` naming the bound.

Whatever the input, every read of the step stays inside its array, and a token whose block id
is bad gets ``PAD_SLOT_ID``, so a consumer writes no KV for it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxprep import features
from jaxprep._checks import InvalidBatchError, check_blocks, check_row_bound, expect_bucket, expect_state_and_config
from jaxprep._constants import NULL_BLOCK_ID
from jaxprep._typing import Array, Bool, Int32
from jaxprep.config import PrepConfig
from jaxprep.state import OPTIONAL_FIELDS

CORE_FIELDS = ("token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens")


def validate(state, config: PrepConfig, *, num_tokens_padded: int | None = None) -> None:
    """Raises `InvalidBatchError` if ``state`` cannot be prepared under ``config``.

    Checks shapes and dtypes; non-negative counts; a scheduled total in
    ``[1, max_num_batched_tokens]`` (and ``<= num_tokens_padded`` if given);
    ``num_computed + num_scheduled <= max_model_len``; every scheduled token's block allocated
    (not the null block 0); every block id a request uses in ``[1, config.max_block_id]``; and the
    inputs of every feature ``config.features`` turns on (`jaxprep.features.inputs`).
    """
    expect_state_and_config("validate", state, config)
    expect_bucket("validate", num_tokens_padded)
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

NEGATIVE_COUNT = 1 << 0
PAST_MAX_MODEL_LEN = 1 << 1
BLOCK_ID_OUT_OF_RANGE = 1 << 2
NULL_BLOCK = 1 << 3
OVER_BUCKET = 1 << 4


def error_messages(config, num_tokens_padded: int) -> dict[int, str]:
    """What each flag of the error word means, with the bound it names."""
    return {
        NEGATIVE_COUNT: "num_computed_tokens or num_scheduled_tokens is negative (counts are >= 0)",
        PAST_MAX_MODEL_LEN: f"num_computed_tokens + num_scheduled_tokens exceeds max_model_len={config.max_model_len}",
        BLOCK_ID_OUT_OF_RANGE: (f"block_table holds a block id outside [{NULL_BLOCK_ID}, "
                                f"max_block_id={config.max_block_id}] for a scheduled token"),
        NULL_BLOCK: f"a scheduled token's block is the null block {NULL_BLOCK_ID} (allocate its blocks first)",
        OVER_BUCKET: f"sum(num_scheduled_tokens) exceeds num_tokens_padded={num_tokens_padded}",
    }


def check_static(state, config, num_tokens_padded: int) -> None:
    """Trace-time checks (free per call): state shapes against the config, the bucket on the ladder."""
    if num_tokens_padded not in config.token_buckets:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is not a rung of PrepConfig.token_buckets "
                         f"{config.token_buckets}: use config.bucket_for(total)")
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


def error_word(state, config, num_tokens_padded: int, blocks: Int32[Array, " num_tokens_padded"],
               is_real_token: Bool[Array, " num_tokens_padded"]) -> Int32[Array, ""]:
    """The step's error flags (0: none). ``blocks``: each token's block id in the step's block table.

    # computed [3, -1], scheduled [2, 1] -> NEGATIVE_COUNT;  computed [10], scheduled [7], M 16 -> PAST_MAX_MODEL_LEN
    """
    computed, scheduled = state.num_computed_tokens, state.num_scheduled_tokens
    # the total of counts clipped to [0, T + 1] exceeds T exactly when the true total does (no int32 wrap)
    clipped_total = jnp.sum(jnp.clip(scheduled, 0, num_tokens_padded + 1))
    flags = [
        (NEGATIVE_COUNT, jnp.any((computed < 0) | (scheduled < 0))),
        # scheduled > M - computed: no overflow for computed >= 0 (a negative one is flagged above)
        (PAST_MAX_MODEL_LEN, jnp.any(scheduled > config.max_model_len - computed)),
        (BLOCK_ID_OUT_OF_RANGE, jnp.any(is_real_token & ((blocks < NULL_BLOCK_ID) | (blocks > config.max_block_id)))),
        (NULL_BLOCK, jnp.any(is_real_token & (blocks == NULL_BLOCK_ID))),
        (OVER_BUCKET, clipped_total > num_tokens_padded),
    ]
    word = jnp.int32(0)
    for bit, flag in flags:
        word = word | jnp.where(flag, jnp.int32(bit), jnp.int32(0))
    return word


def describe_errors(word, config, num_tokens_padded: int) -> list[str]:
    """The messages of the flags set in ``word`` (an int or a 0-d array), lowest bit first."""
    word = int(np.asarray(word))
    return [message for bit, message in error_messages(config, num_tokens_padded).items() if word & bit]


def raise_for_errors(step, config) -> None:
    """Raises `InvalidBatchError` naming every bound the step's input broke (reads ``step.errors``)."""
    problems = describe_errors(step.errors, config, step.num_tokens_padded)
    if problems:
        raise InvalidBatchError(f"step.errors={int(np.asarray(step.errors))}: " + "; ".join(problems))
