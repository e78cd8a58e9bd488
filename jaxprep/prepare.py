"""`prepare_inputs`: one jitted function from a `BatchState` to padded `StepInputs`.

Semantics follow vLLM V1 ``_prepare_inputs`` (SPEC §2.1-§2.7) over the condensed batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import (NULL_BLOCK_ID, PAD_INPUT_ID, PAD_LOGITS_INDEX, PAD_POSITION,
                                PAD_SEQ_LEN, PAD_STATE_ROW)
from jaxprep.config import PrepConfig
from jaxprep.metadata import AttentionMetadata, StepInputs
from jaxprep.feature_step import StepLayout, with_features
from jaxprep.masks import compressed_causal_mask
from jaxprep.ragged import condense_rows, take_rows, token_mask, token_request_index
from jaxprep.ragged import slot_mapping as _slot_mapping
from jaxprep.reorder import reordered_rows
from jaxprep.state import BatchState
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
      check: validate the state on the host first (`jaxprep.validate`); raises
        `InvalidBatchError` naming the field and the bound.
    """
    if num_tokens_padded is None:
        total = int(np.asarray(state.num_scheduled_tokens, dtype=np.int64).sum())
        if check:
            validate(state, config)
        num_tokens_padded = config.bucket_for(total) if total > 0 else config.token_buckets[0]
    elif check:
        validate(state, config, num_tokens_padded=num_tokens_padded)
    step = prepare_padded(state, config, int(num_tokens_padded))
    if config.features.attn_mask == "compressed":  # one constant, not a per-step jit output
        step = dataclasses.replace(step, attn_mask=compressed_causal_mask())
    return step


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"))
def prepare_padded(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """The compiled core of `prepare_inputs`: one executable per (config, num_tokens_padded)."""
    num_reqs_padded = config.num_reqs_padded(num_tokens_padded)
    # num_scheduled [0,3,0,2] -> rows [1,3,pad..], scheduled [3,2,0..], computed [C1,C3,0..]
    if config.features.reorder:  # decodes first (SPEC §2.15) instead of state-row order
        rows = reordered_rows(state, num_reqs_padded, config.features)
    else:
        rows = condense_rows(state.num_scheduled_tokens, num_reqs_padded)
    scheduled = take_rows(state.num_scheduled_tokens, rows, fill_value=0)
    computed = take_rows(state.num_computed_tokens, rows, fill_value=0)
    # scheduled [3,2,0,0] -> query_start_loc [0,3,5,5,5]; the padded tail repeats the total
    query_start_loc = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(scheduled, dtype=jnp.int32)])
    num_actual_tokens = query_start_loc[-1]
    is_real_token = token_mask(num_actual_tokens, num_tokens_padded)
    # qsl [0,3,5] -> token_req [0,0,0,1,1], offsets [0,1,2,0,1], positions = computed[token_req] + offset
    token_req = token_request_index(query_start_loc, num_tokens_padded)
    offsets = jnp.arange(num_tokens_padded, dtype=jnp.int32) - query_start_loc[token_req]
    positions = jnp.where(is_real_token, computed[token_req] + offsets, PAD_POSITION)
    token_rows = jnp.where(is_real_token, rows[token_req], 0)
    # 2-D gathers: no flattened row * max_model_len index that could overflow int32
    input_ids = jnp.where(is_real_token, state.token_ids[token_rows, positions], PAD_INPUT_ID)
    slot_mapping = _slot_mapping(state.block_table, token_rows, positions, is_real_token, config.block_size)
    seq_lens = computed + scheduled  # padded rows: 0 + 0 = PAD_SEQ_LEN
    is_real_req = rows < state.num_scheduled_tokens.shape[0]
    attn_metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=jnp.where(is_real_req, seq_lens, PAD_SEQ_LEN),
        slot_mapping=slot_mapping,
        block_table=take_rows(state.block_table, rows, fill_value=NULL_BLOCK_ID),
        num_actual_tokens=num_actual_tokens,
        num_reqs=jnp.sum(is_real_req, dtype=jnp.int32),
        max_query_len=jnp.max(scheduled),
        max_seq_len=jnp.max(seq_lens),
    )
    step = StepInputs(
        input_ids=input_ids,
        positions=positions,
        logits_indices=jnp.where(is_real_req, query_start_loc[1:] - 1, PAD_LOGITS_INDEX),
        idx_mapping=jnp.where(is_real_req, rows, PAD_STATE_ROW),
        attn_metadata=attn_metadata,
        num_tokens_padded=num_tokens_padded,
    )
    if not config.features.any_on:
        return step
    layout = StepLayout(rows=rows, scheduled=scheduled, computed=computed, is_real_req=is_real_req,
                        token_rows=token_rows, is_real_token=is_real_token)
    return with_features(step, state, config, layout)
