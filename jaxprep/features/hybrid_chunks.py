"""Mamba2 SSD chunk metadata on the device (docs/semantics.md#hybrid).

vLLM: `vllm/v1/attention/backends/mamba_attn.py::BaseMambaAttentionMetadataBuilder._compute_chunk_metadata`.

vLLM builds it on the host, one Python loop over the prefill requests per step. Its rule: the
chunks of a request end at every multiple of ``chunk_size`` of the request's absolute positions
strictly inside its query, at its last token, and, with a prefill checkpoint ``k``, at position
``C + k`` too; a chunk never spans two requests. So request ``p`` (``C`` computed, ``q`` new
tokens) has ``1 + floor((C + q - 1) / chunk) - floor(C / chunk)`` chunks, one more for a
checkpoint that is not itself a multiple, and every chunk is found from its index alone.

The chunk count is data dependent; it is padded to the static bound `max_num_chunks`
(``2 * R_pad + ceil(T_pad / chunk)``, plus ``2 * R_pad`` with checkpoints, at most ``T_pad``),
the padded chunks empty (``cu_chunk_seqlen`` repeats the total).
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

from jaxprep._constants import NO_CHECKPOINT_CHUNK, PAD_CHUNK_SEQ_IDX, PAD_LAST_CHUNK_INDEX
from jaxprep._ragged import prefix_sum, token_request_index
from jaxprep._typing import Array, Bool, Int32, StepArray


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class HybridChunks:
    """The SSD chunks of the prefill rows (``_p`` slots of `jaxprep.features.hybrid.HybridMetadata`)."""

    cu_chunk_seqlen: Int32[StepArray, " max_num_chunks_plus_1"]  # chunk starts, then the total; pad repeats it
    seq_idx: Int32[StepArray, " max_num_chunks"]  # prefill slot of each chunk; pad: PAD_CHUNK_SEQ_IDX
    last_chunk_indices: Int32[StepArray, " num_reqs_padded"]  # per prefill slot; pad: PAD_LAST_CHUNK_INDEX
    num_chunks: Int32[StepArray, ""]
    # the chunk ending on each prefill slot's checkpoint (HybridConfig.checkpoints); -1: none (and pad)
    checkpoint_chunk_indices: Int32[StepArray, " num_reqs_padded"] | None = None


def max_num_chunks(num_reqs_padded: int, num_tokens_padded: int, chunk_size: int, checkpoints: bool) -> int:
    """Static chunk capacity: each request adds at most one partial chunk at each end (two more at a
    checkpoint), and every chunk holds at least one token."""
    bound = 2 * num_reqs_padded + -(-num_tokens_padded // chunk_size) + (2 * num_reqs_padded if checkpoints else 0)
    return min(bound, num_tokens_padded)


def chunk_metadata(computed: Int32[Array, " num_reqs_padded"],
                   query_start_loc_p: Int32[Array, " num_reqs_padded_plus_1"],
                   is_prefill: Bool[Array, " num_reqs_padded"], offsets: Int32[Array, " num_reqs_padded"] | None,
                   hybrid, num_tokens_padded: int) -> HybridChunks:
    """`HybridChunks` of the prefill slots (slot p: ``computed[p]``, query ``qsl_p[p]..qsl_p[p+1]``).

    ```
    # chunk 8, computed [5, 0, 16], qsl_p [0, 10, 13, 33] -> chunks per slot [2, 1, 3]
    #   cu_chunk_seqlen [0, 3, 10, 13, 21, 29, 33], seq_idx [0, 0, 1, 2, 2, 2], last [1, 2, 5]
    ```
    """
    chunk, num_reqs_padded = hybrid.chunk_size, is_prefill.shape[0]
    capacity = max_num_chunks(num_reqs_padded, num_tokens_padded, chunk, offsets is not None)
    tokens = query_start_loc_p[1:] - query_start_loc_p[:-1]
    ckpt = jnp.zeros_like(computed) if offsets is None else jnp.where(is_prefill, offsets, 0)
    first_multiple = computed // chunk + 1  # the first multiple of chunk past C is first_multiple * chunk
    inside = (computed + tokens - 1) // chunk - computed // chunk  # multiples strictly inside (C, C + q)
    extra = (ckpt > 0) & ((computed + ckpt) % chunk != 0)  # a checkpoint adds a chunk end of its own
    before_ckpt = (computed + ckpt - 1) // chunk - computed // chunk  # multiples inside (C, C + k)
    counts = jnp.where(is_prefill, 1 + inside + extra.astype(jnp.int32), 0)
    ends = prefix_sum(counts, capacity)
    starts = ends - counts
    # chunk j belongs to slot p with starts[p] <= j < ends[p]; its start is the request's i-th boundary
    index = jnp.arange(capacity, dtype=jnp.int32)
    slot = token_request_index(ends, capacity)
    i = index - starts[slot]
    multiple = first_multiple[slot] + i - 1 - (extra[slot] & (i > before_ckpt[slot] + 1)).astype(jnp.int32)
    boundary = jnp.where(i == 0, computed[slot],
                         jnp.where(extra[slot] & (i == before_ckpt[slot] + 1), computed[slot] + ckpt[slot],
                                   multiple * chunk))
    num_chunks, total = ends[-1], query_start_loc_p[-1]
    is_chunk = index < num_chunks
    chunk_starts = jnp.where(is_chunk, query_start_loc_p[slot] + boundary - computed[slot], total)
    return HybridChunks(
        cu_chunk_seqlen=jnp.pad(chunk_starts, (0, 1), constant_values=total),
        seq_idx=jnp.where(is_chunk, slot, PAD_CHUNK_SEQ_IDX),
        last_chunk_indices=jnp.where(is_prefill, ends - 1, PAD_LAST_CHUNK_INDEX), num_chunks=num_chunks,
        checkpoint_chunk_indices=None if offsets is None else jnp.where(
            is_prefill & (ckpt > 0), starts + before_ckpt, NO_CHECKPOINT_CHUNK))
