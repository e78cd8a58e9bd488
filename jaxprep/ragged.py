"""Index transforms between state rows, batch rows and flattened tokens, on static shapes."""

from __future__ import annotations

import jax.numpy as jnp
from jaxprep._typing import Array, Bool, Int32

from jaxprep._constants import PAD_SLOT_ID


def condense_rows(num_scheduled_tokens: Int32[Array, "max_num_reqs"],
                  num_reqs_padded: int) -> Int32[Array, "num_reqs_padded"]:
    """State row of each batch row: the rows with work, in row order.

    Padding rows get ``max_num_reqs``, an out-of-range sentinel for gathers with mode='fill'.
    # num_scheduled [0, 3, 0, 2, 5], num_reqs_padded 4 -> [1, 3, 4, 5]
    """
    has_work = num_scheduled_tokens > 0
    sentinel = num_scheduled_tokens.shape[0]
    (rows,) = jnp.nonzero(has_work, size=num_reqs_padded, fill_value=sentinel)
    return rows.astype(jnp.int32)


def take_rows(table: Array, rows: Int32[Array, "n"], fill_value: int) -> Array:
    """``table[rows]`` along axis 0, with ``fill_value`` for out-of-range (sentinel) rows."""
    return jnp.take(table, rows, axis=0, mode="fill", fill_value=fill_value)


def token_request_index(query_start_loc: Int32[Array, "num_reqs_padded_plus_1"],
                        num_tokens_padded: int) -> Int32[Array, "num_tokens_padded"]:
    """Batch row of every token: ``r`` with ``qsl[r] <= t < qsl[r+1]``, clipped to the last row.

    Counts, for each token, the request ends at or before it (a scatter and a cumsum, O(T + R)).
    # qsl [0, 2, 7, 10, 10], 12 tokens -> [0,0,1,1,1,1,1,2,2,2,3,3]
    """
    num_reqs_padded = query_start_loc.shape[0] - 1
    ends = query_start_loc[1:]
    ends_per_token = jnp.zeros((num_tokens_padded,), jnp.int32).at[ends].add(1, mode="drop")
    request = jnp.cumsum(ends_per_token, dtype=jnp.int32)
    return jnp.minimum(request, num_reqs_padded - 1)


def token_mask(num_actual_tokens: Int32[Array, ""], num_tokens_padded: int) -> Bool[Array, "num_tokens_padded"]:
    """True for the scheduled tokens, False for the padded tail."""
    return jnp.arange(num_tokens_padded, dtype=jnp.int32) < num_actual_tokens


def slot_mapping(block_table, token_rows, positions, is_real_token, block_size: int):
    """``block_table[row, pos // B] * B + pos % B`` per token; padded tokens get PAD_SLOT_ID.

    # B=2, row [1, 2], positions [0, 1, 2] -> blocks [1, 1, 2] -> slots [2, 3, 4]
    """
    block_numbers = block_table[token_rows, positions // block_size]
    slots = block_numbers * block_size + positions % block_size
    return jnp.where(is_real_token, slots, PAD_SLOT_ID)
