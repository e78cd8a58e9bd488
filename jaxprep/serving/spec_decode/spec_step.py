"""Speculative decoding inside `serve_step` (docs/semantics.md#spec-decode-loop): one forward pass that
scores every scheduled draft, greedy verification, the roll-back of rejected drafts, and the n-gram
drafts of the next step.

A row with ``D`` drafts runs ``D + 1`` tokens (its last known token and the drafts, already in the
token table after ``num_tokens``); the model's logits are taken at the spec-decode metadata's
``logits_indices`` (``D + 1`` per row); `greedy_verify` keeps the accepted drafts and adds one
token; `record_sampled_body` appends them and advances ``num_computed_tokens`` past the accepted
tokens only, so the next step recomputes (and rewrites the KV of) the first rejected position.
Rejected draft ids are cleared from the token table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxprep._ragged import take_rows
from jaxprep.features.logits_indirection import logits_indirection
from jaxprep.features.sampling import sampling_metadata
from jaxprep.features.spec_decode import spec_decode_metadata
from jaxprep.models.tiny import ServingModel
from jaxprep.prepare import prepare_padded
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.device_state import Cells
from jaxprep.serving.sample.sampler import check_vocab, row_keys, row_probabilities
from jaxprep.serving.spec_decode.ngram import propose_ngram
from jaxprep.serving.spec_decode.verify import PLACEHOLDER, greedy_verify, rejection_verify_rows
from jaxprep.serving.state import ServingState
from jaxprep.serving.transitions import Recorded, record_rows, row_index


def forward_verify_record(state: ServingState, kv_cache, params, config: ServingConfig, model: ServingModel,
                          num_tokens_padded: int):
    """prepare -> model at every draft position -> greedy verification -> record.

    Returns ``(state, kv_cache, tokens [K + 1, max_num_reqs])``: the tokens each state row appended
    (accepted drafts, then the replacement or bonus token), PLACEHOLDER past them and on rows that
    appended nothing.
    """
    k = config.num_speculative_tokens
    inputs = prepare_padded(state.batch, config.prep, num_tokens_padded)
    num_rows = state.num_tokens.shape[0]
    rows = row_index(inputs.idx_mapping, num_rows)
    meta = spec_decode_metadata(take_rows(state.num_draft_tokens, rows, fill_value=0),
                                inputs.attn_metadata.query_start_loc, inputs.idx_mapping >= 0,
                                inputs.input_ids, k)
    # logits at every sampled position (D + 1 per row) instead of one per row
    kv_cache, logits = model.forward(params, kv_cache, dataclasses.replace(inputs, logits_indices=meta.logits_indices),
                                     block_size=config.block_size, max_model_len=config.max_model_len)
    output, num_sampled = _verify(logits, inputs, meta, state, config)
    output, num_sampled = _cut_at_stop(state, rows, output, num_sampled, config.eos_token_id)
    state, recorded = record_rows(state, inputs.idx_mapping, output, num_sampled)
    state = _clear_rejected(state, recorded, k)
    kept = jnp.where((recorded.num_appended > 0)[:, None], output, PLACEHOLDER)
    return state, kv_cache, jnp.full((num_rows, k + 1), PLACEHOLDER, jnp.int32).at[rows].set(kept, mode="drop").T


def _verify(logits, inputs, meta, state: ServingState, config: ServingConfig):
    """Greedy verification, or rejection sampling against each row's sampling distribution when
    the requests carry sampling parameters (`FeatureConfig.sampling`); a greedy request's
    distribution is one-hot at its (penalized) argmax, so rejection sampling keeps exactly the
    drafts greedy verification keeps. Each batch row draws from the key of its first logits row
    (``fold_in(key(seed), position)``): reproducible whatever the row's neighbours."""
    k = config.num_speculative_tokens
    if config.prep.features.sampling is None:
        return greedy_verify(jnp.argmax(logits, axis=-1).astype(jnp.int32), meta, k)
    check_vocab(logits, state.batch)
    rows = _draft_sampling_rows(inputs, meta, state, config)
    probs = row_probabilities(logits, rows, state.batch)
    # batch row b's first logits row: bonus_logits_indices[b] - D_b
    first = jnp.clip(meta.bonus_logits_indices - meta.num_draft_tokens, 0, probs.shape[0] - 1)
    return rejection_verify_rows(probs, meta, k, row_keys(rows)[first])


def _draft_sampling_rows(inputs, meta, state: ServingState, config: ServingConfig):
    """The sampling rows of every verified logits row (D + 1 per batch row, in ``meta``'s order):
    the step's own `StepInputs.sampling` has one row per request, since the serving loop's drafts
    are the serving config's, not a `FeatureConfig.num_speculative_tokens` of its preparation."""
    num_tokens_padded = inputs.positions.shape[0]
    is_real_req = inputs.idx_mapping >= 0
    is_real_token = jnp.arange(num_tokens_padded, dtype=jnp.int32) < inputs.attn_metadata.query_start_loc[-1]
    indirection = logits_indirection(inputs.idx_mapping, meta.num_draft_tokens, is_real_req,
                                     inputs.attn_metadata.query_start_loc, inputs.positions, inputs.input_ids,
                                     is_real_token, config.num_speculative_tokens)
    return sampling_metadata(state.batch, inputs.idx_mapping, is_real_req, indirection,
                             config.prep.features.sampling.vocab_size)


def _cut_at_stop(state: ServingState, rows, output, num_sampled, eos_token_id: int):
    """Drops the sampled tokens after the request's stop: after an EOS, and past ``stop_len``.

    ```
    # num_tokens 10, stop_len 12, output [4, 1(EOS), 6, -1], n 3 -> n 2, [4, 1, -1, -1]
    ```
    """
    slot = jnp.arange(output.shape[1], dtype=jnp.int32)[None, :]
    is_eos = (output == eos_token_id) & (slot < num_sampled[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1).astype(jnp.int32) + 1, num_sampled)
    room = take_rows(state.stop_len, rows, fill_value=0) - take_rows(state.num_tokens, rows, fill_value=0)
    kept = jnp.clip(jnp.minimum(jnp.minimum(num_sampled, first_eos), room), 0, None)
    return jnp.where(slot < kept[:, None], output, PLACEHOLDER), kept


def _clear_rejected(state: ServingState, recorded: Recorded, k: int):
    """Zeroes the token-table entries of each batch row from its new ``num_tokens`` to the old end of its drafts
    (at most K per row: one scatter of cells).

    ```
    # num_tokens 5 -> 7 after 3 drafts (old end 8): token_ids[row, 7] = 0
    ```
    """
    new_end = recorded.num_tokens_before + recorded.num_appended
    old_end = recorded.num_tokens_before + recorded.num_draft_tokens  # one past the last draft in the table
    span = new_end[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    return state.write_cells([Cells("token_ids", recorded.rows[:, None], 0,
                                    jnp.where(span < old_end[:, None], span, -1))])


def next_drafts(state: ServingState, appended, config: ServingConfig):
    """The drafts of the next step, [K, max_num_reqs] (PLACEHOLDER past a row's count): n-gram
    lookups of the rows that appended a token in this dispatch and did not stop."""
    k = config.num_speculative_tokens
    if config.ngram is None:
        return jnp.full((k,) + state.num_tokens.shape, PLACEHOLDER, jnp.int32)
    width = state.batch.token_ids.shape[1]
    last = jnp.take_along_axis(state.batch.token_ids, jnp.clip(state.num_tokens - 1, 0, width - 1)[:, None],
                               axis=1, mode="promise_in_bounds")[:, 0]
    active = appended & (state.num_tokens < state.stop_len) & (last != config.eos_token_id)
    drafts, _ = propose_ngram(state.batch.token_ids, state.num_tokens, active, k=k, config=config.ngram,
                              max_model_len=config.max_model_len)
    return drafts.T

