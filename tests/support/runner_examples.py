"""The running example (`support.mrv2_examples`, its table) as the drafter, hybrid, grammar and
micro-batch tests read it (test helper).

The requests sit at their V2 slots 5, 3, 2, 1 as state rows (row 4 holds a live request that is not
scheduled, row 0 is free); ``prefill_len`` is each request's prompt length. vLLM V2 sorts the batch
to ``[r0, r3, r2, r1]``, so ``idx_mapping = [5, 1, 2, 3]``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep import FeatureConfig, PrepConfig, StepInputs
from jaxprep._constants import NULL_BLOCK_ID, PAD_LOGITS_INDEX, PAD_SEQ_LEN, PAD_STATE_ROW
from support.mrv2_examples import REQUESTS, K
from support.mrv2_examples import V2_SLOTS as SLOTS

PROMPTS, OUTPUTS, COMPUTED, SCHEDULED, DRAFTS, _, BLOCKS = (tuple(column) for column in zip(*REQUESTS, strict=True))
IDX_MAPPING = (5, 1, 2, 3)  # batch order r0, r3, r2, r1


def running_config(**features) -> PrepConfig:
    return PrepConfig(max_num_reqs=6, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                      features=FeatureConfig(num_speculative_tokens=K, reorder="v2", **features))


def running_example(config: PrepConfig | None = None) -> dict[str, np.ndarray]:
    """The core tables plus ``num_draft_tokens`` and ``prefill_len`` (vLLM V2 ``prefill_len``)."""
    config = config or running_config()
    rows, width = config.max_num_reqs, config.max_model_len
    token_ids = np.zeros((rows, width), np.int32)
    block_table = np.zeros((rows, config.max_blocks_per_req), np.int32)
    computed, scheduled, drafts, prompts = (np.zeros(rows, np.int32) for _ in range(4))
    for i, slot in enumerate(SLOTS):
        length = PROMPTS[i] + OUTPUTS[i]
        token_ids[slot, :length] = 10 * (i + 1) + np.arange(length)
        token_ids[slot, length:length + len(DRAFTS[i])] = DRAFTS[i]
        block_table[slot, :len(BLOCKS[i])] = BLOCKS[i]
        computed[slot], scheduled[slot], drafts[slot], prompts[slot] = (COMPUTED[i], SCHEDULED[i], len(DRAFTS[i]),
                                                                        PROMPTS[i])
    token_ids[4, :3], computed[4], block_table[4, 0], prompts[4] = (70, 71, 72), 3, 14, 3  # live, unscheduled
    return dict(token_ids=token_ids, block_table=block_table, num_computed_tokens=computed,
                num_scheduled_tokens=scheduled, num_draft_tokens=drafts, prefill_len=prompts)


def with_features(config: PrepConfig, **features) -> PrepConfig:
    return dataclasses.replace(config, features=dataclasses.replace(config.features, **features))


def check_pieces_make_the_step(step: StepInputs) -> None:
    """Token arrays concatenate to the step's; each real request row is the step's row, its seq_len and its
    query restored; every logits index of the step appears in the micro-batch holding its token."""
    meta, batches = step.attn_metadata, step.ubatches.batches
    for name in ("input_ids", "positions"):
        np.testing.assert_array_equal(np.concatenate([np.asarray(getattr(b, name)) for b in batches]),
                                      np.asarray(getattr(step, name)), err_msg=name)
    np.testing.assert_array_equal(np.concatenate([np.asarray(b.attn_metadata.slot_mapping) for b in batches]),
                                  np.asarray(meta.slot_mapping))
    qsl, seq_lens = np.asarray(meta.query_start_loc), np.asarray(meta.seq_lens)
    logits_seen = set()
    for batch, start, first in zip(batches, step.ubatches.token_starts, np.asarray(step.ubatches.first_rows),
                                   strict=True):
        sub, n = batch.attn_metadata, int(batch.attn_metadata.num_reqs)
        rows = first + np.arange(n)
        np.testing.assert_array_equal(np.asarray(batch.idx_mapping)[:n], np.asarray(step.idx_mapping)[rows])
        np.testing.assert_array_equal(np.asarray(sub.block_table)[:n], np.asarray(meta.block_table)[rows])
        sub_qsl = np.asarray(sub.query_start_loc)
        owned_end = np.minimum(qsl[rows + 1], start + batch.num_tokens_padded)
        np.testing.assert_array_equal(sub_qsl[1:n + 1] + start, owned_end)
        assert sub_qsl[0] == 0 and (sub_qsl[n:] == int(sub.num_actual_tokens)).all()
        np.testing.assert_array_equal(np.asarray(sub.seq_lens)[:n], seq_lens[rows] - (qsl[rows + 1] - owned_end))
        ends_here = qsl[rows + 1] == owned_end
        logits = np.asarray(batch.logits_indices)
        logits_seen.update((logits[:n][ends_here] + start).tolist())
        assert (logits[:n][~ends_here] == PAD_LOGITS_INDEX).all() and (logits[n:] == PAD_LOGITS_INDEX).all()
        assert (np.asarray(sub.seq_lens)[n:] == PAD_SEQ_LEN).all() and (np.asarray(batch.idx_mapping)[n:] ==
                                                                         PAD_STATE_ROW).all()
        assert (np.asarray(sub.block_table)[n:] == NULL_BLOCK_ID).all()
    num_reqs = int(meta.num_reqs)
    assert logits_seen == set(np.asarray(step.logits_indices)[:num_reqs].tolist())
