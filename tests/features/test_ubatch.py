"""Micro-batching: vLLM's split rule, each micro-batch a complete step, the pieces together the whole step."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import FeatureConfig, PrepConfig
from jaxprep.features.ubatch import token_ranges
from jaxprep.reference.ubatch import slice_step_reference, ubatch_slices_reference
from support.feature_batches import RUN_MODES, feature_batches, run_step
from support.runner_examples import check_pieces_make_the_step, running_config, running_example


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example_two_ubatches(mode):
    """16 padded tokens cut at 8: r0, r3, r2 and r1's first two tokens, then r1's last four."""
    config = running_config(num_ubatches=2)
    step = run_step(running_example(config), config, mode)
    first, second = step.ubatches.batches
    assert (first.num_tokens_padded, second.num_tokens_padded) == (8, 8)
    assert np.asarray(first.attn_metadata.query_start_loc).tolist() == [0, 3, 5, 6, 8, 8, 8]
    assert np.asarray(first.attn_metadata.seq_lens).tolist() == [12, 9, 13, 6, 0, 0]  # r1: 10 - 4 past the cut
    assert np.asarray(first.idx_mapping).tolist() == [5, 1, 2, 3, -1, -1]
    assert np.asarray(first.logits_indices).tolist() == [2, 4, 5, 0, 0, 0]  # r1 does not end here
    assert np.asarray(second.attn_metadata.query_start_loc).tolist() == [0, 4, 4, 4, 4, 4, 4]
    assert np.asarray(second.attn_metadata.seq_lens).tolist() == [10, 0, 0, 0, 0, 0]
    assert np.asarray(second.idx_mapping).tolist() == [3, -1, -1, -1, -1, -1]
    assert np.asarray(second.logits_indices).tolist() == [3, 0, 0, 0, 0, 0]
    assert np.asarray(second.input_ids).tolist() == [26, 27, 28, 29, 0, 0, 0, 0]
    assert np.asarray(second.attn_metadata.slot_mapping).tolist() == [22, 23, 24, 25, -1, -1, -1, -1]
    assert (int(first.attn_metadata.num_reqs), int(second.attn_metadata.num_reqs)) == (4, 1)
    assert (int(first.attn_metadata.max_query_len), int(second.attn_metadata.max_query_len)) == (3, 4)
    assert np.asarray(step.ubatches.first_rows).tolist() == [0, 3] and bool(step.ubatches.should_ubatch)
    assert step.ubatches.token_starts == (0, 8)


def test_token_ranges():
    assert token_ranges(16, 2) == ((0, 8), (8, 16))
    assert token_ranges(10, 3) == ((0, 3), (3, 6), (6, 10))


CONFIG = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=32, block_size=4,
                    token_buckets=(8, 12, 20, 32), features=FeatureConfig(num_ubatches=2))


@pytest.mark.parametrize("num_ubatches", [2, 3])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_pieces_make_the_step_and_match_vllms_slices(num_ubatches, data):
    config = dataclasses.replace(CONFIG, features=FeatureConfig(num_ubatches=num_ubatches))
    arrays = data.draw(feature_batches(config))
    step = run_step(arrays, config, data.draw(st.sampled_from(["jit", "eager"])) if num_ubatches == 2 else "jit")
    check_pieces_make_the_step(step)
    meta, num_tokens = step.attn_metadata, int(step.attn_metadata.num_actual_tokens)
    assert bool(step.ubatches.should_ubatch) == (token_ranges(step.num_tokens_padded, num_ubatches)[-1][0]
                                                 < num_tokens)
    if not bool(step.ubatches.should_ubatch):
        return  # vLLM runs such a step whole
    scheduled = arrays["num_scheduled_tokens"][np.asarray(step.idx_mapping)[: int(meta.num_reqs)]]
    slices = ubatch_slices_reference(scheduled, step.num_tokens_padded, step.num_reqs_padded, num_ubatches)
    for batch, (a, b, c, d) in zip(step.ubatches.batches, slices, strict=True):
        want = slice_step_reference(np.asarray(meta.query_start_loc), np.asarray(meta.seq_lens), int(meta.num_reqs),
                                    num_tokens, a, b, c, d)
        sub = batch.attn_metadata
        n = min(len(want["seq_lens"]), batch.num_reqs_padded)  # vLLM's last slice keeps every padded row
        assert (int(sub.num_reqs), int(sub.num_actual_tokens)) == (want["num_reqs"], want["num_tokens"])
        np.testing.assert_array_equal(np.asarray(sub.query_start_loc)[:n + 1], want["query_start_loc"][:n + 1])
        np.testing.assert_array_equal(np.asarray(sub.seq_lens)[:n], want["seq_lens"][:n])


def test_empty_trailing_ubatch_has_no_requests():
    """A step whose tokens all fit the first micro-batch: vLLM would not micro-batch it (should_ubatch False);
    here the second one is all padding."""
    config = running_config(num_ubatches=2)
    arrays = running_example(config)
    arrays["num_scheduled_tokens"][3] = 0  # drop r1: 6 tokens, padded to 16, cut at 8
    step = run_step(arrays, config, "jit", num_tokens_padded=16)
    assert not bool(step.ubatches.should_ubatch)
    second = step.ubatches.batches[1]
    assert int(second.attn_metadata.num_reqs) == 0 and int(second.attn_metadata.num_actual_tokens) == 0
    check_pieces_make_the_step(step)


def test_smallest_bucket_must_hold_a_token_per_ubatch():
    with pytest.raises(ValueError, match="num_ubatches=3 exceeds the smallest token bucket 2"):
        PrepConfig(max_num_reqs=2, max_model_len=8, max_num_batched_tokens=8, block_size=4, token_buckets=(2, 8),
                   features=FeatureConfig(num_ubatches=3))


def test_micro_batches_are_steps_that_the_bridge_can_move():
    """Each micro-batch is a StepInputs: jax.tree_util sees its arrays, and shapes are static."""
    config = running_config(num_ubatches=2)
    step = run_step(running_example(config), config, "jit")
    shapes = [leaf.shape for leaf in jax.tree_util.tree_leaves(step.ubatches.batches[0])]
    assert (8,) in shapes and (6, config.max_blocks_per_req) in shapes
