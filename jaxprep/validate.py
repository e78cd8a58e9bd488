"""Host-side checks of a `BatchState` against a `PrepConfig`.

vLLM leaves most of these to its scheduler (SPEC §6); jaxprep rejects them with an error that
names the field, the row and the bound. Validation only reads: nothing is changed on error.
"""

from __future__ import annotations

import numpy as np

from jaxprep import features
from jaxprep._checks import InvalidBatchError, check_blocks, check_row_bound
from jaxprep._expect import expect_bucket, expect_state_and_config
from jaxprep.config import PrepConfig
from jaxprep.state import OPTIONAL_FIELDS

CORE_FIELDS = ("token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens")


def validate(state, config: PrepConfig, *, num_tokens_padded: int | None = None) -> None:
    """Raises `InvalidBatchError` if ``state`` cannot be prepared under ``config``.

    Checks shapes and dtypes; non-negative counts; a scheduled total in
    ``[1, max_num_batched_tokens]`` (and ``<= num_tokens_padded`` if given);
    ``num_computed + num_scheduled <= max_model_len``; every scheduled token's block allocated
    (not the null block 0); every block id a request uses in ``[1, config.max_block_id]``; and the
    inputs of every feature ``config.features`` turns on (`jaxprep.features.inputs`).
    """
    expect_state_and_config("validate", state, config)
    expect_bucket("validate", num_tokens_padded)
    fields = state.to_numpy()
    host = {name: fields[name] for name in CORE_FIELDS}
    optional = {name: fields[name] for name in OPTIONAL_FIELDS if name in fields}
    _check_shapes(host, config)
    features.check_feature_shapes(optional, config)
    computed = host["num_computed_tokens"].astype(np.int64)
    scheduled = host["num_scheduled_tokens"].astype(np.int64)
    _check_non_negative("num_computed_tokens", computed)
    _check_non_negative("num_scheduled_tokens", scheduled)
    features.check_feature_values(optional, host, config)
    _check_total(int(scheduled.sum()), config, num_tokens_padded)
    seq_lens = computed + scheduled
    check_row_bound(seq_lens > config.max_model_len, "num_computed_tokens + num_scheduled_tokens",
                    seq_lens, f"max_model_len={config.max_model_len}")
    check_blocks(host["block_table"], computed, scheduled, config.block_size, config.max_block_id,
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
    check_row_bound(values < 0, name, values, "0 (counts are non-negative)", relation="is below")


def _check_total(total: int, config: PrepConfig, num_tokens_padded: int | None) -> None:
    if total <= 0:
        raise InvalidBatchError("sum(num_scheduled_tokens) is 0: a step needs at least 1 scheduled token")
    if total > config.max_num_batched_tokens:
        raise InvalidBatchError(f"sum(num_scheduled_tokens)={total} exceeds "
                                f"max_num_batched_tokens={config.max_num_batched_tokens}")
    if num_tokens_padded is not None and total > num_tokens_padded:
        raise InvalidBatchError(f"sum(num_scheduled_tokens)={total} exceeds num_tokens_padded={num_tokens_padded}")
