"""The pytrees one prepared step returns: `StepInputs` and its `AttentionMetadata`.

Sizes: ``num_tokens_padded`` is the step's token bucket and ``num_reqs_padded =
min(num_tokens_padded, max_num_reqs)``. Real counts are 0-d int32 arrays, so every batch of one
bucket shares one compiled executable.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
from jaxprep._typing import Int32, StepArray


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """vLLM's ``CommonAttentionMetadata`` fields, padded to static shapes."""

    query_start_loc: Int32[StepArray, "num_reqs_padded_plus_1"]  # pad: repeats num_actual_tokens
    seq_lens: Int32[StepArray, "num_reqs_padded"]  # num_computed + num_scheduled; pad: 0
    slot_mapping: Int32[StepArray, "num_tokens_padded"]  # block * block_size + offset; pad: -1
    block_table: Int32[StepArray, "num_reqs_padded max_blocks_per_req"]  # rows in batch order; pad: 0
    num_actual_tokens: Int32[StepArray, ""]  # scheduled tokens, unpadded
    num_reqs: Int32[StepArray, ""]  # requests in the batch, unpadded
    max_query_len: Int32[StepArray, ""]  # max num_scheduled over the batch
    max_seq_len: Int32[StepArray, ""]  # max seq_lens over the batch


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Model inputs of one step."""

    input_ids: Int32[StepArray, "num_tokens_padded"]  # pad: 0
    positions: Int32[StepArray, "num_tokens_padded"]  # pad: 0
    logits_indices: Int32[StepArray, "num_reqs_padded"]  # last scheduled token of each request; pad: 0
    idx_mapping: Int32[StepArray, "num_reqs_padded"]  # state row of each batch row; pad: -1
    attn_metadata: AttentionMetadata
    num_tokens_padded: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_reqs_padded(self) -> int:
        return self.idx_mapping.shape[0]
