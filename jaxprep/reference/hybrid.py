"""NumPy reference of the hybrid-model (Mamba) metadata (vLLM ``mamba_attn.py``, V2 ``mamba_hybrid.py``), for reading.

Restates vLLM's host code on unpadded arrays in batch order: the V2 runner's prefill flags, the
builder's reclassification and ``split_decodes_and_prefills``, ``mamba_get_block_table_tensor`` and
``_compute_chunk_metadata``'s loop over checkpoint segments.
"""

from __future__ import annotations

import numpy as np


def state_indices_reference(block_table_rows, seq_lens, mode: str, block_size: int | None,
                            num_speculative_blocks: int) -> np.ndarray:
    """``mamba_get_block_table_tensor``: "none" -> the row; "align" -> columns from (seq_len - 1) // B."""
    columns = 1 + num_speculative_blocks
    table = np.asarray(block_table_rows)
    if mode == "none":
        return table[:, :columns]
    start = np.maximum(np.asarray(seq_lens) - 1, 0) // block_size
    return np.stack([table[r, start[r] + np.arange(columns)] for r in range(len(table))]).reshape(len(table), columns)


def classify_reference(computed, scheduled, drafts, prefill_len, k: int):
    """``(is_prefilling, num_decode_draft_tokens or None)`` as vLLM V2 hands them to the Mamba builder."""
    computed, scheduled = np.asarray(computed), np.asarray(scheduled)
    drafts, prefill_len = np.asarray(drafts), np.asarray(prefill_len)
    prefilling = computed < prefill_len  # num_computed_prefill_tokens < prefill_len
    runs_as_decode = prefilling & (scheduled - drafts == 1) & (np.minimum(computed, prefill_len) > 0)
    prefilling = prefilling & ~runs_as_decode
    decode_drafts = None
    if k > 0:
        is_decode = ~prefilling & (scheduled > 0) & (scheduled <= k + 1)
        decode_drafts = np.where(is_decode, drafts, -1)
    stateful = prefilling & (computed + scheduled > scheduled)
    to_decode = stateful & (scheduled == 1)
    if decode_drafts is not None:
        to_decode |= stateful & (decode_drafts >= 0) & (scheduled == decode_drafts + 1)
    return prefilling & ~to_decode, decode_drafts


def split_reference(query_start_loc, is_prefilling, decode_threshold: int) -> tuple[int, int, int, int]:
    """``split_decodes_and_prefills(..., treat_short_extends_as_decodes=False)``."""
    query_lens = np.diff(query_start_loc)
    num_reqs, num_tokens = len(query_lens), int(query_start_loc[-1])
    if query_lens[0] > decode_threshold:
        return 0, num_reqs, 0, num_tokens
    is_prefill = (query_lens > decode_threshold) | np.asarray(is_prefilling)
    if not is_prefill.any():
        return num_reqs, 0, num_tokens, 0
    first = int(np.argmax(is_prefill))
    return first, num_reqs - first, int(query_start_loc[first]), num_tokens - int(query_start_loc[first])


def chunk_metadata_reference(chunk_size: int, num_computed_p, query_start_loc_p, checkpoint_offsets_p=None):
    """``_compute_chunk_metadata``: ``(cu_chunk_seqlen, seq_idx, last_chunk_indices, checkpoint_chunk_indices)``."""
    cu_chunk_seqlen, seq_idx, last_chunk_indices = [], [], []
    checkpoint_chunk_indices = [-1] * len(num_computed_p)
    segments = []  # a checkpoint splits its request into two segments
    for p, computed in enumerate(num_computed_p):
        tokens = int(query_start_loc_p[p + 1]) - int(query_start_loc_p[p])
        ckpt = int(checkpoint_offsets_p[p]) if checkpoint_offsets_p is not None else 0
        if ckpt:
            segments.append((p, int(computed), ckpt, True))
        segments.append((p, int(computed) + ckpt, tokens - ckpt, False))
    position = 0
    for p, computed, tokens, ends_checkpoint in segments:
        if computed % chunk_size:  # finish the partly computed chunk first
            length = min(-(-computed // chunk_size) * chunk_size - computed, tokens)
            seq_idx.append(p)
            cu_chunk_seqlen.append(position)
            position, tokens = position + length, tokens - length
        while tokens > 0:
            length = min(chunk_size, tokens)
            seq_idx.append(p)
            cu_chunk_seqlen.append(position)
            position, tokens = position + length, tokens - length
        if ends_checkpoint:
            checkpoint_chunk_indices[p] = len(cu_chunk_seqlen) - 1
        else:
            last_chunk_indices.append(len(cu_chunk_seqlen) - 1)
    cu_chunk_seqlen.append(position)
    return cu_chunk_seqlen, seq_idx, last_chunk_indices, checkpoint_chunk_indices


def hybrid_reference(query_start_loc, computed, scheduled, drafts, prefill_len, state_rows, accepted, k: int,
                     hybrid) -> dict:
    """The whole per-step metadata, unpadded: what `jaxprep.features.hybrid.hybrid_metadata` pads."""
    seq_lens = np.asarray(computed) + np.asarray(scheduled)
    indices = state_indices_reference(state_rows, seq_lens, hybrid.mode, hybrid.block_size,
                                      hybrid.num_speculative_blocks)
    is_prefilling, decode_drafts = classify_reference(computed, scheduled, drafts, prefill_len, k)
    num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_reference(
        query_start_loc, is_prefilling, 1 + k)
    prefill = slice(num_decodes, num_decodes + num_prefills)
    out = dict(state_indices=indices, is_prefilling=is_prefilling,
               split=[num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens],
               state_indices_d=indices[:num_decodes, :1 + k], state_indices_p=indices[prefill, 0],
               query_start_loc_p=np.asarray(query_start_loc)[num_decodes:] - num_decode_tokens,
               has_initial_states_p=np.asarray(computed)[prefill] > 0)
    if k > 0:
        out.update(query_start_loc_d=np.asarray(query_start_loc)[:num_decodes + 1],
                   num_accepted_tokens=np.asarray(accepted)[:num_decodes], num_decode_draft_tokens=decode_drafts)
    return out
