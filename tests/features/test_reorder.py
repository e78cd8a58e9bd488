"""Batch order (docs/semantics.md#batch-order): decode-first and vLLM V2 orders, the mapping back to state rows,
request_distribution."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import FeatureConfig, PrepConfig
from jaxprep.metadata import step_fields
from jaxprep.reference import pad_reference
from jaxprep.reference.requests import batch_order_reference, prepare_reference_ordered, request_distribution_reference
from jaxprep.walkthrough.examples import example_a_config, example_a_step1, example_a_step2, example_b, example_b_config
from support.feature_batches import KERNEL_MODES, RUN_MODES, feature_batches, run_step

V2 = FeatureConfig(reorder="v2")


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_v2_order_of_example_a_step1(mode):
    """docs/semantics.md#v2-order: V2 runs example A step 1 as [r1, r0, r2]."""
    step = run_step(example_a_step1(), dataclasses.replace(example_a_config(), features=V2), mode)
    meta = step.attn_metadata
    assert np.asarray(step.idx_mapping)[:3].tolist() == [1, 0, 2]
    assert np.asarray(step.positions)[:10].tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3, 4]
    assert np.asarray(meta.slot_mapping)[:10].tolist() == [6, 7, 2, 3, 4, 8, 9, 10, 11, 12]
    assert np.asarray(meta.query_start_loc)[:4].tolist() == [0, 2, 5, 10]
    assert np.asarray(meta.seq_lens)[:3].tolist() == [2, 3, 5]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_v2_order_of_example_b(mode):
    """docs/semantics.md#v2-order: example B becomes [r0, r1, r4, r3, r2]."""
    step = run_step(example_b(), dataclasses.replace(example_b_config(), features=V2), mode)
    assert np.asarray(step.idx_mapping)[:5].tolist() == [0, 1, 4, 3, 2]
    assert np.asarray(step.attn_metadata.query_start_loc)[:6].tolist() == [0, 1, 2, 32, 107, 200]
    assert np.asarray(step.attn_metadata.slot_mapping)[:4].tolist() == [70, 225, 416, 417]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_v2_keeps_example_a_step2(mode):
    step = run_step(example_a_step2(), dataclasses.replace(example_a_config(), features=V2), mode)
    assert np.asarray(step.idx_mapping)[:3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_decode_first_example(mode):
    """S [3, 1, 0, 2, 1] -> decodes rows 1 and 4 first, then rows 0 and 3; distribution [2, 2, 4]."""
    config = PrepConfig(max_num_reqs=5, max_model_len=16, max_num_batched_tokens=16, block_size=4,
                        features=FeatureConfig(reorder="decode_first", request_distribution=True))
    arrays = dict(token_ids=np.ones((5, 16), np.int32), block_table=np.ones((5, 4), np.int32),
                  num_computed_tokens=np.array([0, 5, 0, 0, 9], np.int32),
                  num_scheduled_tokens=np.array([3, 1, 0, 2, 1], np.int32))
    step = run_step(arrays, config, mode)
    assert np.asarray(step.idx_mapping).tolist()[:4] == [1, 4, 0, 3]
    assert np.asarray(step.request_distribution).tolist() == [2, 2, 4]


CASES = [FeatureConfig(reorder="decode_first", request_distribution=True),
         FeatureConfig(reorder="v2", request_distribution=True),
         FeatureConfig(reorder="v2", num_speculative_tokens=2, request_distribution=True),
         FeatureConfig(reorder="decode_first", num_speculative_tokens=2, request_distribution=True),
         FeatureConfig(runner="v2", num_speculative_tokens=2, request_distribution=True, logits_indirection=False),
         FeatureConfig(request_distribution=True)]


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("features", CASES, ids=lambda f: f"{f.batch_order}-{f.runner}-k{f.num_speculative_tokens}")
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_reordered_step_matches_reference(mode, features, data):
    config = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=32, block_size=4, features=features)
    k = features.num_speculative_tokens
    arrays = data.draw(feature_batches(config, max_drafts=k))
    drafts = arrays.get("num_draft_tokens", np.zeros(6, np.int32))
    order = batch_order_reference(arrays["num_scheduled_tokens"], drafts, features.batch_order, k, features.runner)
    step = run_step(arrays, config, mode)
    ref = prepare_reference_ordered(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                                    arrays["num_scheduled_tokens"], config.block_size, order)
    want = pad_reference(ref, step.num_tokens_padded, step.num_reqs_padded)
    for name, value in step_fields(step).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    distribution = request_distribution_reference(arrays["num_scheduled_tokens"][order], drafts[order])
    np.testing.assert_array_equal(step.request_distribution, distribution)
    if features.batch_order == "decode_first" or features.batch_order == "v2" and k == 0:  # every decode comes first
        is_decode = arrays["num_scheduled_tokens"][order] == drafts[order] + 1
        assert int(step.request_distribution[0]) == int(is_decode.sum())
