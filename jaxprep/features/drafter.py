"""Inputs of an EAGLE / MTP drafter after verification (docs/semantics.md#drafter).

After the target step samples and verifies, the draft model runs once over the target's tokens
("draft step 0", on the target's attention metadata) and then once per further draft token
("decode" steps, one token per request). vLLM builds their inputs in three Triton kernels of
`vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py`; here they are three jitted
functions, so a drafter runs without a host round trip:

- `draft_prefill` (``_prepare_prefill_inputs_kernel``): the target's ``input_ids`` shifted left by
  one with the next token written after each request's last accepted token, the target's
  positions, ``last_token_indices``, the target's ``query_start_loc`` and ``seq_lens``;
- `draft_decode_start` (``_prepare_decode_inputs_kernel``): step 1, from the first draft token;
- `draft_decode_advance` (``_update_draft_inputs_kernel``): step k -> k + 1.

The target side (``next_prefill_tokens`` and which rows are prefill chunks) is a `FeatureConfig`
switch of the prepared step itself (`DrafterConfig`), read from the batch state once.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import (
    DRAFT_REJECTED_INPUT_ID,
    DRAFT_REJECTED_POSITION,
    PAD_INPUT_ID,
    PAD_LAST_TOKEN_INDEX,
    PAD_NEXT_PREFILL_TOKEN,
    PAD_POSITION,
    PAD_SAMPLE_SRC_POSITION,
    PAD_SEQ_LEN,
)
from jaxprep._ragged import slot_mapping as _slot_mapping
from jaxprep._ragged import take_rows, token_request_index
from jaxprep._typing import Array, Bool, Int32, StepArray
from jaxprep.bounds import InvalidBatchError
from jaxprep.features.discard import discard_request_mask
from jaxprep.features.record import Feature


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class DrafterTargetInputs:
    """What the target step hands its drafter (`StepInputs.drafter`)."""

    # token after this step's last prompt token, for a row still inside its prompt; pad: 0
    next_prefill_tokens: Int32[StepArray, " num_reqs_padded"]
    is_prefill_chunk: Bool[StepArray, " num_reqs_padded"]  # seq_len < prefill_len: nothing sampled; pad: False


@jax.tree_util.register_dataclass
@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """Inputs of draft step 0, on the target's token layout (the target's attention metadata serves)."""

    idx_mapping: Int32[StepArray, " num_reqs_padded"]  # state row per batch row; pad: -1
    input_ids: Int32[StepArray, " num_tokens_padded"]  # shifted; rejected: DRAFT_REJECTED_INPUT_ID; pad: 0
    positions: Int32[StepArray, " num_tokens_padded"]  # target's; rejected: DRAFT_REJECTED_POSITION; pad: 0
    query_start_loc: Int32[StepArray, " num_reqs_padded_plus_1"]  # the target's
    seq_lens: Int32[StepArray, " num_reqs_padded"]  # the target's (not reduced by rejections)
    last_token_indices: Int32[StepArray, " num_reqs_padded"]  # token of each last accepted token; pad: 0
    num_sampled: Int32[StepArray, " num_reqs_padded"]  # 0 for prefill chunks; pad: 0
    num_rejected: Int32[StepArray, " num_reqs_padded"]  # n_b - num_sampled, 0 for prefill chunks; pad: 0
    decode_positions: Int32[StepArray, " num_reqs_padded"]  # position of the last accepted token; pad: 0
    sample_src_positions: Int32[StepArray, " num_reqs_padded"]  # decode_positions + 1; pad: 0


@jax.tree_util.register_dataclass
@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class DraftDecodeInputs:
    """Inputs of one draft decode step: one token per batch row."""

    idx_mapping: Int32[StepArray, " num_reqs_padded"]  # pad: -1
    input_ids: Int32[StepArray, " num_reqs_padded"]  # the previous draft token; pad: 0
    positions: Int32[StepArray, " num_reqs_padded"]  # clamped to max_model_len - 1; pad: 0
    seq_lens: Int32[StepArray, " num_reqs_padded"]  # clamped to max_model_len; pad: 0
    query_start_loc: Int32[StepArray, " num_reqs_padded_plus_1"]  # [0, 1, .., R, R, ..]
    slot_mapping: Int32[StepArray, " num_reqs_padded"]  # KV slot of each token; pad: -1
    sample_src_positions: Int32[StepArray, " num_reqs_padded"]  # the sampling key; pad: 0


def drafter_target_inputs(token_ids, rows, computed, scheduled, prefill_len, is_real_req) -> DrafterTargetInputs:
    """The target side, inside the prepared step (``_prepare_prefill_inputs_kernel`` of the target).

    ```
    # C 4, S 6, prefill_len 20 -> next token at position 10; C 9, S 3, prefill_len 5 -> 0 (a decode)
    ```
    """
    end = computed + scheduled
    inside = is_real_req & (end < prefill_len)
    row = jnp.minimum(rows, token_ids.shape[0] - 1)
    column = jnp.clip(end, 0, token_ids.shape[1] - 1)
    return DrafterTargetInputs(
        next_prefill_tokens=jnp.where(inside, token_ids[row, column], PAD_NEXT_PREFILL_TOKEN),
        is_prefill_chunk=is_real_req & discard_request_mask(computed, scheduled, prefill_len, is_real_req))


def draft_prefill_body(step, num_sampled: Int32[Array, " num_reqs_padded"],
                       last_sampled: Int32[Array, " max_num_reqs"]) -> DraftInputs:
    """Draft step 0's inputs from the verified target step (no jit of its own).

    ``num_sampled[b]``: tokens the rejection sampler accepted for batch row b, bonus included
    (prefill chunks are zeroed here, as vLLM's ``get_num_sampled_and_rejected`` does);
    ``last_sampled[s]``: the last accepted token of state row s.

    ```
    # qsl [0,3,5,6,12], n [3,2,1,1], sampled [2,1,1,0] (row 3 a chunk) -> rejected [1,1,0,0]
    #   q' = S - rejected [2,1,1,6] -> last_token_indices [1,3,5,11]
    ```
    """
    meta, target = step.attn_metadata, step.drafter
    qsl, is_real_req = meta.query_start_loc, step.idx_mapping >= 0
    drafts = step.spec_decode.num_draft_tokens
    sampled = jnp.where(is_real_req & ~target.is_prefill_chunk, num_sampled, 0)
    rejected = jnp.where(is_real_req & ~target.is_prefill_chunk, drafts + 1 - sampled, 0)
    kept = qsl[1:] - qsl[:-1] - rejected  # q'
    last = jnp.where(is_real_req, qsl[:-1] + kept - 1, PAD_LAST_TOKEN_INDEX)
    next_token = jnp.where(sampled > 0, take_rows(last_sampled, step.idx_mapping, fill_value=0),
                           target.next_prefill_tokens)
    input_ids, positions = _shift_tokens(step, qsl, kept, next_token)
    decode_positions = jnp.where(is_real_req, positions[jnp.clip(last, 0, positions.shape[0] - 1)], PAD_POSITION)
    return DraftInputs(idx_mapping=step.idx_mapping, input_ids=input_ids, positions=positions, query_start_loc=qsl,
                       seq_lens=meta.seq_lens, last_token_indices=last, num_sampled=sampled, num_rejected=rejected,
                       decode_positions=decode_positions,
                       sample_src_positions=jnp.where(is_real_req, decode_positions + 1, PAD_SAMPLE_SRC_POSITION))


def _shift_tokens(step, qsl, kept, next_token):
    """Token i of batch row b reads target token i + 1 (i < q' - 1), the next token (i = q' - 1), or
    nothing (a rejected token, i >= q'); positions are the target's for i < q'.

    ```
    # row tokens [19, 50, 51], positions [9, 10, 11], q' 2, next 56 -> [50, 56, ·], [9, 10, ·]
    ```
    """
    num_tokens_padded = step.input_ids.shape[0]
    token = jnp.arange(num_tokens_padded, dtype=jnp.int32)
    is_real_token = token < step.attn_metadata.num_actual_tokens
    owner = token_request_index(qsl[1:], num_tokens_padded)
    local, row_kept = token - qsl[owner], kept[owner]
    following = step.input_ids[jnp.minimum(token + 1, num_tokens_padded - 1)]
    ids = jnp.where(local < row_kept - 1, following, jnp.where(local == row_kept - 1, next_token[owner],
                                                                DRAFT_REJECTED_INPUT_ID))
    positions = jnp.where(local < row_kept, step.positions, DRAFT_REJECTED_POSITION)
    return jnp.where(is_real_token, ids, PAD_INPUT_ID), jnp.where(is_real_token, positions, PAD_POSITION)


def draft_decode_start_body(draft: DraftInputs, draft_tokens: Int32[Array, " num_reqs_padded"], step,
                            config) -> DraftDecodeInputs:
    """Draft step 1 from step 0's sampled ``draft_tokens`` (``_prepare_decode_inputs_kernel``).

    ```
    # pos_d [10, 7, 12, 9], seq_lens [12, 9, 13, 10], rejected [1, 1, 0, 0]
    #   -> positions [11, 8, 13, 10], seq_lens [12, 9, 14, 11], sample_src [12, 9, 14, 11]
    ```
    """
    is_real = draft.idx_mapping >= 0
    seq_lens = jnp.where(is_real, draft.seq_lens - draft.num_rejected, PAD_SEQ_LEN)
    return _decode_inputs(draft.idx_mapping, draft_tokens, draft.decode_positions, seq_lens,
                          draft.sample_src_positions, step, config)


def draft_decode_advance_body(previous: DraftDecodeInputs, draft_tokens: Int32[Array, " num_reqs_padded"], step,
                              config) -> DraftDecodeInputs:
    """Draft step k + 1 from step k's sampled ``draft_tokens`` (``_update_draft_inputs_kernel``)."""
    return _decode_inputs(previous.idx_mapping, draft_tokens, previous.positions, previous.seq_lens,
                          previous.sample_src_positions, step, config)


def _decode_inputs(idx_mapping, draft_tokens, positions, seq_lens, sample_src, step, config) -> DraftDecodeInputs:
    """One decode step: each row feeds its last draft; position and seq_len advance (clamped) unless
    the drafter keeps them (``advance_draft_positions=False``); the sampling key always advances.

    ```
    # R 4 of R_pad 6 -> query_start_loc [0, 1, 2, 3, 4, 4, 4]
    ```
    """
    is_real = idx_mapping >= 0
    if config.features.drafter.advance_draft_positions:
        positions = jnp.minimum(positions + 1, config.max_model_len - 1)
        seq_lens = jnp.minimum(seq_lens + 1, config.max_model_len)
    positions = jnp.where(is_real, positions, PAD_POSITION)
    num_reqs = jnp.sum(is_real, dtype=jnp.int32)
    query_start_loc = jnp.minimum(jnp.arange(idx_mapping.shape[0] + 1, dtype=jnp.int32), num_reqs)
    rows = jnp.arange(idx_mapping.shape[0], dtype=jnp.int32)
    slots = _slot_mapping(step.attn_metadata.block_table, rows, positions, is_real, config.block_size,
                          config.max_block_id)
    return DraftDecodeInputs(
        idx_mapping=idx_mapping, input_ids=jnp.where(is_real, draft_tokens, PAD_INPUT_ID), positions=positions,
        seq_lens=jnp.where(is_real, seq_lens, PAD_SEQ_LEN), query_start_loc=query_start_loc, slot_mapping=slots,
        sample_src_positions=jnp.where(is_real, sample_src + 1, PAD_SAMPLE_SRC_POSITION))


@jax.jit
def draft_prefill(step, num_sampled: Int32[Array, " num_reqs_padded"],
                  last_sampled: Int32[Array, " max_num_reqs"]) -> DraftInputs:
    """`draft_prefill_body`, jitted (one executable per step shape): draft step 0's inputs from the
    verified target ``step``, ``num_sampled`` per batch row and ``last_sampled`` per state row."""
    return draft_prefill_body(step, num_sampled, last_sampled)


@functools.partial(jax.jit, static_argnames=("config",))
def draft_decode_start(draft: DraftInputs, draft_tokens: Int32[Array, " num_reqs_padded"], step,
                       config) -> DraftDecodeInputs:
    """`draft_decode_start_body`, jitted: draft step 1 from step 0's sampled ``draft_tokens``."""
    return draft_decode_start_body(draft, draft_tokens, step, config)


@functools.partial(jax.jit, static_argnames=("config",))
def draft_decode_advance(previous: DraftDecodeInputs, draft_tokens: Int32[Array, " num_reqs_padded"], step,
                         config) -> DraftDecodeInputs:
    """`draft_decode_advance_body`, jitted: draft step k + 1 from step k's sampled ``draft_tokens``."""
    return draft_decode_advance_body(previous, draft_tokens, step, config)


def check_verification(step, num_sampled, last_sampled) -> None:
    """Host check of a verification result before `draft_prefill`; raises `InvalidBatchError`.

    ``num_sampled`` has one entry per batch row, in ``[1, D_b + 1]`` for every row that samples (the
    rejection sampler accepts at least the bonus or the corrected token; prefill chunks may hold
    anything); ``last_sampled`` covers every state row of the batch.
    """
    if step.drafter is None or step.spec_decode is None:
        raise InvalidBatchError("the step has no drafter inputs: prepare it with FeatureConfig.drafter on")
    sampled, rows = np.asarray(num_sampled), np.asarray(step.idx_mapping)
    if sampled.shape != rows.shape:
        raise InvalidBatchError(f"num_sampled has shape {sampled.shape}, expected one entry per batch row {rows.shape}")
    if np.asarray(last_sampled).ndim != 1 or np.asarray(last_sampled).shape[0] <= rows.max(initial=-1):
        raise InvalidBatchError(f"last_sampled has shape {np.asarray(last_sampled).shape}: it needs an entry for "
                                f"every state row of the batch (up to {rows.max(initial=-1)})")
    most = np.asarray(step.spec_decode.num_draft_tokens) + 1
    bad = (rows >= 0) & ~np.asarray(step.drafter.is_prefill_chunk) & ((sampled < 1) | (sampled > most))
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise InvalidBatchError(f"num_sampled at batch row {b} is {int(sampled[b])}, outside [1, num_draft_tokens + 1"
                                f" = {int(most[b])}]: a verified row accepts at least one token and at most all")


def _metadata(build) -> None:
    state, layout = build.state, build.layout
    prefill_len = take_rows(state.prefill_len, layout.rows, fill_value=0)
    build.outputs["drafter"] = drafter_target_inputs(state.token_ids, layout.rows, layout.computed, layout.scheduled,
                                                     prefill_len, layout.is_real_req)


FEATURE = Feature(name="drafter", is_on=lambda features: features.drafter is not None, metadata=_metadata)
"""This feature's record (`jaxprep.features.registry`): no input of its own and no check; `_metadata` adds
its outputs to the step."""
