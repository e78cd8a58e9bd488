"""The padding contract: every padded entry holds its named constant, on every bucket."""

import chex
import numpy as np
import pytest

import jaxprep
from jaxprep import BatchState, prepare_padded
from jaxprep.walkthrough.examples import example_b, example_b_config
from support.kernels import on_kernel


def test_padding_constants_have_vllm_values():
    assert (jaxprep.PAD_SLOT_ID, jaxprep.NULL_BLOCK_ID, jaxprep.PAD_POSITION, jaxprep.PAD_INPUT_ID) == (-1, 0, 0, 0)
    assert (jaxprep.PAD_SEQ_LEN, jaxprep.PAD_STATE_ROW) == (0, -1)


@pytest.mark.parametrize("kernel, bucket", [("xla", 8), ("xla", 16), ("xla", 64), ("xla", 96), ("xla", 200),
                                            ("pallas", 8), ("pallas", 200)])
def test_padded_tail_holds_pad_constants(kernel, bucket):
    """Example B cut to its first rows fits each bucket; everything past the batch is padding."""
    config = on_kernel(example_b_config(), kernel)
    arrays = example_b()
    scheduled = arrays["num_scheduled_tokens"].copy()
    keep = np.cumsum(scheduled) <= bucket
    scheduled[~keep] = 0
    arrays["num_scheduled_tokens"] = scheduled
    num_tokens, num_reqs = int(scheduled.sum()), int(keep.sum())
    step = prepare_padded(BatchState.from_numpy(**arrays), config, bucket)
    meta = step.attn_metadata
    num_reqs_padded = min(bucket, config.max_num_reqs)
    chex.assert_shape([step.input_ids, step.positions, meta.slot_mapping], (bucket,))
    chex.assert_shape([step.idx_mapping, step.logits_indices, meta.seq_lens], (num_reqs_padded,))
    chex.assert_shape(meta.query_start_loc, (num_reqs_padded + 1,))
    chex.assert_shape(meta.block_table, (num_reqs_padded, config.max_blocks_per_req))
    assert int(meta.num_actual_tokens) == num_tokens and int(meta.num_reqs) == num_reqs
    assert (np.asarray(meta.slot_mapping[num_tokens:]) == jaxprep.PAD_SLOT_ID).all()
    assert (np.asarray(step.positions[num_tokens:]) == jaxprep.PAD_POSITION).all()
    assert (np.asarray(step.input_ids[num_tokens:]) == jaxprep.PAD_INPUT_ID).all()
    assert (np.asarray(meta.query_start_loc[num_reqs + 1:]) == num_tokens).all()
    assert (np.asarray(meta.seq_lens[num_reqs:]) == jaxprep.PAD_SEQ_LEN).all()
    assert (np.asarray(meta.block_table[num_reqs:]) == jaxprep.NULL_BLOCK_ID).all()
    assert (np.asarray(step.idx_mapping[num_reqs:]) == jaxprep.PAD_STATE_ROW).all()
    assert (np.asarray(step.logits_indices[num_reqs:]) == jaxprep.PAD_LOGITS_INDEX).all()


def test_query_start_loc_never_decreases(kernel):
    config = on_kernel(example_b_config(), kernel)
    step = prepare_padded(BatchState.from_numpy(**example_b()), config, 200)
    assert (np.diff(np.asarray(step.attn_metadata.query_start_loc)) >= 0).all()


def test_every_real_slot_lies_in_its_requests_blocks(kernel):
    config = on_kernel(example_b_config(), kernel)
    arrays = example_b()
    step = prepare_padded(BatchState.from_numpy(**arrays), config, 200)
    slots = np.asarray(step.attn_metadata.slot_mapping)
    qsl = np.asarray(step.attn_metadata.query_start_loc)
    for batch_row, state_row in enumerate(np.asarray(step.idx_mapping)):
        blocks = set(slots[qsl[batch_row]:qsl[batch_row + 1]] // config.block_size)
        assert blocks <= set(arrays["block_table"][state_row]) - {0}
