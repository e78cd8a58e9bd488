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

from jaxprep._checks import InvalidBatchError, cdiv, check_blocks, max_block_id
from jaxprep._constants import NULL_BLOCK_ID
from jaxprep._typing import Array, Int32, StepArray
from jaxprep.features.config import KVCacheGroupSpec


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
