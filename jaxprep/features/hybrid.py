"""Hybrid models: the per-step metadata of Mamba / linear-attention layers (docs/semantics.md#hybrid).

Mamba layers form their own KV-cache group whose "blocks" are recurrent-state slots, read through
`BatchState.mamba_block_table`. Per step vLLM computes (``BaseMambaAttentionMetadataBuilder
._compute_common_metadata``, V2 ``model_states/mamba_hybrid.py::prepare_attn``):

- the state indices: which state block each request reads and writes (``mamba_get_block_table_tensor``:
  mode "none" reads the row as is, mode "align" (prefix caching) the block holding the last token);
- the decode / prefill split of the batch (decodes first, as the reorder leaves them), after
  reclassifying one-token prompt extensions over existing state as decodes;
- the prefill side (``query_start_loc_p``, ``has_initial_states_p``, ``state_indices_p``), the
  decode side (``state_indices_d``; with spec decode ``query_start_loc_d``, ``num_accepted_tokens``,
  ``num_decode_draft_tokens``) and, for Mamba2, the SSD chunk metadata (`jaxprep.features.hybrid_chunks`).

vLLM slices its arrays to the split; here every array keeps the step's static row count and
moves the prefill rows to the front, padded with the constants of `jaxprep._constants`. The host
checks of the inputs (`check_mamba_table_shape`, `check_hybrid_values`) are at the end.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import INT32_MAX, NO_DECODE_DRAFTS, NULL_BLOCK_ID, PAD_NUM_ACCEPTED_TOKENS, PAD_STATE_INDEX
from jaxprep._ragged import take_rows
from jaxprep._typing import Array, Bool, Int32, StepArray
from jaxprep.bounds import InvalidBatchError, check_row_bound
from jaxprep.features.config import HybridConfig
from jaxprep.features.flags import (
    MAMBA_CHECKPOINT_OUT_OF_RANGE,
    MAMBA_STATE_BLOCK_INVALID,
    NUM_ACCEPTED_TOKENS_OUT_OF_RANGE,
)
from jaxprep.features.hybrid_chunks import HybridChunks, chunk_metadata
from jaxprep.features.record import Feature


class HybridRows(NamedTuple):
    """Per batch row inputs the hybrid metadata reads (from the step's layout)."""

    rows: Int32[Array, " num_reqs_padded"]  # state row; pad: max_num_reqs
    scheduled: Int32[Array, " num_reqs_padded"]
    computed: Int32[Array, " num_reqs_padded"]
    drafts: Int32[Array, " num_reqs_padded"]
    is_real_req: Bool[Array, " num_reqs_padded"]


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class HybridMetadata:
    """`StepInputs.hybrid`. ``_p`` arrays hold the prefill rows first, ``_d`` the decode rows."""

    state_indices: Int32[StepArray, "num_reqs_padded columns"]  # per batch row; pad: PAD_STATE_INDEX
    is_prefilling: Bool[StepArray, " num_reqs_padded"]  # after reclassification; pad: False
    split: Int32[StepArray, " 4"]  # [num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens]
    state_indices_d: Int32[StepArray, "num_reqs_padded decode_columns"]  # decode rows; pad: PAD_STATE_INDEX
    state_indices_p: Int32[StepArray, " num_reqs_padded"]  # column 0 of the prefill rows; pad: PAD_STATE_INDEX
    query_start_loc_p: Int32[StepArray, " num_reqs_padded_plus_1"]  # pad repeats num_prefill_tokens
    has_initial_states_p: Bool[StepArray, " num_reqs_padded"]  # pad: False
    # spec decode only: decode query offsets (pad repeats num_decode_tokens), accepted counts (pad 1)
    query_start_loc_d: Int32[StepArray, " num_reqs_padded_plus_1"] | None = None
    num_accepted_tokens: Int32[StepArray, " num_reqs_padded"] | None = None
    num_decode_draft_tokens: Int32[StepArray, " num_reqs_padded"] | None = None  # -1 off decodes (and pad)
    chunks: HybridChunks | None = None  # Mamba2 only (HybridConfig.chunk_size)


def hybrid_metadata(state, query_start_loc: Int32[Array, " num_reqs_padded_plus_1"], config, rows: HybridRows,
                    num_tokens_padded: int) -> HybridMetadata:
    """The hybrid metadata of one step (inside `prepare_padded`)."""
    hybrid, k = config.features.hybrid, config.features.num_speculative_tokens
    prefill_len = take_rows(state.prefill_len, rows.rows, fill_value=0)
    indices = state_indices(take_rows(state.mamba_block_table, rows.rows, fill_value=PAD_STATE_INDEX),
                            rows.computed + rows.scheduled, hybrid)
    is_prefilling, decode_drafts = classify_rows(rows, prefill_len, k)
    num_decodes, num_reqs = split_point(rows, is_prefilling, k)
    num_decode_tokens = query_start_loc[num_decodes]
    is_decode = jnp.arange(rows.is_real_req.shape[0], dtype=jnp.int32) < num_decodes
    prefill, prefill_row, is_prefill_slot = _prefill_side(query_start_loc, rows, indices, num_decodes, num_reqs)
    meta = HybridMetadata(
        state_indices=indices, is_prefilling=is_prefilling,
        split=jnp.stack([num_decodes, num_reqs - num_decodes, num_decode_tokens,
                         query_start_loc[-1] - num_decode_tokens]),
        state_indices_d=jnp.where(is_decode[:, None], indices[:, :min(1 + k, hybrid.num_state_columns)],
                                  PAD_STATE_INDEX), **prefill)
    if k > 0:
        accepted = take_rows(state.num_accepted_tokens, rows.rows, fill_value=PAD_NUM_ACCEPTED_TOKENS)
        # query_start_loc_d: qsl[:num_decodes + 1], the tail repeating num_decode_tokens
        rows_plus_1 = jnp.arange(query_start_loc.shape[0], dtype=jnp.int32)
        meta = dataclasses.replace(meta, query_start_loc_d=query_start_loc[jnp.minimum(rows_plus_1, num_decodes)],
                                   num_accepted_tokens=jnp.where(is_decode, accepted, PAD_NUM_ACCEPTED_TOKENS),
                                   num_decode_draft_tokens=decode_drafts)
    if hybrid.chunk_size is not None:
        offsets = take_rows(state.mamba_checkpoint_offsets, rows.rows, fill_value=0) if hybrid.checkpoints else None
        meta = dataclasses.replace(meta, chunks=chunk_metadata(
            rows.computed[prefill_row], meta.query_start_loc_p, is_prefill_slot,
            None if offsets is None else offsets[prefill_row], hybrid, num_tokens_padded))
    return meta


def _prefill_side(query_start_loc, rows: HybridRows, indices, num_decodes, num_reqs):
    """The prefill rows moved to the front: ``(fields, batch row of each slot, is a real prefill slot)``.

    ```
    # qsl [0, 3, 5, 6, 12], 3 decodes of 4 -> slot 0 is batch row 3 -> query_start_loc_p [0, 6, 6, 6, 6]
    ```
    """
    num_reqs_padded = rows.is_real_req.shape[0]
    slot = jnp.arange(num_reqs_padded + 1, dtype=jnp.int32)
    qsl_p = query_start_loc[jnp.minimum(num_decodes + slot, num_reqs_padded)] - query_start_loc[num_decodes]
    row = jnp.minimum(num_decodes + slot[:-1], num_reqs_padded - 1)  # padded slots read the last row, masked
    is_prefill_slot = slot[:-1] < num_reqs - num_decodes
    fields = dict(query_start_loc_p=qsl_p, has_initial_states_p=is_prefill_slot & (rows.computed[row] > 0),
                  state_indices_p=jnp.where(is_prefill_slot, indices[row, 0], PAD_STATE_INDEX))
    return fields, row, is_prefill_slot


def state_indices(table: Int32[Array, "num_reqs_padded width"], seq_lens: Int32[Array, " num_reqs_padded"],
                  hybrid: HybridConfig) -> Int32[Array, "num_reqs_padded columns"]:
    """``mamba_get_block_table_tensor``: mode "none" reads the first ``1 + num_speculative_blocks``
    columns; mode "align" the block holding the last token and the ones after it.

    ```
    # align, B 16, seq_lens [33, 16, 1], rows [1..5], [6..11], [12..15] -> columns from [2, 0, 0]
    #   -> [[3, 4, 5], [6, 7, 8], [12, 13, 14]]
    ```
    """
    columns = hybrid.num_state_columns
    if hybrid.mode == "none":
        return table[:, :columns]
    first = jnp.maximum(seq_lens - 1, 0) // hybrid.block_size
    column = jnp.clip(first[:, None] + jnp.arange(columns, dtype=jnp.int32)[None, :], 0, table.shape[1] - 1)
    return jnp.take_along_axis(table, column, axis=1)


def classify_rows(rows: HybridRows, prefill_len, k: int):
    """``(is_prefilling, num_decode_draft_tokens)`` per batch row, as vLLM V2 hands them to the builder.

    A row is prefilling while ``C < prefill_len``; one that adds a single prompt token (plus any
    placeholder drafts) over existing state runs as a decode (``prefill_runs_as_decode``), and so
    does, in the builder, a prefilling one-token query over existing state.

    ```
    # C [9, 4, 0, 3], S [3, 6, 5, 1], D [2, 0, 0, 0], prefill_len [5, 20, 5, 8] -> [F, T, T, F]
    ```
    """
    is_prefilling = rows.is_real_req & (rows.computed < prefill_len)
    runs_as_decode = is_prefilling & (rows.scheduled - rows.drafts == 1) & (rows.computed > 0)
    is_prefilling = is_prefilling & ~runs_as_decode
    decode_drafts = None
    if k > 0:
        is_decode = rows.is_real_req & ~is_prefilling & (rows.scheduled <= k + 1)
        decode_drafts = jnp.where(is_decode, rows.drafts, NO_DECODE_DRAFTS)
    stateful = is_prefilling & (rows.computed > 0)  # seq_len > query_len
    to_decode = stateful & (rows.scheduled == 1)
    if decode_drafts is not None:
        to_decode |= stateful & (decode_drafts >= 0) & (rows.scheduled == decode_drafts + 1)
    return is_prefilling & ~to_decode, decode_drafts


def split_point(rows: HybridRows, is_prefilling, k: int):
    """``(num_decodes, num_reqs)``: ``split_decodes_and_prefills`` with short extends as prefills.

    The first row that is prefilling or longer than the decode threshold (``1 + K`` with spec
    decode, else 1) starts the prefills; every row after it counts as a prefill too.

    ```
    # S [3, 2, 1, 6], K 2, prefilling [F, F, F, T] -> 3 decodes of 4
    ```
    """
    threshold = 1 + k
    is_prefill = rows.is_real_req & ((rows.scheduled > threshold) | is_prefilling)
    batch_row = jnp.arange(rows.scheduled.shape[0], dtype=jnp.int32)
    num_reqs = jnp.sum(rows.is_real_req, dtype=jnp.int32)
    first = jnp.min(jnp.where(is_prefill, batch_row, rows.scheduled.shape[0]))
    return jnp.minimum(first, num_reqs).astype(jnp.int32), num_reqs


def check_mamba_table_shape(table, config) -> None:
    """``(max_num_reqs, W)`` int32 with ``W`` at least `HybridConfig.table_width` (1 when hybrid is off);
    ``table``: a host array or, at trace time, a tracer."""
    hybrid = config.features.hybrid
    width = hybrid.table_width(config.max_model_len) if hybrid is not None else 1
    if table.ndim != 2 or table.shape[0] != config.max_num_reqs or table.shape[1] < width:
        raise InvalidBatchError(f"BatchState.mamba_block_table has shape {table.shape}, config expects "
                                f"({config.max_num_reqs}, W) with W >= {width} (HybridConfig.table_width)")
    if table.dtype != np.int32:
        raise InvalidBatchError(f"BatchState.mamba_block_table has dtype {table.dtype}, expected int32")


def check_hybrid_values(host: dict, computed: np.ndarray, scheduled: np.ndarray, config) -> None:
    """State blocks a scheduled row reads are ids in ``[0, max_block_id]`` (vLLM's groups share one block
    pool), the first one allocated; accepted counts in
    ``[1, 1 + K]``; checkpoint offsets inside the query (``0`` or ``0 < k < S``)."""
    hybrid, k = config.features.hybrid, config.features.num_speculative_tokens
    in_batch = scheduled > 0
    table = host["mamba_block_table"].astype(np.int64)
    first = np.zeros_like(computed)
    if hybrid.mode == "align":
        first = np.maximum(computed + scheduled - 1, 0) // hybrid.block_size
    columns = np.minimum(first[:, None] + np.arange(hybrid.num_state_columns)[None, :], table.shape[1] - 1)
    read = np.take_along_axis(table, columns, axis=1)
    check_row_bound(in_batch & (read < 0).any(axis=1), "mamba_block_table (a state block a row reads)",
                    read.min(axis=1), f"{NULL_BLOCK_ID} (block ids are non-negative)", relation="is below")
    check_row_bound(in_batch & (read > config.max_block_id).any(axis=1),
                    "mamba_block_table (a state block a row reads)", read.max(axis=1),
                    f"max_block_id={config.max_block_id} (one block pool for every group)")
    check_row_bound(in_batch & (read[:, 0] == NULL_BLOCK_ID), "mamba_block_table (the row's current state block)",
                    read[:, 0], f"the null block {NULL_BLOCK_ID}: allocate its state block first", relation="is")
    if k > 0:
        accepted = host["num_accepted_tokens"].astype(np.int64)
        check_row_bound(in_batch & ((accepted < 1) | (accepted > 1 + k)), "num_accepted_tokens", accepted,
                        f"[1, 1 + num_speculative_tokens={1 + k}]", relation="is outside")
    if hybrid.checkpoints:
        offsets = host["mamba_checkpoint_offsets"].astype(np.int64)
        outside = (offsets < 0) | ((offsets > 0) & (offsets >= scheduled))
        check_row_bound(in_batch & outside, "mamba_checkpoint_offsets", offsets,
                        "[0, num_scheduled_tokens) (a checkpoint lies inside the query)", relation="is outside")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _hybrid_flags(state, config, in_batch) -> list:
    """The bounds of `hybrid.check_hybrid_values`: the state blocks a row reads, accepted counts, checkpoints."""
    hybrid, k = config.features.hybrid, config.features.num_speculative_tokens
    computed, scheduled, table = state.num_computed_tokens, state.num_scheduled_tokens, state.mamba_block_table
    first = jnp.zeros_like(computed)
    if hybrid.mode == "align":
        # C 30, S 4, B 16 -> the block of position 33: column 2
        first = jnp.clip(computed + jnp.maximum(scheduled - 1, 0), 0, INT32_MAX - 1) // hybrid.block_size
    columns = jnp.clip(first[:, None] + jnp.arange(hybrid.num_state_columns, dtype=jnp.int32)[None, :],
                       0, table.shape[1] - 1)
    read = jnp.take_along_axis(table, columns, axis=1, mode="promise_in_bounds")
    outside = jnp.any((read < 0) | (read > config.max_block_id), axis=1)
    flags = [(MAMBA_STATE_BLOCK_INVALID, in_batch & (outside | (read[:, 0] == NULL_BLOCK_ID)))]
    if k > 0:
        accepted = state.num_accepted_tokens
        flags.append((NUM_ACCEPTED_TOKENS_OUT_OF_RANGE, in_batch & ((accepted < 1) | (accepted > 1 + k))))
    if hybrid.checkpoints:
        offsets = state.mamba_checkpoint_offsets
        flags.append((MAMBA_CHECKPOINT_OUT_OF_RANGE,
                      in_batch & ((offsets < 0) | ((offsets > 0) & (offsets >= scheduled)))))
    return flags


def _inputs(features) -> dict[str, str]:
    needs = {"mamba_block_table": "hybrid"}
    if features.spec_decode:
        needs["num_accepted_tokens"] = "hybrid with spec decode"
    if features.hybrid.checkpoints:
        needs["mamba_checkpoint_offsets"] = "hybrid.checkpoints"
    return needs


def _empty_inputs(config) -> dict[str, np.ndarray]:
    """Null state blocks, one accepted token, no checkpoints."""
    features, rows = config.features, config.max_num_reqs
    width = features.hybrid.table_width(config.max_model_len)
    out = {"mamba_block_table": np.full((rows, width), NULL_BLOCK_ID, np.int32)}
    if features.spec_decode:
        out["num_accepted_tokens"] = np.ones((rows,), np.int32)
    if features.hybrid.checkpoints:
        out["mamba_checkpoint_offsets"] = np.zeros((rows,), np.int32)
    return out


def _messages(config) -> dict[int, str]:
    k = config.features.num_speculative_tokens
    return {
        MAMBA_STATE_BLOCK_INVALID: f"mamba_block_table: a state block a scheduled row reads is outside "
                                   f"[0, max_block_id={config.max_block_id}], or its current one is the null block "
                                   f"{NULL_BLOCK_ID}",
        NUM_ACCEPTED_TOKENS_OUT_OF_RANGE: f"num_accepted_tokens of a scheduled row is outside "
                                          f"[1, 1 + num_speculative_tokens={1 + k}]",
        MAMBA_CHECKPOINT_OUT_OF_RANGE: "mamba_checkpoint_offsets of a scheduled row is outside "
                                       "[0, num_scheduled_tokens)",
    }


def _metadata(build) -> None:
    step, layout = build.step, build.layout
    build.outputs["hybrid"] = hybrid_metadata(build.state, step.attn_metadata.query_start_loc, build.config,
                                              HybridRows(layout.rows, layout.scheduled, layout.computed,
                                                         build.drafts, layout.is_real_req), step.num_tokens_padded)


FEATURE = Feature(
    name="hybrid",
    is_on=lambda features: features.hybrid is not None,
    inputs=_inputs,
    empty_inputs=_empty_inputs,
    check_values=check_hybrid_values,
    row_flags=_hybrid_flags,
    messages=_messages,
    metadata=_metadata,
)
