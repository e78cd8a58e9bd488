"""Index transforms between state rows, batch rows and flattened tokens, on static shapes."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import NULL_BLOCK_ID, PAD_SLOT_ID
from jaxprep._typing import Array, Bool, Float32, Int32, UInt32

SCAN_BLOCK = 32
"""Width of the blocks `prefix_sum` scans with one small matrix product each."""

SINGLE_PRODUCT_SCAN = 256
"""Up to this length a prefix sum is one product with an [n, n] constant (at most 256 KiB): one
kernel instead of the ~6 of the blocked scan, which matters more than its n**2 work at this size."""

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
    """Inclusive prefix sums along the last axis, as blocks of `SCAN_BLOCK` and one product.

    Exact while every partial sum stays below `F32_EXACT_BOUND`: the inputs are integers, ``U``
    holds 0 and 1, and float32 adds integers below 2**24 without rounding. XLA:CPU only (see
    `on_cpu_else`).
    Each block's sum starts from the carry of the blocks before it, appended as one more column:
    [block | carry] @ [[U], [1 .. 1]] is the block's prefix sum plus its carry.

    ```
    # [1,0,1,1 | 0,1,0,0] in blocks of 4: totals [3, 1] -> carries [0, 3] -> [1,1,2,3 | 3,4,4,4]
    ```
    """
    k, n = values.shape
    if n <= SINGLE_PRODUCT_SCAN:
        return _exact_matmul(values, _upper_ones(n))
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
    (measured in BENCHMARKS.md, "What limits the missed goals"); GPUs and TPUs get the integer
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

    Integer ``cumsum`` on accelerators. On XLA:CPU, below 2**24, float32 matrix products
    (`_scan_f32`), exact for such totals and faster than XLA:CPU's ``cumsum``, a serial
    reduce-window (BENCHMARKS.md has the numbers).

    ```
    # [3, 2, 5] -> [3, 5, 10]
    ```
    """
    rows = values.reshape(-1, values.shape[-1])
    if max_total >= F32_EXACT_BOUND:
        return _int_prefix_sum(rows).reshape(values.shape)
    return on_cpu_else(_f32_prefix_sum, _int_prefix_sum, rows).reshape(values.shape)


FOLD_PARTS = 32
"""How many column blocks, then row blocks, `max_of_blocks` folds together elementwise."""
VECTOR_LANES = 8
"""Column blocks are a multiple of this wide (int32 lanes of a 256-bit vector), so each fold vectorizes."""


def _fold_starts(size: int, block: int) -> list[int]:
    """Starts of the blocks that cover ``[0, size)``; the last is moved back to end at ``size`` (it may
    overlap the one before it: a maximum does not mind). # size 10, block 4 -> [0, 4, 6]"""
    return list(range(0, size - block, block)) + [size - block]


def max_of_blocks(column_block: Callable[[int, int], UInt32[Array, "rows n"]], width: int) -> UInt32[Array, ""]:
    """The maximum of an array given by its column blocks (``column_block(start, stop)``: columns
    ``[start, stop)``), as two elementwise folds and one small reduction.

    The column blocks (at most `FOLD_PARTS`, whole vectors wide) are folded together with
    ``jnp.maximum`` (a loop that reads the array once, row by row, as a vectorized loop), then the
    row blocks of that result, and only the small remainder is reduced: XLA:CPU emits a reduction
    over a large array as a tree of serial loops (reduce-windows) several times slower than the
    array's read (BENCHMARKS.md, "The XLA step recovered"). Exact on every backend (integer maxima).

    ```
    # columns [[1, 5, 2], [7, 2, 0]] in blocks of 2 (starts 0, 1) -> [[5, 5], [7, 2]] -> rows -> 7
    ```
    """
    block = min(width, -(-max(1, -(-width // FOLD_PARTS)) // VECTOR_LANES) * VECTOR_LANES)
    starts = _fold_starts(width, block)
    folded = column_block(starts[0], starts[0] + block)
    for start in starts[1:]:
        folded = jnp.maximum(folded, column_block(start, start + block))
    rows = folded.shape[0]
    row_block = -(-rows // FOLD_PARTS)
    row_starts = _fold_starts(rows, row_block)
    result = folded[row_starts[0]:row_starts[0] + row_block]
    for start in row_starts[1:]:
        result = jnp.maximum(result, folded[start:start + row_block])
    return jnp.max(result)


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

    def integer_count(columns):
        ends_per_token = jnp.zeros((1, num_tokens_padded + 1), jnp.int32).at[0, columns].add(
            1, mode="promise_in_bounds")
        return _int_prefix_sum(ends_per_token)[0, :num_tokens_padded]

    def float_count(columns):  # counted in float32 from the start: the scan's input needs no conversion pass
        ends_per_token = jnp.zeros((1, num_tokens_padded + 1), jnp.float32).at[0, columns].add(
            1.0, mode="promise_in_bounds")
        return _scan_f32(ends_per_token)[0, :num_tokens_padded].astype(jnp.int32)

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
