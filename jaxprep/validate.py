"""Host-side checks of a `BatchState` against a `PrepConfig`.

vLLM leaves most of these to its scheduler (SPEC §6); jaxprep rejects them with an error that
names the field, the row and the bound. Validation only reads: nothing is changed on error.
"""

from __future__ import annotations

import numpy as np

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep._expect import expect_bucket, expect_state_and_config
from jaxprep.config import PrepConfig, cdiv


CORE_FIELDS = ("token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens")


class InvalidBatchError(ValueError):
    """A batch state, or a step request, breaks a bound of the configuration."""


def validate(state, config: PrepConfig, *, num_tokens_padded: int | None = None) -> None:
    """Raises `InvalidBatchError` if ``state`` cannot be prepared under ``config``.

    Checks shapes and dtypes; non-negative counts; a scheduled total in
    ``[1, max_num_batched_tokens]`` (and ``<= num_tokens_padded`` if given);
    ``num_computed + num_scheduled <= max_model_len``; every scheduled token's block allocated
    (not the null block 0); every block id a request uses in ``[1, config.max_block_id]``; and the
    inputs of every feature ``config.features`` turns on (`jaxprep.validate_features`).
    """
    from jaxprep import validate_features as features  # feature inputs (jaxprep.FeatureConfig)

    expect_state_and_config("validate", state, config)
    expect_bucket("validate", num_tokens_padded)
    host = {name: np.asarray(getattr(state, name)) for name in CORE_FIELDS}
    optional = features.feature_fields(state)
    _check_shapes(host, config)
    features.check_feature_shapes(optional, config)
    computed = host["num_computed_tokens"].astype(np.int64)
    scheduled = host["num_scheduled_tokens"].astype(np.int64)
    _check_non_negative("num_computed_tokens", computed)
    _check_non_negative("num_scheduled_tokens", scheduled)
    features.check_feature_values(optional, host, config)
    _check_total(int(scheduled.sum()), config, num_tokens_padded)
    seq_lens = computed + scheduled
    _check_row_bound(seq_lens > config.max_model_len, "num_computed_tokens + num_scheduled_tokens",
                     seq_lens, f"max_model_len={config.max_model_len}")
    _check_blocks(host["block_table"], computed, scheduled, config.block_size, config.max_block_id,
                  dcp_world=config.features.dcp_world_size)
    features.check_group_blocks(optional, computed, scheduled, config)


def _check_shapes(host: dict[str, np.ndarray], config: PrepConfig) -> None:
    rows = config.max_num_reqs
    expected = {
        "token_ids": (rows, config.max_model_len),
        "num_computed_tokens": (rows,),
        "num_scheduled_tokens": (rows,),
    }
    for name, shape in expected.items():
        if host[name].shape != shape:
            raise InvalidBatchError(f"BatchState.{name} has shape {host[name].shape}, config expects {shape}")
    table = host["block_table"]
    if table.ndim != 2 or table.shape[0] != rows or table.shape[1] < config.min_blocks_per_req:
        raise InvalidBatchError(
            f"BatchState.block_table has shape {table.shape}, config expects ({rows}, W) with "
            f"W >= cdiv(max_model_len, block_size) = {config.min_blocks_per_req}")
    for name, array in host.items():
        if array.dtype != np.int32:
            raise InvalidBatchError(f"BatchState.{name} has dtype {array.dtype}, expected int32")


def _check_non_negative(name: str, values: np.ndarray) -> None:
    _check_row_bound(values < 0, name, values, "0 (counts are non-negative)", relation="is below")


def _check_total(total: int, config: PrepConfig, num_tokens_padded: int | None) -> None:
    if total <= 0:
        raise InvalidBatchError("sum(num_scheduled_tokens) is 0: a step needs at least 1 scheduled token")
    if total > config.max_num_batched_tokens:
        raise InvalidBatchError(f"sum(num_scheduled_tokens)={total} exceeds "
                                f"max_num_batched_tokens={config.max_num_batched_tokens}")
    if num_tokens_padded is not None and total > num_tokens_padded:
        raise InvalidBatchError(f"sum(num_scheduled_tokens)={total} exceeds num_tokens_padded={num_tokens_padded}")


def _check_row_bound(bad: np.ndarray, name: str, values: np.ndarray, bound: str, relation: str = "exceeds"):
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InvalidBatchError(f"{name} at row {row} is {int(values[row])}, which {relation} {bound}")


def _check_blocks(block_table: np.ndarray, computed: np.ndarray, scheduled: np.ndarray, block_size: int,
                  max_block_id: int, *, dcp_world: int = 1, name: str = "block_table") -> None:
    """Columns that hold scheduled tokens must be allocated; columns a request uses must be in range.

    With DCP a column is a virtual block of ``block_size * dcp_world`` tokens (SPEC §2.13).
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
