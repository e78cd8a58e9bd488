"""Micro-batching (dual-batch overlap, docs/semantics.md#micro-batches): a padded step split into complete steps.

vLLM's rule (`vllm/v1/worker/ubatch_utils.py::maybe_create_ubatch_slices`, V2
``gpu/ubatch_utils.py::create_ubatch_slices`` and ``_slice_input_batch``): the padded tokens are
cut into ``n`` equal token ranges (``T_pad // n`` each, the last one takes the rest), so every
micro-batch has a static token count. A micro-batch holds the requests whose tokens overlap its
range; a request straddling a cut appears in both, its query truncated to the tokens each one
owns: ``query_start_loc`` is rebased to 0 and clamped into the range, and the first part's
``seq_lens`` drops the tokens that lie past the cut (the second part keeps its full length: the
first part's tokens are computed before it reads them).

Each micro-batch is a `StepInputs` of its own (input ids, positions, slot mapping, block-table
rows, ``idx_mapping``, ``logits_indices``, ``query_start_loc``, ``seq_lens``), with
``min(R_pad, T_u)`` request rows. Its ``logits_indices`` name the last token of each request that
ends inside it; the first part of a straddling request has none (`PAD_LOGITS_INDEX`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxprep._constants import NULL_BLOCK_ID, PAD_LOGITS_INDEX, PAD_SEQ_LEN, PAD_STATE_ROW
from jaxprep.features.record import Feature
from jaxprep.metadata import AttentionMetadata, MicroBatches, StepInputs


def token_ranges(num_tokens_padded: int, num_ubatches: int) -> tuple[tuple[int, int], ...]:
    """Static ``[start, end)`` of each micro-batch: cuts at multiples of ``T_pad // n``.

    ```
    # T_pad 16, n 2 -> ((0, 8), (8, 16)); T_pad 10, n 3 -> ((0, 3), (3, 6), (6, 10))
    ```
    """
    size = num_tokens_padded // num_ubatches
    return tuple((u * size, num_tokens_padded if u == num_ubatches - 1 else (u + 1) * size)
                 for u in range(num_ubatches))


def split_step(step: StepInputs, num_ubatches: int) -> MicroBatches:
    """The micro-batches of ``step`` (inside `prepare_padded`'s jit)."""
    num_tokens = step.attn_metadata.num_actual_tokens
    batches, first_rows = [], []
    for start, end in token_ranges(step.num_tokens_padded, num_ubatches):
        batch, first = _micro_batch(step, start, end)
        batches.append(batch)
        first_rows.append(first)
    last_start = token_ranges(step.num_tokens_padded, num_ubatches)[-1][0]
    return MicroBatches(batches=tuple(batches), first_rows=jnp.stack(first_rows), should_ubatch=last_start < num_tokens)


def _micro_batch(step: StepInputs, start: int, end: int):
    """``(StepInputs of tokens [start, end), its first batch row)``.

    ```
    # qsl [0, 3, 5, 6, 12], tokens [0, 8) -> rows 0..3, qsl [0, 3, 5, 6, 8], seq_lens [12, 9, 13, 10 - 4]
    #                        tokens [8, 16) -> row 3 only, qsl [0, 4, 4, ..], seq_lens [10, 0, ..]
    ```
    """
    meta, num_tokens_padded = step.attn_metadata, end - start
    num_reqs_padded = min(step.num_reqs_padded, num_tokens_padded)
    qsl, ends = meta.query_start_loc, meta.query_start_loc[1:]
    num_tokens = jnp.clip(meta.num_actual_tokens - start, 0, num_tokens_padded)
    first = jnp.sum(ends <= start, dtype=jnp.int32)  # the request holding token `start`
    last = jnp.sum(ends <= start + num_tokens - 1, dtype=jnp.int32)  # ... and its last real token
    num_reqs = jnp.where(num_tokens > 0, last - first + 1, 0)
    row = jnp.arange(num_reqs_padded, dtype=jnp.int32)
    is_real = row < num_reqs
    source = jnp.minimum(first + row, step.num_reqs_padded - 1)
    query_start_loc = jnp.clip(qsl[jnp.minimum(first + jnp.arange(num_reqs_padded + 1, dtype=jnp.int32),
                                               step.num_reqs_padded)] - start, 0, num_tokens)
    truncated = jnp.maximum(ends[source] - end, 0)  # tokens past the cut (only the last request has any)
    seq_lens = jnp.where(is_real, meta.seq_lens[source] - truncated, PAD_SEQ_LEN)
    ends_here = is_real & (ends[source] <= end)
    sub = AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, slot_mapping=meta.slot_mapping[start:end],
        block_table=jnp.where(is_real[:, None], meta.block_table[source], NULL_BLOCK_ID),
        num_actual_tokens=num_tokens, num_reqs=num_reqs,
        max_query_len=jnp.max(query_start_loc[1:] - query_start_loc[:-1]), max_seq_len=jnp.max(seq_lens))
    batch = StepInputs(
        input_ids=step.input_ids[start:end], positions=step.positions[start:end],
        logits_indices=jnp.where(ends_here, ends[source] - 1 - start, PAD_LOGITS_INDEX),
        idx_mapping=jnp.where(is_real, step.idx_mapping[source], PAD_STATE_ROW), attn_metadata=sub,
        errors=step.errors, num_tokens_padded=num_tokens_padded)
    return batch, jnp.where(num_reqs > 0, first, 0)


def _metadata(build) -> None:
    """Last in `jaxprep.features.registry.STEP_ORDER`: it splits the finished step."""
    build.outputs["ubatches"] = split_step(build.finish(), build.config.features.num_ubatches)


FEATURE = Feature(name="ubatch", is_on=lambda features: features.num_ubatches > 1, metadata=_metadata)
"""This feature's record (`jaxprep.features.registry`): no input of its own and no check; `_metadata` adds
its outputs to the step."""
