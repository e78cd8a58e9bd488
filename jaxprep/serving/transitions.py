"""Device transitions ``ServingState -> ServingState``: each ``*_body`` is the pure traced
transition, the plain name its jitted form that donates the state.

Each transition is a handful of scatters with ``mode='drop'``. Padded payload rows (-1) are first
mapped to the out-of-range sentinel ``max_num_reqs``: JAX wraps a -1 index to the last row even
with ``mode='drop'`` (docs/semantics.md#jax-traps), so -1 must never reach a scatter.

These functions do not check their payloads; `jaxprep.serving.ServingBatch` checks them on the host
before dispatch, so a bad update raises before any buffer is donated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep.serving.sampling_rows import admit, count_sampled
from jaxprep.serving.state import AddRequests, AppendBlocks, FinishRequests, Schedule, ServingState, StepUpdates


def row_index(rows: jax.Array, num_rows: int) -> jax.Array:
    """Payload rows as scatter indices: anything outside [0, num_rows) becomes the sentinel num_rows.

    # num_rows 4: rows [2, -1, 0, 7] -> [2, 4, 0, 4]
    """
    rows = jnp.asarray(rows, jnp.int32)
    return jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)


def _set(array: jax.Array, rows: jax.Array, values) -> jax.Array:
    return array.at[rows].set(values, mode="drop")


def _replace_batch(state: ServingState, **fields) -> ServingState:
    return dataclasses.replace(state, batch=dataclasses.replace(state.batch, **fields))


def finish_body(state: ServingState, payload: FinishRequests) -> ServingState:
    """Frees rows: counters to 0 and block-table rows to the null block (token ids are left stale)."""
    rows = row_index(payload.rows, state.num_tokens.shape[0])
    batch = state.batch
    state = _replace_batch(state, block_table=_set(batch.block_table, rows, NULL_BLOCK_ID),
                           num_computed_tokens=_set(batch.num_computed_tokens, rows, 0),
                           num_scheduled_tokens=_set(batch.num_scheduled_tokens, rows, 0))
    return dataclasses.replace(state, num_tokens=_set(state.num_tokens, rows, 0),
                               stop_len=_set(state.stop_len, rows, 0),
                               num_blocks=_set(state.num_blocks, rows, 0),
                               num_draft_tokens=_set(state.num_draft_tokens, rows, 0))


def add_body(state: ServingState, payload: AddRequests) -> ServingState:
    """Writes whole rows: token ids, block ids and counters of new or resumed requests."""
    rows = row_index(payload.rows, state.num_tokens.shape[0])
    batch = state.batch
    state = _replace_batch(state, token_ids=_set(batch.token_ids, rows, payload.token_ids),
                           block_table=_set(batch.block_table, rows, payload.block_ids),
                           num_computed_tokens=_set(batch.num_computed_tokens, rows, payload.num_computed_tokens),
                           num_scheduled_tokens=_set(batch.num_scheduled_tokens, rows, 0))
    if payload.sampling is not None:  # FeatureConfig.sampling: parameters and penalty bins
        state = dataclasses.replace(state, batch=admit(state.batch, rows, payload.sampling, payload.token_ids,
                                                       payload.num_tokens))
    return dataclasses.replace(state, num_tokens=_set(state.num_tokens, rows, payload.num_tokens),
                               stop_len=_set(state.stop_len, rows, payload.stop_len),
                               num_blocks=_set(state.num_blocks, rows, payload.num_blocks),
                               num_draft_tokens=_set(state.num_draft_tokens, rows, 0))


def append_body(state: ServingState, payload: AppendBlocks) -> ServingState:
    """Appends block ids after each row's ``num_blocks`` columns (vLLM ``append_row``).

    An entry's column is the row's block count plus the number of earlier entries for that row.
    # num_blocks [3, 1], rows [1, 0, 1, -1], ids [7, 8, 9, 0] -> columns [1, 3, 2, -]
    #   block_table[1, 1] = 7, block_table[0, 3] = 8, block_table[1, 2] = 9; num_blocks -> [4, 3]
    """
    num_rows = state.num_tokens.shape[0]
    rows = row_index(payload.rows, num_rows)
    entry = jnp.arange(rows.shape[0], dtype=jnp.int32)
    earlier_same_row = (rows[:, None] == rows[None, :]) & (entry[None, :] < entry[:, None])
    rank = jnp.sum(earlier_same_row, axis=1, dtype=jnp.int32)
    columns = jnp.take(state.num_blocks, rows, mode="fill", fill_value=0) + rank
    block_table = state.batch.block_table.at[rows, columns].set(payload.block_ids, mode="drop")
    num_blocks = state.num_blocks.at[rows].add(jnp.ones_like(rows), mode="drop")
    return dataclasses.replace(_replace_batch(state, block_table=block_table), num_blocks=num_blocks)


def schedule_body(state: ServingState, payload: Schedule) -> ServingState:
    """Sets every row's scheduled and draft counts and writes the draft ids after ``num_tokens``.

    # num_tokens [5], num_draft [2], drafts [[41, 42, 0]] -> token_ids[0, 5:7] = [41, 42]
    """
    num_rows, max_model_len = state.batch.token_ids.shape
    num_draft = jnp.asarray(payload.num_draft_tokens, jnp.int32)
    width = payload.draft_token_ids.shape[1]
    token_ids = state.batch.token_ids
    if width:
        offsets = jnp.arange(width, dtype=jnp.int32)[None, :]
        columns = jnp.where(offsets < num_draft[:, None], state.num_tokens[:, None] + offsets, max_model_len)
        rows = jnp.broadcast_to(jnp.arange(num_rows, dtype=jnp.int32)[:, None], columns.shape)
        token_ids = token_ids.at[rows, columns].set(payload.draft_token_ids, mode="drop")
    state = _replace_batch(state, token_ids=token_ids,
                           num_scheduled_tokens=jnp.asarray(payload.num_scheduled_tokens, jnp.int32))
    return dataclasses.replace(state, num_draft_tokens=num_draft)


def apply_updates_body(state: ServingState, updates: StepUpdates) -> ServingState:
    """finish, then add, then append, then schedule."""
    state = finish_body(state, updates.finish)
    state = add_body(state, updates.add)
    state = append_body(state, updates.append)
    return schedule_body(state, updates.schedule)


def record_sampled_body(state: ServingState, idx_mapping: jax.Array, sampled_token_ids: jax.Array,
                   num_sampled: jax.Array) -> ServingState:
    """Post-update of one step (vLLM V2 ``_post_update_kernel``): advances the device counters.

    Per batch row b of state row s = idx_mapping[b] (pad -1 is skipped):
      discarded  = C + S < num_tokens (a prefill chunk short of the known tokens): nothing appended;
      n          = 0 if discarded else num_sampled[b] (accepted drafts + 1);
      C         += S if discarded else S - (D + 1 - n)   (rejected drafts are not computed);
      token_ids[s, num_tokens : num_tokens + n] = sampled_token_ids[b, :n]; num_tokens += n;
      S, D      -> 0.
    # C 4, S 1, D 0, num_tokens 5, sampled [[77]], n 1 -> token_ids[s, 5] = 77, C 5, num_tokens 6
    """
    num_rows, max_model_len = state.batch.token_ids.shape
    rows = row_index(idx_mapping, num_rows)

    def gather(array):
        return jnp.take(array, rows, mode="fill", fill_value=0)

    scheduled, computed = gather(state.batch.num_scheduled_tokens), gather(state.batch.num_computed_tokens)
    num_tokens, num_draft = gather(state.num_tokens), gather(state.num_draft_tokens)
    discarded = computed + scheduled < num_tokens
    num_sampled = jnp.where(discarded, 0, jnp.asarray(num_sampled, jnp.int32))
    advance = jnp.where(discarded, scheduled, scheduled - (num_draft + 1 - num_sampled))
    offsets = jnp.arange(sampled_token_ids.shape[1], dtype=jnp.int32)[None, :]
    columns = jnp.where(offsets < num_sampled[:, None], num_tokens[:, None] + offsets, max_model_len)
    token_ids = state.batch.token_ids.at[rows[:, None], columns].set(sampled_token_ids, mode="drop")
    state = _replace_batch(state, token_ids=token_ids,
                           num_computed_tokens=state.batch.num_computed_tokens.at[rows].add(advance, mode="drop"),
                           num_scheduled_tokens=_set(state.batch.num_scheduled_tokens, rows, 0))
    if state.batch.output_bin_counts is not None:  # FeatureConfig.sampling: every appended token counts
        state = dataclasses.replace(state, batch=count_sampled(state.batch, rows, sampled_token_ids, num_sampled))
    return dataclasses.replace(state, num_tokens=state.num_tokens.at[rows].add(num_sampled, mode="drop"),
                               num_draft_tokens=_set(state.num_draft_tokens, rows, 0))


def _donating(fn):
    """``fn`` jitted with its state argument donated."""
    return functools.wraps(fn)(jax.jit(fn, donate_argnums=0))


finish = _donating(finish_body)
add = _donating(add_body)
append = _donating(append_body)
schedule = _donating(schedule_body)
apply_updates = _donating(apply_updates_body)
record_sampled = _donating(record_sampled_body)
