"""Which requests are sampled (docs/semantics.md#logits-indices): the discard mask of partial prefills."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, PrepConfig, validate
from jaxprep.reference.requests import discard_request_mask_reference
from jaxprep.walkthrough.examples import example_a_config, example_a_step1
from support.feature_batches import RUN_MODES, batch_rows, feature_batches, pad, run_step

FEATURES = FeatureConfig(discard_request_mask=True)
CONFIG = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=32, block_size=4, features=FEATURES)


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("prompts, expected", [([3, 2, 5], [False, False, False]), ([3, 2, 8], [False, False, True])])
def test_worked_example_a_step1(mode, prompts, expected):
    """docs/semantics.md#examples: prompts 3, 2, 5 are whole prefills; a prompt of 8 makes request 2 a chunk
    (docs/semantics.md#two-histories)."""
    config = dataclasses.replace(example_a_config(), features=FEATURES)
    arrays = dict(example_a_step1(), prefill_len=np.array(prompts, np.int32))
    step = run_step(arrays, config, mode)
    assert np.asarray(step.discard_request_mask).tolist() == expected + [True] * (step.num_reqs_padded - 3)


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_discard_mask_matches_reference(mode, data):
    arrays = data.draw(feature_batches(CONFIG))
    step = run_step(arrays, CONFIG, mode)
    rows = batch_rows(arrays)
    want = discard_request_mask_reference(arrays["num_computed_tokens"][rows], arrays["num_scheduled_tokens"][rows],
                                          arrays["prefill_len"][rows])
    got = np.asarray(step.discard_request_mask)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, pad(want, step.num_reqs_padded, True))


@pytest.mark.parametrize("prompts, message", [
    (None, "prefill_len is missing: FeatureConfig.discard_request_mask needs it"),
    ([5, -1, 0, 0, 0, 0], "prefill_len at row 1 is -1, which is outside \\[0, max_model_len=40\\]"),
    ([5, 41, 0, 0, 0, 0], "prefill_len at row 1 is 41"),
])
def test_bad_prompt_lengths_are_rejected(prompts, message):
    arrays = dict(token_ids=np.ones((6, 40), np.int32), block_table=np.ones((6, 16), np.int32),
                  num_computed_tokens=np.zeros(6, np.int32),
                  num_scheduled_tokens=np.array([4, 0, 0, 0, 0, 0], np.int32),
                  prefill_len=None if prompts is None else np.array(prompts, np.int32))
    with pytest.raises(InvalidBatchError, match=message):
        validate(BatchState.from_numpy(**arrays), CONFIG)
