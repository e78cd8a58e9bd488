"""The jnp checks both steps call (the XLA step of `jaxprep.prepare` and the fused kernels of
`jaxprep.kernels`): the core's bits of the error word (`StepInputs.errors`), the core's row bounds,
and the block-id bounds of the block tables.

A feature-free module: it imports nothing of jaxprep but the constants, the types and
the index helpers, so the XLA step, the kernels and the features (whose bits `jaxprep.features.flags`
numbers) all stand above it. The host checks that name the field, the row and the
bound are `jaxprep.validate`; each bit here mirrors one of them (messages in
`jaxprep.validate.error_messages`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep._ragged import on_cpu_else
from jaxprep._typing import Array, Bool, Int32, UInt32

# the core tables' bits of the error word (feature bits from 1 << 5 up: jaxprep.features.flags)
NEGATIVE_COUNT = 1 << 0
PAST_MAX_MODEL_LEN = 1 << 1
BLOCK_ID_OUT_OF_RANGE = 1 << 2
NULL_BLOCK = 1 << 3
OVER_BUCKET = 1 << 4


def core_row_flags(computed: Int32[Array, " rows"], scheduled: Int32[Array, " rows"],
                   max_model_len: int) -> list[tuple[int, Bool[Array, " rows"]]]:
    """``(bit, rows that break its bound)`` for the core counts: `jaxprep.validate.flag_rows` on the XLA
    path and `jaxprep.kernels.rows` (over a block of lanes) in the kernels.

    ```
    # computed [3, -1, 30], scheduled [2, 1, 4], M 32 -> NEGATIVE_COUNT [0,1,0], PAST_MAX_MODEL_LEN [0,0,1]
    ```
    """
    return [(NEGATIVE_COUNT, (computed < 0) | (scheduled < 0)),
            # scheduled > M - computed: no overflow for computed >= 0 (a negative one is flagged above)
            (PAST_MAX_MODEL_LEN, scheduled > max_model_len - computed)]


def token_flags(blocks: Int32[Array, " num_tokens_padded"], is_real_token: Bool[Array, " num_tokens_padded"],
                null: int):
    """``null`` if a scheduled token's block (``blocks``: each token's block in its table) is the null block.

    A scheduled token's block id outside the cache needs no check of its own: the token's column is
    one its request uses (position < seq_len), so `safe_block_table` sets the out-of-range bit for it.
    """
    return jnp.where(jnp.any(is_real_token & (blocks == NULL_BLOCK_ID)), jnp.int32(null), 0)


def safe_block_table(table: Int32[Array, "max_num_reqs W"], rows: Int32[Array, " num_reqs_padded"],
                     row_seq_lens: Int32[Array, " max_num_reqs"], tokens_per_column: int, max_block_id: int, bit: int):
    """``(batch table, bits)``: ``table``'s batch rows (``rows``; the null block for a padded row) with every
    id outside ``[0, max_block_id]`` nulled (the kernel reads only blocks that exist), and ``bit`` if such
    an id lies in a column a request uses. ``row_seq_lens``: each state row's sequence length if it is in
    the batch, else 0.

    ```
    # B 4, seq_lens [9], max_block_id 39, row [1, 2, 77, 55] -> columns used 0..2 -> [1, 2, 0, 0], bit set
    ```
    """
    last = table.shape[0] - 1
    gathered = table.at[jnp.clip(rows, 0, last)].get(mode="promise_in_bounds")
    kept = ((rows >= 0) & (rows <= last))[:, None] & (_as_unsigned(gathered) <= max_block_id)
    flag = _used_ids_outside(table, row_seq_lens, tokens_per_column, max_block_id)
    return jnp.where(kept, gathered, NULL_BLOCK_ID), jnp.where(flag, jnp.int32(bit), 0)


def _as_unsigned(ids):
    """int32 ids as uint32: a negative id becomes >= 2**31, above every max_block_id."""
    return jax.lax.bitcast_convert_type(ids, jnp.uint32)


def _used_ids_outside(table: Int32[Array, "max_num_reqs W"], row_seq_lens: Int32[Array, " max_num_reqs"],
                      tokens_per_column: int, max_block_id: int) -> Bool[Array, ""]:
    """Whether an id outside ``[0, max_block_id]`` lies in a column a state row uses (``row_seq_lens``:
    0 for a row outside the batch): the maximum of the used ids as uint32 (a negative id lies above
    every bound) exceeds ``max_block_id``. A pass over the state's table, apart from the batch's
    gather (XLA:CPU shares no pass between a reduction and another output).

    On XLA:CPU that pass is the cost (compute bound while the table sits in cache): the maximum of
    every id comes first, half the work of masking each id by its column, and the used ids are
    read only when it is above ``max_block_id``; a table whose unused entries are ids too (vLLM's
    zeros, a finished request's stale ids) never pays the second pass. Elsewhere the masked pass
    alone (a conditional costs a GPU a device-to-host sync).

    ```
    # B 4, seq_lens [9, 0], max_block_id 39, rows [[1, 2, 77, 55], [-1, 0, 0, 0]] -> used ids [1, 2, 77] -> set
    ```
    """
    masked = functools.partial(used_ids_outside_masked, tokens_per_column=tokens_per_column,
                               max_block_id=max_block_id)

    def cpu(table, row_seq_lens):  # no id outside the pool anywhere: none in a used column either
        outside_anywhere = max_of_blocks(lambda start, stop: _as_unsigned(table[:, start:stop]),
                                         table.shape[1]) > max_block_id
        return jax.lax.cond(outside_anywhere, lambda outside, *rows: masked(*rows), lambda outside, *_: outside,
                            outside_anywhere, table, row_seq_lens)  # the false branch answers False

    return on_cpu_else(cpu, masked, table, row_seq_lens)


def used_ids_outside_masked(table: Int32[Array, "max_num_reqs W"], row_seq_lens: Int32[Array, " max_num_reqs"],
                            tokens_per_column: int, max_block_id: int) -> Bool[Array, ""]:
    """`_used_ids_outside` in one pass: each id masked by its column (0, a valid id, where unused)."""
    # column c holds positions [c * B, (c + 1) * B): used when c * B < seq_len, i.e. c < cdiv(seq_len, B)
    columns_used = -(-row_seq_lens // tokens_per_column)[:, None]

    def used_ids(start, stop):
        column = jax.lax.broadcasted_iota(jnp.int32, (1, stop - start), 1) + start
        return jnp.where(column < columns_used, _as_unsigned(table[:, start:stop]), jnp.uint32(0))

    return max_of_blocks(used_ids, table.shape[1]) > max_block_id


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
