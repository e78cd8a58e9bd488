"""Several KV-cache groups (docs/semantics.md#kv-groups, #sliding-window): one block table and slot mapping per group.

Group 0 is `BatchState.block_table` with ``PrepConfig.block_size``; groups ``1..G-1`` are
`BatchState.extra_block_tables`. Each group's slot mapping uses its own manager block size (and
DCP when it is on). The block table handed to its kernel is gathered in batch order, then:

- sliding-window groups null the blocks wholly outside the window (vLLM V2 ``gather_block_tables``);
- a kernel block size ``b`` smaller than ``B`` expands every manager block into ``k = B / b``
  kernel blocks (vLLM ``map_to_kernel_block_table``); the slot ids do not change.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import NULL_BLOCK_ID
from jaxprep._ragged import slot_mapping, token_blocks
from jaxprep._typing import Array, Int32, StepArray
from jaxprep.bounds import (
    BLOCK_ID_OUT_OF_RANGE,
    InvalidBatchError,
    block_table_width,
    cdiv,
    check_blocks,
    max_block_id,
    safe_block_table,
    token_flags,
)
from jaxprep.features.config import KVCacheGroupSpec
from jaxprep.features.dcp import dcp_slot_mapping
from jaxprep.features.flags import KV_GROUP_BLOCK_OUT_OF_RANGE, KV_GROUP_NULL_BLOCK
from jaxprep.features.record import Feature


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class KVGroupMetadata:
    """What the layers of one KV-cache group read."""

    block_table: Int32[StepArray, "num_reqs_padded kernel_width"]  # kernel block table in batch order; pad rows: 0
    slot_mapping: Int32[StepArray, " num_tokens_padded"]  # manager slots; pad: -1
    block_size: int = dataclasses.field(metadata=dict(static=True))  # manager block size B_g
    kernel_block_size: int = dataclasses.field(metadata=dict(static=True))  # b; the table's block size


def sliding_window_null(block_table: Int32[Array, "num_reqs_padded W"], computed: Int32[Array, " num_reqs_padded"],
                        sliding_window: int, block_size: int) -> Int32[Array, "num_reqs_padded W"]:
    """Nulls the columns wholly before the window of each row's first query token.

    ```
    # window 4, B=2, C=9: reach 3, first kept column (9 - 3) // 2 = 3 -> columns 0..2 become 0
    ```
    """
    reach = sliding_window - 1
    first_kept = jnp.maximum(computed - reach, 0) // block_size
    columns = jnp.arange(block_table.shape[1], dtype=jnp.int32)
    return jnp.where(columns[None, :] < first_kept[:, None], NULL_BLOCK_ID, block_table)


def kernel_block_table(block_table: Int32[Array, "num_reqs_padded W"],
                       k: int) -> Int32[Array, "num_reqs_padded kernel_width"]:
    """Expands manager blocks into ``k`` kernel blocks each; the null block stays null.

    ```
    # B=32, b=16, k=2: row [3, 7, 0] -> [6, 7, 14, 15, 0, 0]
    ```
    """
    if k == 1:
        return block_table
    expanded = block_table[:, :, None] * k + jnp.arange(k, dtype=jnp.int32)[None, None, :]
    expanded = jnp.where(block_table[:, :, None] == NULL_BLOCK_ID, NULL_BLOCK_ID, expanded)
    return expanded.reshape(block_table.shape[0], block_table.shape[1] * k)


def group_block_table(gathered: Int32[Array, "num_reqs_padded W"], computed: Int32[Array, " num_reqs_padded"],
                      spec: KVCacheGroupSpec) -> Int32[Array, "num_reqs_padded kernel_width"]:
    """The kernel's block table of one group, from its rows gathered in batch order."""
    if spec.sliding_window is not None:
        gathered = sliding_window_null(gathered, computed, spec.sliding_window, spec.block_size)
    return kernel_block_table(gathered, spec.blocks_per_kernel_block)


def check_extra_table_shapes(tables: tuple, config) -> None:
    """Host check of `BatchState.extra_block_tables`: one table per group 1..G-1, each wide enough."""
    groups = config.features.kv_groups
    if groups and len(tables) != len(groups) - 1:
        raise InvalidBatchError(f"BatchState.extra_block_tables has {len(tables)} tables, FeatureConfig.kv_groups "
                                f"needs {len(groups) - 1} (groups 1..{len(groups) - 1})")
    for g, table in enumerate(tables, start=1):
        min_width = cdiv(config.max_model_len, groups[g].block_size) if groups else 1
        if table.ndim != 2 or table.shape[0] != config.max_num_reqs or table.shape[1] < min_width:
            raise InvalidBatchError(f"BatchState.extra_block_tables[{g - 1}] (group {g}) has shape {table.shape}, "
                                    f"config expects ({config.max_num_reqs}, W) with W >= {min_width}")
        if table.dtype != np.int32:
            raise InvalidBatchError(f"BatchState.extra_block_tables[{g - 1}] has dtype {table.dtype}, expected int32")


def check_group_blocks(host: dict, computed, scheduled, config) -> None:
    """The block checks of `jaxprep.validate` on the tables of KV groups 1..G-1, with their block sizes."""
    groups = config.features.kv_groups
    for g, table in enumerate(host.get("extra_block_tables", ()) if groups else (), start=1):
        spec = groups[g]
        check_blocks(table, computed, scheduled, spec.block_size, max_block_id(spec.num_blocks, spec.block_size),
                     dcp_world=config.features.dcp_world_size, name=f"extra_block_tables[{g - 1}]")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _inputs(features) -> dict[str, str]:
    groups = len(features.kv_groups)
    return {"extra_block_tables": f"kv_groups (G={groups})"} if groups > 1 else {}


def _empty_inputs(config) -> dict[str, tuple]:
    groups = config.features.kv_groups[1:]
    if not groups:
        return {}
    return {"extra_block_tables": tuple(
        np.full((config.max_num_reqs, block_table_width(config.max_model_len, g.block_size)), NULL_BLOCK_ID, np.int32)
        for g in groups)}


def _group_metadata(step, state, config, layout) -> tuple[tuple[KVGroupMetadata, ...], Int32[Array, ""]]:
    """One `KVGroupMetadata` per group (group 0 reads ``state.block_table``), and the step's error
    word with the bits of the groups' block ids (`jaxprep.features.flags`)."""
    features = config.features
    tables = (state.block_table, *(state.extra_block_tables or ()))
    groups, errors = [], step.errors
    for g, (spec, table) in enumerate(zip(features.kv_groups, tables, strict=True)):
        max_block_id = config.max_block_id if g == 0 else spec.max_block_id  # group 0 is the step's own table
        tokens_per_column = spec.block_size * features.dcp_world_size
        if features.dcp is not None:
            slots = dcp_slot_mapping(table, layout.token_rows, step.positions, layout.is_real_token,
                                     spec.block_size, features.dcp, max_block_id)
        else:
            slots = slot_mapping(table, layout.token_rows, step.positions, layout.is_real_token, spec.block_size,
                                 max_block_id)
        gathered, table_errors = safe_block_table(
            table, layout.rows, layout.row_seq_lens, tokens_per_column, max_block_id,
            BLOCK_ID_OUT_OF_RANGE if g == 0 else KV_GROUP_BLOCK_OUT_OF_RANGE)
        if g > 0:  # group 0's token bit is the core one
            blocks = token_blocks(table, layout.token_rows, step.positions, tokens_per_column)
            errors = errors | token_flags(blocks, layout.is_real_token, KV_GROUP_NULL_BLOCK)
        groups.append(KVGroupMetadata(block_table=group_block_table(gathered, layout.computed, spec),
                                      slot_mapping=slots, block_size=spec.block_size,
                                      kernel_block_size=spec.kernel_block_size or spec.block_size))
        errors = errors | table_errors
    return tuple(groups), errors


def _metadata(build) -> None:
    build.outputs["kv_groups"], build.errors = _group_metadata(build.step, build.state, build.config, build.layout)


FEATURE = Feature(
    name="kv_groups",
    is_on=lambda features: bool(features.kv_groups),
    inputs=_inputs,
    empty_inputs=_empty_inputs,
    messages=lambda config: {
        KV_GROUP_BLOCK_OUT_OF_RANGE: "extra_block_tables holds a block id outside [0, the group's max_block_id] "
                                     "in a column a request uses (KVCacheGroupSpec.num_blocks)",
        KV_GROUP_NULL_BLOCK: f"extra_block_tables: a scheduled token's block is the null block {NULL_BLOCK_ID}"},
    metadata=_metadata,
)
