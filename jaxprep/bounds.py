"""Every bound of a batch, checked two ways: on the host, raising an error that names the field, the
row and the bound (the configs, `jaxprep.validate` and the features' input checks call these helpers;
also the type checks of the public entry points), and on the device, as the jnp checks both steps call
(the XLA step of `jaxprep.prepare` and the fused kernels of `jaxprep.kernels`): the core's bits of the
error word (`StepInputs.errors`), the core's row bounds, and the block-id bounds of the block tables.

A feature-free module: it imports nothing of jaxprep but the constants, the types and the index
helpers, so the configs, the XLA step, the kernels and the features (whose bits
`jaxprep.features.flags` numbers) all stand above it. Each device bit mirrors one host check
(messages in `jaxprep.validate.error_messages`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import INT32_MAX, NULL_BLOCK_ID
from jaxprep._ragged import on_cpu_else
from jaxprep._typing import Array, Bool, Int32, UInt32

# --- on the host: raise, naming the field, the row and the bound ------------------------------------


class InvalidBatchError(ValueError):
    """A batch state, or a step request, breaks a bound of the configuration."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_block_id(num_blocks: int | None, block_size: int) -> int:
    """Largest valid block id: ``num_blocks - 1``, or (no cache size) the last block whose slots fit int32.

    ```
    # num_blocks 64 -> 63; None, block size 16 -> (2**31 - 1) // 16 - 1 = 134217726
    ```
    """
    return num_blocks - 1 if num_blocks is not None else INT32_MAX // block_size - 1


def block_table_width(max_model_len: int, block_size: int) -> int:
    """vLLM's block-table width: cdiv(max_model_len, B) aligned to 128 tokens.

    ```
    # B=2, M=12 -> 6 blocks, alignment 64 -> 64 columns; B=16, M=240 -> 15 blocks, alignment 8 -> 16
    ```
    """
    num_blocks = cdiv(max_model_len, block_size)
    alignment = 128 // math.gcd(128, block_size)
    return cdiv(num_blocks, alignment) * alignment


def check_positive_int(name: str, value) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is an int (not a bool) above 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_row_bound(bad: np.ndarray, name: str, values: np.ndarray, bound: str, relation: str = "exceeds"):
    """Raises `InvalidBatchError` naming the first row where ``bad`` holds, its value and the bound."""
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InvalidBatchError(f"{name} at row {row} is {int(values[row])}, which {relation} {bound}")


def check_blocks(block_table: np.ndarray, computed: np.ndarray, scheduled: np.ndarray, block_size: int,
                 max_block_id: int, *, dcp_world: int = 1, name: str = "block_table") -> None:
    """Columns that hold scheduled tokens must be allocated; columns a request uses must be in range.

    With DCP a column is a virtual block of ``block_size * dcp_world`` tokens (docs/semantics.md#dcp).
    """
    tokens_per_column = block_size * dcp_world
    columns = np.arange(block_table.shape[1])
    seq_lens = computed + scheduled
    in_batch = scheduled > 0
    num_used_blocks = -(-seq_lens // tokens_per_column)
    used = in_batch[:, None] & (columns[None, :] < num_used_blocks[:, None])
    first_new = computed // tokens_per_column
    scheduled_cols = used & (columns[None, :] >= first_new[:, None])
    null = scheduled_cols & (block_table == NULL_BLOCK_ID)
    if null.any():
        row, col = (int(i[0]) for i in np.nonzero(null))
        raise InvalidBatchError(
            f"{name}[{row}, {col}] is the null block {NULL_BLOCK_ID}, but row {row} schedules tokens "
            f"{int(computed[row])}..{int(seq_lens[row]) - 1} in blocks {int(first_new[row])}.."
            f"{cdiv(int(seq_lens[row]), tokens_per_column) - 1}: allocate its blocks first")
    out_of_range = used & ((block_table < 0) | (block_table > max_block_id))
    if out_of_range.any():
        row, col = (int(i[0]) for i in np.nonzero(out_of_range))
        raise InvalidBatchError(f"{name}[{row}, {col}] = {int(block_table[row, col])} is outside the block ids "
                                f"[{NULL_BLOCK_ID}, max_block_id={max_block_id}]")


# --- type checks at the public entry points ---------------------------------------------------
# A wrong argument raises one TypeError that says what was expected and what was given, before
# anything touches its attributes (an AttributeError from deep inside says neither).
#
#     prepare_inputs(numpy_arrays, config)
#     TypeError: prepare_inputs: state must be a jaxprep.BatchState, got dict (build one with
#     jaxprep.BatchState.from_numpy(token_ids=..., block_table=..., ...))

STATE_HINT = "build one with jaxprep.BatchState.from_numpy(token_ids=..., block_table=..., ...)"
CONFIG_HINT = ("make one with jaxprep.PrepConfig(max_num_reqs=..., max_model_len=..., max_num_batched_tokens=..., "
               "block_size=...)")


def type_name(value) -> str:
    """``np.zeros(3)`` -> ``numpy.ndarray``; ``{}`` -> ``dict``."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def expect(function: str, name: str, value, expected, expected_name: str, hint: str = "") -> None:
    """Raises TypeError unless ``isinstance(value, expected)``."""
    if not isinstance(value, expected):
        raise TypeError(f"{function}: {name} must be {expected_name}, got {type_name(value)}"
                        + (f" ({hint})" if hint else ""))


def expect_bucket(function: str, num_tokens_padded, optional: bool = True) -> None:
    """A static Python (or NumPy) integer: the padded token count is part of the compiled shape."""
    if type(num_tokens_padded) is int:  # the common case first: numbers.Integral is an ABC, ~0.5 µs a check
        return
    allowed = "an int or None" if optional else "an int"
    if (num_tokens_padded is None and optional) or (
            isinstance(num_tokens_padded, numbers.Integral) and not isinstance(num_tokens_padded, bool)):
        return
    raise TypeError(f"{function}: num_tokens_padded must be {allowed} (a bucket of config.token_buckets, "
                    f"e.g. config.bucket_for(total)), got {type_name(num_tokens_padded)}")


def module_available(name: str) -> bool:
    """Whether module ``name`` (dotted) can be imported, found without importing it (its parents are):
    jax 0.11 deprecates the Pallas modules jaxprep's kernel choices use, and a later jax may drop them."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is gone
        return False


# --- on the device: a bit of the error word ------------------------------------------------------
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
    array's read (docs/benchmarks-history.md, "The XLA step recovered"). Exact on every backend (integer maxima).

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
