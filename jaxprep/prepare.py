"""`prepare_inputs`: one jitted function from a `BatchState` to padded `StepInputs`.

Semantics follow vLLM V1 ``_prepare_inputs`` (SPEC §2.1-§2.7) over the condensed batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import (NULL_BLOCK_ID, PAD_INPUT_ID, PAD_LOGITS_INDEX, PAD_POSITION,
                                PAD_STATE_ROW)
from jaxprep._expect import expect_bucket, expect_state_and_config
from jaxprep.config import PrepConfig
from jaxprep.feature_step import StepLayout, with_features
from jaxprep.masks import compressed_causal_mask
from jaxprep.metadata import AttentionMetadata, StepInputs
from jaxprep.layout import batch_layout
from jaxprep._typing import Array, Int32
from jaxprep.ragged import stack, take_rows, token_blocks, token_mask
from jaxprep.ragged import slot_mapping as _slot_mapping
from jaxprep.state import BatchState
from jaxprep.step_errors import check_static, error_word, raise_for_errors
from jaxprep.validate import validate


def prepare_inputs(state: BatchState, config: PrepConfig, num_tokens_padded: int | None = None, *,
                   check: bool = False) -> StepInputs:
    """Prepares one step's model inputs and attention metadata.

    Args:
      state: the batch tables; rows with ``num_scheduled_tokens > 0`` form the batch.
      config: static configuration (hashable).
      num_tokens_padded: the step's padded token count. ``None`` reads the scheduled total back
        from the device and picks the smallest bucket of ``config.token_buckets`` that holds it;
        a serving loop that knows its total passes ``config.bucket_for(total)`` and stays
        asynchronous (and may call this inside its own ``jax.jit``).
      check: validate the state on the host first (`jaxprep.validate`), and read the step's
        error word after it (`jaxprep.step_errors`); raises `InvalidBatchError` naming the field
        and the bound. Without it nothing is read back: a loop reads ``step.errors`` when it likes.
    """
    expect_state_and_config("prepare_inputs", state, config)
    expect_bucket("prepare_inputs", num_tokens_padded)
    if num_tokens_padded is None:
        total = int(np.asarray(state.num_scheduled_tokens, dtype=np.int64).sum())
        if check:
            validate(state, config)
        num_tokens_padded = config.bucket_for(total) if total > 0 else config.token_buckets[0]
    elif check:
        validate(state, config, num_tokens_padded=num_tokens_padded)
    step = prepare_padded(state, config, int(num_tokens_padded))
    if check:
        raise_for_errors(step, config)
    if config.features.attn_mask == "compressed":  # one constant, not a per-step jit output
        step = dataclasses.replace(step, attn_mask=compressed_causal_mask())
    return step


def prepare_step(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """The traced body of `prepare_padded` (no jit of its own), for callers that fuse it further.

    Raises at trace time (no cost per call) if the state's shapes do not match ``config`` or
    ``num_tokens_padded`` is not a rung of ``config.token_buckets``.
    """
    check_static(state, config, num_tokens_padded)
    num_reqs_padded = config.num_reqs_padded(num_tokens_padded)
    layout = batch_layout(state, num_reqs_padded, num_tokens_padded, config.max_num_batched_tokens, config.features)
    # ends [3,5,5,5] -> query_start_loc [0,3,5,5,5]; the padded tail repeats the total
    query_start_loc = jnp.pad(layout.ends, (1, 0))
    num_actual_tokens = layout.num_actual_tokens
    is_real_token = token_mask(num_actual_tokens, num_tokens_padded)
    # position = t + shift[owner]: shift = computed - first token index of the owning request
    positions = jnp.where(is_real_token, jnp.arange(num_tokens_padded, dtype=jnp.int32) + layout.token_shift,
                          PAD_POSITION)
    token_rows = jnp.where(is_real_token, layout.token_rows, 0)
    # 2-D gathers: no flattened row * max_model_len index that could overflow int32; the clip only
    # matters for bad input on the unchecked path (a position past the table), see jaxprep.step_errors
    read_positions = jnp.clip(positions, 0, config.max_model_len - 1)
    input_ids = jnp.where(is_real_token, state.token_ids[token_rows, read_positions], PAD_INPUT_ID)
    slot_mapping = _slot_mapping(state.block_table, token_rows, positions, is_real_token, config.block_size,
                                 config.max_block_id)
    blocks = token_blocks(state.block_table, token_rows, positions,
                          config.block_size * config.features.dcp_world_size)
    seq_lens = layout.computed + layout.scheduled  # padded rows: 0 + 0 = PAD_SEQ_LEN
    maxima = _maxima(state)
    attn_metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        slot_mapping=slot_mapping,
        block_table=take_rows(state.block_table, layout.rows, fill_value=NULL_BLOCK_ID),
        num_actual_tokens=num_actual_tokens,
        num_reqs=layout.num_reqs,
        max_query_len=maxima[0],
        max_seq_len=maxima[1],
    )
    step = StepInputs(
        input_ids=input_ids,
        positions=positions,
        logits_indices=jnp.where(layout.is_real_req, layout.ends - 1, PAD_LOGITS_INDEX),
        idx_mapping=jnp.where(layout.is_real_req, layout.rows, PAD_STATE_ROW),
        attn_metadata=attn_metadata,
        errors=error_word(state, config, num_tokens_padded, blocks, is_real_token),
        num_tokens_padded=num_tokens_padded,
    )
    if not config.features.any_on:
        return step
    features_layout = StepLayout(rows=layout.rows, scheduled=layout.scheduled, computed=layout.computed,
                                 is_real_req=layout.is_real_req, token_rows=token_rows, is_real_token=is_real_token)
    return with_features(step, state, config, features_layout)


def _maxima(state: BatchState) -> Int32[Array, "2"]:
    """[max_query_len, max_seq_len] over the rows with work, read from the state rows directly.

    Equal to the maxima over the batch rows (every row with work is in the batch), but ready as
    soon as the step starts: on XLA:CPU fewer kernels then wait on the batch gather together, and
    more than 8 ready at once would hand work to the thread pool (10-80 us on a small host).
    """
    scheduled = state.num_scheduled_tokens
    seq_lens = jnp.where(scheduled > 0, state.num_computed_tokens + scheduled, 0)
    return jnp.max(stack([scheduled, seq_lens]), axis=1)  # one reduction for both


prepare_padded = jax.jit(prepare_step, static_argnames=("config", "num_tokens_padded"))
prepare_padded.__doc__ = """The compiled core of `prepare_inputs`: one executable per (config, num_tokens_padded)."""

