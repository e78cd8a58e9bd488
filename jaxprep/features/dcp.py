"""Decode context parallelism (docs/semantics.md#dcp): each rank stores a round-robin share of every sequence.

A virtual block of ``B * W`` tokens (block size ``B``, world size ``W``) is dealt out to the ranks
in chunks of ``I`` tokens (the interleave). This rank writes only its own tokens: the others get
``PAD_SLOT_ID``. Its attention reads ``dcp_local_seq_lens`` tokens of each sequence.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxprep._constants import NULL_BLOCK_ID, PAD_SEQ_LEN, PAD_SLOT_ID
from jaxprep._ragged import token_blocks
from jaxprep._typing import Array, Bool, Int32
from jaxprep.features.config import DCPConfig
from jaxprep.features.record import Feature


def dcp_slot_mapping(block_table: Int32[Array, "max_num_reqs W"], token_rows: Int32[Array, " num_tokens_padded"],
                     positions: Int32[Array, " num_tokens_padded"], is_real_token: Bool[Array, " num_tokens_padded"],
                     block_size: int, dcp: DCPConfig, max_block_id: int) -> Int32[Array, " num_tokens_padded"]:
    """This rank's slot of every token, ``PAD_SLOT_ID`` for tokens stored on other ranks (and, as
    in `jaxprep._ragged.slot_mapping`, for a block id outside ``[1, max_block_id]``).

    ```
    # B=2, W=2, row [10, 11], positions 0..7:
    #   I=1: rank 0 [20,-1,21,-1,22,-1,23,-1], rank 1 [-1,20,-1,21,-1,22,-1,23]
    #   I=2: rank 0 [20,21,-1,-1,22,23,-1,-1]
    ```
    """
    world, interleave = dcp.world_size, dcp.interleave
    virtual_block_size = block_size * world
    virtual_offset = positions % virtual_block_size
    is_local = (virtual_offset // interleave) % world == dcp.rank
    local_offset = (virtual_offset // (world * interleave)) * interleave + virtual_offset % interleave
    blocks = token_blocks(block_table, token_rows, positions, virtual_block_size)
    writable = is_real_token & is_local & (blocks > NULL_BLOCK_ID) & (blocks <= max_block_id)
    return jnp.where(writable, blocks * block_size + local_offset, PAD_SLOT_ID)


def dcp_local_seq_lens(seq_lens: Int32[Array, " num_reqs_padded"], is_real_req: Bool[Array, " num_reqs_padded"],
                       dcp: DCPConfig) -> Int32[Array, " num_reqs_padded"]:
    """Tokens of each sequence stored on this rank; padded rows `PAD_SEQ_LEN`.

    ```
    # W=2, I=1, seq_len 7 -> rank 0 holds positions 0,2,4,6 (4), rank 1 holds 1,3,5 (3)
    ```
    """
    world, interleave = dcp.world_size, dcp.interleave
    span = world * interleave
    tail = jnp.clip(seq_lens % span - dcp.rank * interleave, 0, interleave)
    return jnp.where(is_real_req, (seq_lens // span) * interleave + tail, PAD_SEQ_LEN)


def _metadata(build) -> None:
    """DCP's slots (each token's slot on its rank) and each request's local lengths."""
    step, layout, config = build.step, build.layout, build.config
    dcp = config.features.dcp
    build.attn_metadata = dataclasses.replace(
        build.attn_metadata,
        slot_mapping=dcp_slot_mapping(build.state.block_table, layout.token_rows, step.positions, layout.is_real_token,
                                      config.block_size, dcp, config.max_block_id),
        dcp_local_seq_lens=dcp_local_seq_lens(build.attn_metadata.seq_lens, layout.is_real_req, dcp))


FEATURE = Feature(name="dcp", is_on=lambda features: features.dcp is not None, metadata=_metadata)
"""This feature's record (`jaxprep.features.registry`): no input of its own and no check; `_metadata` adds
its outputs to the step."""
