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
from jaxprep.config import PrepConfig
from jaxprep.feature_step import StepLayout, with_features
from jaxprep.masks import compressed_causal_mask
from jaxprep.metadata import AttentionMetadata, StepInputs
from jaxprep.ragged import condense_rows, prefix_sum, take_rows, token_mask, token_request_index
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


def prepare_step(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """The traced body of `prepare_padded` (no jit of its own), for callers that fuse it further."""
    num_reqs_padded = config.num_reqs_padded(num_tokens_padded)
    max_num_reqs = state.num_scheduled_tokens.shape[0]
    # num_scheduled [0,3,0,2] -> rows [1,3,pad..], scheduled [3,2,0..], computed [C1,C3,0..]
    if config.features.reorder:  # decodes first (SPEC §2.15) instead of state-row order
        rows = reordered_rows(state, num_reqs_padded, config.features)
    else:
        rows = condense_rows(state.num_scheduled_tokens, num_reqs_padded)
    per_row = jnp.stack([state.num_scheduled_tokens, state.num_computed_tokens], axis=1)
    scheduled, computed = take_rows(per_row, rows, fill_value=0).T
    # scheduled [3,2,0,0] -> ends [3,5,5,5] -> query_start_loc [0,3,5,5,5]; the padded tail repeats the total
    ends = prefix_sum(scheduled)
    query_start_loc = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    num_actual_tokens = ends[-1]
    is_real_token = token_mask(num_actual_tokens, num_tokens_padded)
    # ends [3,5] -> token_req [0,0,0,1,1]; position = computed[req] + (t - qsl[req]) = t + shift[req]
    token_req = token_request_index(ends, num_tokens_padded)
    per_req = jnp.stack([computed - query_start_loc[:-1], jnp.minimum(rows, max_num_reqs - 1)], axis=1)
    shift, token_rows = per_req[token_req].T
    positions = jnp.where(is_real_token, jnp.arange(num_tokens_padded, dtype=jnp.int32) + shift, PAD_POSITION)
    token_rows = jnp.where(is_real_token, token_rows, 0)
    # 2-D gathers: no flattened row * max_model_len index that could overflow int32
    input_ids = jnp.where(is_real_token, state.token_ids[token_rows, positions], PAD_INPUT_ID)
    slot_mapping = _slot_mapping(state.block_table, token_rows, positions, is_real_token, config.block_size)
    is_real_req = rows < max_num_reqs
    seq_lens = computed + scheduled  # padded rows: 0 + 0 = PAD_SEQ_LEN
    attn_metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
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
        logits_indices=jnp.where(is_real_req, ends - 1, PAD_LOGITS_INDEX),
        idx_mapping=jnp.where(is_real_req, rows, PAD_STATE_ROW),
        attn_metadata=attn_metadata,
        num_tokens_padded=num_tokens_padded,
    )
    if not config.features.any_on:
        return step
    layout = StepLayout(rows=rows, scheduled=scheduled, computed=computed, is_real_req=is_real_req,
                        token_rows=token_rows, is_real_token=is_real_token)
    return with_features(step, state, config, layout)


prepare_padded = jax.jit(prepare_step, static_argnames=("config", "num_tokens_padded"))
prepare_padded.__doc__ = """The compiled core of `prepare_inputs`: one executable per (config, num_tokens_padded)."""

