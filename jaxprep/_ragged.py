"""Index transforms between state rows, batch rows and flattened tokens, on static shapes, and the
batch layout they give a step (`batch_layout`).

The layout (`Layout`) says where every batch row and every token of a step comes from: the index
part of `jaxprep.prepare.xla_body`, and what the optional features read of it.

Two layouts give the same answer. Without `FeatureConfig.batch_order` the batch is the rows with
work in state-row order, so token ranges follow state rows: one scan over the state rows gives
both each row's batch position and its token end, and tokens map straight to state rows. With a
reorder the batch order is computed first and tokens map to batch rows, then to state rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import NULL_BLOCK_ID, PAD_SLOT_ID
from jaxprep._typing import Array, Bool, Float32, Int32

SCAN_BLOCK = 32
"""Width of the blocks `prefix_sum` scans with one small matrix product each."""

SHORT_SCAN = 256
"""Up to this length a prefix sum is XLA's own cumsum on every backend: one reduce-window (on XLA:CPU a
serial loop, ~7 ns an entry, which XLA:CPU rewrites into 4-5 small kernels above 16 entries), cheaper
than a matrix product there at this size (XLA:CPU's product costs ~2 µs even at n = 8;
docs/benchmarks-history.md, "The XLA step (TPU's path)")."""

F32_EXACT_BOUND = 2**24
"""float32 holds every integer below this exactly, so sums that stay below it are exact."""


def stack(arrays, axis: int = 0) -> Array:
    """``jnp.stack`` of same-shape 1-D arrays built with selects instead of a concatenate.

    XLA:CPU emits a concatenate as one unrolled loop per operand, several times the code (and
    the compile time) of the selects; the result is the same.

    ```
    # stack([a, b], axis=1)[i, j] = (a if j == 0 else b)[i]
    ```
    """
    shape = (len(arrays), arrays[0].shape[0]) if axis == 0 else (arrays[0].shape[0], len(arrays))
    which = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    out = jnp.broadcast_to(jnp.expand_dims(arrays[-1], axis), shape)
    for i in range(len(arrays) - 2, -1, -1):
        out = jnp.where(which == i, jnp.expand_dims(arrays[i], axis), out)
    return out


def _upper_ones(n: int) -> np.ndarray:
    """[n, n] float32, 1 where row <= column: ``x @ U`` is the inclusive prefix sum of ``x``."""
    return np.triu(np.ones((n, n), np.float32))


def _exact_matmul(a: Float32[Array, "m k"], b: np.ndarray) -> Float32[Array, "m n"]:
    """``a @ b`` as a true float32 product (``Precision.HIGHEST``).

    Only `_scan_f32` calls this, and only on XLA:CPU, which always multiplies float32 in float32
    (HIGHEST costs nothing there). Written out anyway, so no lowering of jaxprep holds a float dot
    at DEFAULT precision: on NVIDIA GPUs DEFAULT means TF32 (10 mantissa bits), on TPUs bfloat16
    passes (7 bits), and a count like 3001 would round to 3000.
    """
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _scan_f32(values: Float32[Array, "k n"]) -> Float32[Array, "k n"]:
    """Inclusive prefix sums along the last axis, as blocks of `SCAN_BLOCK` and one product (up to
    `SHORT_SCAN` entries XLA's own cumsum).

    Exact while every partial sum stays below `F32_EXACT_BOUND`: the inputs are integers, ``U``
    holds 0 and 1, and float32 adds integers below 2**24 without rounding, in any order. XLA:CPU
    only (see `on_cpu_else`).
    Each block's sum starts from the carry of the blocks before it, appended as one more column:
    [block | carry] @ [[U], [1 .. 1]] is the block's prefix sum plus its carry.

    ```
    # [1,0,1,1 | 0,1,0,0] in blocks of 4: totals [3, 1] -> carries [0, 3] -> [1,1,2,3 | 3,4,4,4]
    ```
    """
    k, n = values.shape
    if n <= SHORT_SCAN:
        return jnp.cumsum(values, axis=-1)
    num_blocks = -(-n // SCAN_BLOCK)
    blocks = jnp.pad(values, ((0, 0), (0, num_blocks * SCAN_BLOCK - n))).reshape(k, num_blocks, SCAN_BLOCK)
    totals = jnp.sum(blocks, axis=2)
    carries = _scan_f32(totals) - totals
    column = jax.lax.broadcasted_iota(jnp.int32, (k, num_blocks, SCAN_BLOCK + 1), 2)
    augmented = jnp.where(column < SCAN_BLOCK, jnp.pad(blocks, ((0, 0), (0, 0), (0, 1))), carries[:, :, None])
    augmented = augmented.reshape(k * num_blocks, SCAN_BLOCK + 1)
    with_carry = np.concatenate([_upper_ones(SCAN_BLOCK), np.ones((1, SCAN_BLOCK), np.float32)])
    return _exact_matmul(augmented, with_carry).reshape(k, num_blocks * SCAN_BLOCK)[:, :n]


def on_cpu_else(cpu, other, *args):
    """``cpu(*args)`` when the executable runs on XLA:CPU, ``other(*args)`` on every other backend.

    Resolved when lowering (`jax.lax.platform_dependent`): an executable for one platform holds
    one branch only, and an export for several holds both behind a platform switch. The float
    scans are kept for CPU alone, where they are exact and faster than XLA:CPU's serial cumsum
    (measured in docs/benchmarks-history.md, "What limits the missed goals"); GPUs and TPUs get the integer
    scan, exact by construction.
    """
    return jax.lax.platform_dependent(*args, cpu=cpu, default=other)


def _int_prefix_sum(values: Int32[Array, "k n"]) -> Int32[Array, "k n"]:
    return jnp.cumsum(values, axis=-1, dtype=jnp.int32)


def _f32_prefix_sum(values: Int32[Array, "k n"]) -> Int32[Array, "k n"]:
    return _scan_f32(values.astype(jnp.float32)).astype(jnp.int32)


def prefix_sum(values: Int32[Array, "*k n"], max_total: int) -> Int32[Array, "*k n"]:
    """Inclusive cumulative sum in int32 along the last axis, of non-negative ``values`` whose
    total is at most ``max_total`` (static).

    Integer ``cumsum`` on accelerators, and everywhere up to `SHORT_SCAN` entries. On XLA:CPU, longer
    and below 2**24, float32 matrix products (`_scan_f32`), exact for such totals and faster than
    XLA:CPU's ``cumsum``, a serial reduce-window (BENCHMARKS.md has the numbers).

    ```
    # [3, 2, 5] -> [3, 5, 10]
    ```
    """
    rows = values.reshape(-1, values.shape[-1])
    if max_total >= F32_EXACT_BOUND or rows.shape[-1] <= SHORT_SCAN:
        return _int_prefix_sum(rows).reshape(values.shape)
    return on_cpu_else(_f32_prefix_sum, _int_prefix_sum, rows).reshape(values.shape)


def counts_per_target(targets, claimed, size: int):
    """How many claimed entries name each target in [0, size); unclaimed ones write a spare entry.

    ```
    # targets [2, 0, 2, 5], claimed [T, T, T, F], size 4 -> counts [1, 0, 2, 0] -> per entry [2, 1, 2, 0]
    ```
    """
    index = jnp.where(claimed, jnp.clip(targets, 0, size - 1), size)
    counts = jnp.zeros((size + 1,), jnp.int32).at[index].add(1, mode="promise_in_bounds")
    return jnp.where(claimed, counts[index], 0)


def take_rows(table: Array, rows: Int32[Array, " n"], fill_value: int | float) -> Array:
    """``table[rows]`` along axis 0 for rows in ``[0, len(table)]``; the sentinel ``len(table)``
    reads ``fill_value``, and so does any row outside ``[0, len(table))``.

    The gather promises XLA in-bounds indices (no bounds masking of its own), so the index is
    clipped into ``[0, len(table) - 1]`` first: an out-of-range row, from bad input on the
    unchecked path included, reads a real row and is then replaced by ``fill_value``.
    (``jnp.take(mode="fill")`` does the same with more code.)

    ```
    # table rows [a, b, c], rows [2, 3, -1] -> [c, fill, fill]
    ```
    """
    last = table.shape[0] - 1
    valid = ((rows >= 0) & (rows <= last)).reshape(rows.shape + (1,) * (table.ndim - 1))
    return jnp.where(valid, table.at[jnp.clip(rows, 0, last)].get(mode="promise_in_bounds"), fill_value)


def token_request_index(request_ends: Int32[Array, " num_reqs_padded"],
                        num_tokens_padded: int) -> Int32[Array, " num_tokens_padded"]:
    """Batch row of every token: ``r`` with ``ends[r-1] <= t < ends[r]``, clipped to the last row.

    Counts, for each token, the request ends at or before it (a scatter and a scan, O(T + R)).
    Ends at or past ``num_tokens_padded`` land in one spare column past the tokens (in bounds,
    and counted by no token); on bad input a negative end is clipped to 0.

    ```
    # ends (= query_start_loc[1:]) [2, 7, 10, 10], 12 tokens -> [0,0,1,1,1,1,1,2,2,2,3,3]
    ```
    """
    num_reqs = request_ends.shape[0]
    columns = jnp.clip(request_ends, 0, num_tokens_padded)

    # the spare column is never scanned: a token's count reads only the columns before it
    def integer_count(columns):
        ends_per_token = jnp.zeros((1, num_tokens_padded + 1), jnp.int32).at[0, columns].add(
            1, mode="promise_in_bounds")
        return _int_prefix_sum(ends_per_token[:, :num_tokens_padded])[0]

    def float_count(columns):  # counted in float32 from the start: the scan's input needs no conversion pass
        ends_per_token = jnp.zeros((1, num_tokens_padded + 1), jnp.float32).at[0, columns].add(
            1.0, mode="promise_in_bounds")
        return _scan_f32(ends_per_token[:, :num_tokens_padded])[0].astype(jnp.int32)

    exact_in_float = num_reqs < F32_EXACT_BOUND
    count = on_cpu_else(float_count, integer_count, columns) if exact_in_float else integer_count(columns)
    return jnp.minimum(count, num_reqs - 1)


def token_mask(num_actual_tokens: Int32[Array, ""], num_tokens_padded: int) -> Bool[Array, " num_tokens_padded"]:
    """True for the scheduled tokens, False for the padded tail."""
    return jnp.arange(num_tokens_padded, dtype=jnp.int32) < num_actual_tokens


def token_blocks(block_table: Int32[Array, "rows width"], token_rows: Int32[Array, " n"],
                 positions: Int32[Array, " n"], tokens_per_column: int) -> Int32[Array, " n"]:
    """``block_table[row, pos // tokens_per_column]`` per token, the column clipped into the table.

    The clip changes nothing for valid input (a position below max_model_len has its column); on
    the unchecked path it keeps a bad position's read inside the table on every backend.

    ```
    # tokens_per_column 2, row [1, 2], positions [0, 1, 2, 9] -> columns [0, 0, 1, 1] -> [1, 1, 2, 2]
    ```
    """
    columns = jnp.clip(positions // tokens_per_column, 0, block_table.shape[1] - 1)
    return block_table[token_rows, columns]


def slot_mapping(block_table, token_rows, positions, is_real_token, block_size: int, max_block_id: int):
    """``block_table[row, pos // B] * B + pos % B`` per token; padded tokens get PAD_SLOT_ID, and so
    does a token whose block id is the null block or outside ``[1, max_block_id]`` (bad input on
    the unchecked path: its slot would write into another request's or no block).

    ```
    # B=2, row [1, 2], positions [0, 1, 2] -> blocks [1, 1, 2] -> slots [2, 3, 4]
    ```
    """
    blocks = token_blocks(block_table, token_rows, positions, block_size)
    writable = is_real_token & (blocks > NULL_BLOCK_ID) & (blocks <= max_block_id)
    return jnp.where(writable, blocks * block_size + positions % block_size, PAD_SLOT_ID)


# --- the batch layout of a step -----------------------------------------------------------------

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
