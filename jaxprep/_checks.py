"""Host-side helpers shared by the configs, `jaxprep.validate` and the features' input checks, and
the type checks of the public entry points.

A private module with no jaxprep imports but `_constants`, so the core validation and every
feature module can import it without an import cycle.
"""

from __future__ import annotations

import importlib.util
import math
import numbers

import numpy as np

from jaxprep._constants import INT32_MAX, NULL_BLOCK_ID


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
