"""The pytrees one prepared step returns: `StepInputs` and its `AttentionMetadata`.

Sizes: ``num_tokens_padded`` is the step's token bucket and ``num_reqs_padded =
min(num_tokens_padded, max_num_reqs)``. Real counts are 0-d int32 arrays, so every batch of one
bucket shares one compiled executable.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING

import jax
from jaxprep._typing import Bool, Int32, StepArray

if TYPE_CHECKING:  # feature pytrees, defined next to the code that builds them
    from jaxprep.kv_groups import KVGroupMetadata
    from jaxprep.prompt_embeds import PromptEmbedsMetadata
    from jaxprep.spec_decode import SpecDecodeMetadata


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
    # DCP (§2.13) only: this rank's share of seq_lens; pad: 0
    dcp_local_seq_lens: Int32[StepArray, "num_reqs_padded"] | None = None


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
    errors: Int32[StepArray, ""]  # bit flags of the bounds the input broke, 0 if none (jaxprep.step_errors)
    num_tokens_padded: int = dataclasses.field(metadata=dict(static=True))
    # Optional features (jaxprep.FeatureConfig): None (an empty pytree node) when off.
    spec_decode: SpecDecodeMetadata | None = None  # §2.8
    discard_request_mask: Bool[StepArray, "num_reqs_padded"] | None = None  # §2.7, True: not sampled; pad: True
    kv_groups: tuple[KVGroupMetadata, ...] | None = None  # §2.12, one per KV-cache group
    mrope_positions: Int32[StepArray, "3 num_tokens_padded"] | None = None  # §2.11; pad: 0
    prompt_embeds: PromptEmbedsMetadata | None = None  # §2.10
    attn_state: Int32[StepArray, ""] | None = None  # jaxprep.AttnState value (PEERS §2.2)
    attn_mask: StepArray | None = None  # PEERS §2.3, see jaxprep.masks
    request_distribution: Int32[StepArray, "3"] | None = None  # [decode_end, prefill_end, mixed_end]

    @property
    def num_reqs_padded(self) -> int:
        return self.idx_mapping.shape[0]
