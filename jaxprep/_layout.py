"""Where every batch row and every token of a step comes from: the index part of `prepare_body`,
and what the optional features read of it.

Two layouts give the same answer. Without `FeatureConfig.batch_order` the batch is the rows with
work in state-row order, so token ranges follow state rows: one scan over the state rows gives
both each row's batch position and its token end, and tokens map straight to state rows. With a
reorder the batch order is computed first and tokens map to batch rows, then to state rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jaxprep._ragged import prefix_sum, stack, take_rows, token_mask, token_request_index
from jaxprep._typing import Array, Bool, Int32


class Layout(NamedTuple):
    """Batch rows and tokens of one step: what `prepare_body` and the features index with."""

    rows: Int32[Array, " num_reqs_padded"]  # state row of each batch row; pad: max_num_reqs
    scheduled: Int32[Array, " num_reqs_padded"]  # pad: 0
    computed: Int32[Array, " num_reqs_padded"]  # pad: 0
    ends: Int32[Array, " num_reqs_padded"]  # query_start_loc[1:]; pad: num_actual_tokens
    is_real_req: Bool[Array, " num_reqs_padded"]
    num_reqs: Int32[Array, ""]  # rows in the batch
    num_actual_tokens: Int32[Array, ""]  # scheduled tokens
    token_rows: Int32[Array, " num_tokens_padded"]  # state row of each token; pad: 0
    token_shift: Int32[Array, " num_tokens_padded"]  # position - token index, per token (tail: any)
    is_real_token: Bool[Array, " num_tokens_padded"]  # False for the padded tail
    row_seq_lens: Int32[Array, " max_num_reqs"]  # per state row: computed + scheduled if in the batch, else 0


def batch_layout(state, num_reqs_padded: int, num_tokens_padded: int, max_total: int,
                 order: Int32[Array, " num_reqs_padded"] | None = None) -> Layout:
    """The step's `Layout`; ``max_total`` bounds the scheduled tokens (the token budget).

    ``order``: the state row of each batch row when the batch is reordered
    (`jaxprep.features.reorder.reordered_rows`, padding rows ``max_num_reqs``); None: state-row order.
    """
    if order is not None:
        return _reordered_layout(state, order, num_tokens_padded, max_total)
    return _state_order_layout(state, num_reqs_padded, num_tokens_padded, max_total)


def state_seq_lens(state) -> Int32[Array, " max_num_reqs"]:
    """Each state row's sequence length if it has work (it is then in the batch), else 0.

    ```
    # computed [4, 9, 7], scheduled [2, 0, 1] -> [6, 0, 8]
    ```
    """
    scheduled = state.num_scheduled_tokens
    return jnp.where(scheduled > 0, state.num_computed_tokens + scheduled, 0)


def _layout(state, *, token_rows, num_actual_tokens, num_tokens_padded: int, **batch_rows) -> Layout:
    """A `Layout` whose padded tokens read state row 0 (``token_rows`` may hold any row past the end)."""
    is_real_token = token_mask(num_actual_tokens, num_tokens_padded)
    return Layout(token_rows=jnp.where(is_real_token, token_rows, 0), is_real_token=is_real_token,
                  num_actual_tokens=num_actual_tokens, row_seq_lens=state_seq_lens(state), **batch_rows)


def _state_order_layout(state, num_reqs_padded: int, num_tokens_padded: int, max_total: int) -> Layout:
    """Batch rows in state-row order: tokens of state row r lie in [ends_state[r] - S[r], ends_state[r]).

    ```
    # S [0, 3, 0, 2] -> has_work [0,1,0,1] -> counts [0,1,1,2], ends_state [0,3,3,5]
    #   batch_row [-,0,-,1] -> rows [1, 3]; token owners [1,1,1,3,3]; shift[r] = C[r] - (ends_state[r] - S[r])
    ```
    """
    scheduled, computed = state.num_scheduled_tokens, state.num_computed_tokens
    max_num_reqs = scheduled.shape[0]
    has_work = scheduled > 0
    counts, ends_state = prefix_sum(stack([has_work.astype(jnp.int32), scheduled]),
                                    max(max_total, max_num_reqs))
    # rows without work (and, on bad input, rows past the bucket) write the spare last entry
    batch_row = jnp.where(has_work, jnp.minimum(counts - 1, num_reqs_padded), num_reqs_padded)
    rows = jnp.full((num_reqs_padded + 1,), max_num_reqs, jnp.int32)
    rows = rows.at[batch_row].set(jnp.arange(max_num_reqs, dtype=jnp.int32), mode="promise_in_bounds")
    rows = rows[:num_reqs_padded]
    is_real_req = rows < max_num_reqs
    per_row = stack([scheduled, computed, ends_state], axis=1)
    batch_rows = take_rows(per_row, rows, fill_value=0)
    batch_scheduled, batch_computed, ends = batch_rows[:, 0], batch_rows[:, 1], batch_rows[:, 2]
    ends = jnp.where(is_real_req, ends, ends_state[-1])
    # a token's owner counts the state-row ends at or before it; rows without work end where the last one did
    token_rows = token_request_index(ends_state, num_tokens_padded)
    token_shift = (computed - (ends_state - scheduled))[token_rows]
    return _layout(state, rows=rows, scheduled=batch_scheduled, computed=batch_computed, ends=ends,
                   is_real_req=is_real_req, num_reqs=jnp.minimum(counts[-1], num_reqs_padded),
                   num_actual_tokens=ends_state[-1],
                   token_rows=token_rows, token_shift=token_shift, num_tokens_padded=num_tokens_padded)


def _reordered_layout(state, rows, num_tokens_padded: int, max_total: int) -> Layout:
    """Batch rows in the given order; tokens map to batch rows, then to state rows.

    ```
    # rows [4, 1] (S[4] = 1, S[1] = 3) -> ends [1, 4] -> token batch rows [0,1,1,1] -> state rows [4,1,1,1]
    ```
    """
    max_num_reqs = state.num_scheduled_tokens.shape[0]
    per_row = stack([state.num_scheduled_tokens, state.num_computed_tokens], axis=1)
    batch_rows = take_rows(per_row, rows, fill_value=0)
    scheduled, computed = batch_rows[:, 0], batch_rows[:, 1]
    ends = prefix_sum(scheduled, max_total)
    is_real_req = rows < max_num_reqs
    owners = stack([computed - (ends - scheduled), jnp.minimum(rows, max_num_reqs - 1)], axis=1)
    token_owners = owners[token_request_index(ends, num_tokens_padded)]
    token_shift, token_rows = token_owners[:, 0], token_owners[:, 1]
    return _layout(state, rows=rows, scheduled=scheduled, computed=computed, ends=ends, is_real_req=is_real_req,
                   num_reqs=jnp.sum(is_real_req, dtype=jnp.int32), num_actual_tokens=ends[-1],
                   token_rows=token_rows, token_shift=token_shift, num_tokens_padded=num_tokens_padded)
