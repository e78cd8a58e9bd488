"""Adds the outputs of the optional features to a prepared step (inside `prepare_padded`'s jit).

`prepare_padded` builds the plain step and, only if some feature of ``config.features`` is on,
hands it here with the batch layout it computed (`jaxprep._ragged.Layout`). Each feature is one
call into its own module under a static switch; a feature that is off adds nothing to the traced
computation.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxprep._ragged import Layout, slot_mapping, take_rows, token_blocks
from jaxprep._typing import Array, Int32
from jaxprep.bounds import BLOCK_ID_OUT_OF_RANGE, safe_block_table, token_flags
from jaxprep.features.async_tokens import clamp_placeholders, write_prev_tokens
from jaxprep.features.attn_state import attn_state
from jaxprep.features.dcp import dcp_local_seq_lens, dcp_slot_mapping
from jaxprep.features.discard import discard_request_mask
from jaxprep.features.drafter import drafter_target_inputs
from jaxprep.features.flags import KV_GROUP_BLOCK_OUT_OF_RANGE, KV_GROUP_NULL_BLOCK
from jaxprep.features.grammar import grammar_metadata
from jaxprep.features.hybrid import HybridRows, hybrid_metadata
from jaxprep.features.kv_groups import KVGroupMetadata, group_block_table
from jaxprep.features.logits_indirection import logits_indirection
from jaxprep.features.lora import lora_metadata
from jaxprep.features.masks import attn_mask
from jaxprep.features.mrope import mrope_positions
from jaxprep.features.prompt_embeds import prompt_embeds_metadata
from jaxprep.features.reorder import request_distribution
from jaxprep.features.sampling import sampling_metadata
from jaxprep.features.spec_decode import spec_decode_metadata
from jaxprep.features.ubatch import split_step


def with_features(step, state, config, layout: Layout):
    """``step`` with the outputs of every feature that ``config.features`` turns on."""
    features = config.features
    if features.spec_decode:
        drafts = jnp.where(layout.is_real_req, take_rows(state.num_draft_tokens, layout.rows, fill_value=0), 0)
    else:
        drafts = jnp.zeros_like(layout.scheduled)
    updates = _attention_outputs(step, state, config, layout, drafts)
    errors = updates.pop("errors", step.errors)  # the KV groups' block bits join the core word
    unclamped = input_ids = step.input_ids
    if features.async_tokens:
        unclamped = write_prev_tokens(input_ids, layout.rows, step.attn_metadata.query_start_loc,
                                      layout.is_real_req, drafts, state.prev_batch_rows,
                                      state.prev_sampled_token_ids,
                                      state.prev_draft_token_ids if features.spec_decode else None)
    if features.async_tokens or features.spec_decode:
        # vLLM's -1 placeholder drafts (the async scheduler's, and the sync scheduler's pad_spec_decode):
        # read as drafts before the clamp, so never accepted; clamped to 0 in input_ids, as V1's _preprocess
        input_ids = clamp_placeholders(unclamped)
    if features.prompt_embeds:
        updates["prompt_embeds"], input_ids = prompt_embeds_metadata(
            state.is_token_ids, state.prompt_embeds_start, layout.token_rows, step.positions,
            layout.is_real_token, input_ids)
    if features.spec_decode:
        updates["spec_decode"] = spec_decode_metadata(drafts, step.attn_metadata.query_start_loc, layout.is_real_req,
                                                      unclamped,
                                                      features.num_speculative_tokens)
    if features.discard_request_mask:
        prompt = take_rows(state.prefill_len, layout.rows, fill_value=0)
        updates["discard_request_mask"] = discard_request_mask(layout.computed, layout.scheduled, prompt,
                                                               layout.is_real_req)
    if features.mrope:
        updates["mrope_positions"], mrope_errors = mrope_positions(
            state.mrope_positions, state.mrope_position_delta, state.prefill_len, layout.token_rows, step.positions,
            layout.is_real_token)
        errors = errors | mrope_errors
    logits = None  # V2's logits rows: an output, and what structured outputs and the sampling rows read
    if features.logits_indirection_on or features.structured_outputs or features.sampling is not None:
        logits = logits_indirection(step.idx_mapping, drafts, layout.is_real_req, step.attn_metadata.query_start_loc,
                                    step.positions, input_ids, layout.is_real_token, features.num_speculative_tokens)
    updates.update(_mrv2_outputs(state, features, layout, drafts, step.attn_metadata.query_start_loc, logits,
                                 step.idx_mapping))
    updates.update(_runner_outputs(step, state, config, layout, drafts, logits))
    step = dataclasses.replace(step, input_ids=input_ids, errors=errors, **updates)
    if features.num_ubatches > 1:  # last: it splits the finished step
        step = dataclasses.replace(step, ubatches=split_step(step, features.num_ubatches))
    return step


def _runner_outputs(step, state, config, layout: Layout, drafts, logits) -> dict:
    """Drafter, hybrid-model and structured-output metadata (vLLM's model runners compute them per step)."""
    features, out = config.features, {}
    if features.drafter is not None:
        prefill_len = take_rows(state.prefill_len, layout.rows, fill_value=0)
        out["drafter"] = drafter_target_inputs(state.token_ids, layout.rows, layout.computed, layout.scheduled,
                                               prefill_len, layout.is_real_req)
    if features.hybrid is not None:
        out["hybrid"] = hybrid_metadata(state, step.attn_metadata.query_start_loc, config,
                                        HybridRows(layout.rows, layout.scheduled, layout.computed, drafts,
                                                   layout.is_real_req), step.num_tokens_padded)
    if features.structured_outputs:
        out["grammar"] = grammar_metadata(state.grammar_index, step.idx_mapping, logits,
                                          1 + features.num_speculative_tokens)
    return out


def _mrv2_outputs(state, features, layout: Layout, drafts, query_start_loc, logits, idx_mapping) -> dict:
    """LoRA, V2's logits indirection and the sampling rows (built from the final ``input_ids``)."""
    out = {}
    if features.lora is not None:
        out["lora"] = lora_metadata(state.lora_ids, state.lora_slots, layout.rows, layout.is_real_req, drafts,
                                    layout.token_rows, layout.is_real_token, query_start_loc, features)
    if features.logits_indirection_on:
        out["logits_indirection"] = logits
    if features.sampling is not None:
        out["sampling"] = sampling_metadata(state, idx_mapping, layout.is_real_req, logits,
                                            features.sampling.vocab_size)
    return out


def _attention_outputs(step, state, config, layout: Layout, drafts) -> dict:
    """Attention-side features: DCP, KV groups, attention state and mask, request distribution."""
    features = config.features
    meta = step.attn_metadata
    out = {}
    if features.dcp is not None:
        meta = dataclasses.replace(
            meta,
            slot_mapping=dcp_slot_mapping(state.block_table, layout.token_rows, step.positions, layout.is_real_token,
                                          config.block_size, features.dcp, config.max_block_id),
            dcp_local_seq_lens=dcp_local_seq_lens(meta.seq_lens, layout.is_real_req, features.dcp))
    if features.kv_groups:
        out["kv_groups"], out["errors"] = _kv_groups(step, state, config, layout)
    if features.attn_state:
        out["attn_state"] = attn_state(layout.computed, layout.scheduled, drafts, layout.is_real_req, features)
    if features.attn_mask:
        out["attn_mask"] = attn_mask(step.positions, features.attn_mask, features.mask_columns(config),
                                     features.attn_mask_dtype)
    if features.request_distribution:
        out["request_distribution"] = request_distribution(layout.scheduled, drafts, layout.is_real_req)
    out["attn_metadata"] = meta
    return out


def _kv_groups(step, state, config, layout: Layout) -> tuple[tuple[KVGroupMetadata, ...], Int32[Array, ""]]:
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
