"""Bad input on the unchecked path: a bound check at trace time, and an error word on the device.

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

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep._typing import Array, Bool, Int32
from jaxprep.validate import InvalidBatchError

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
