"""Spec-decode metadata (docs/semantics.md#spec-decode): worked examples, the NumPy reference, invariants, bad
inputs."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, PrepConfig, validate
from jaxprep.features.spec_decode import padded_sizes
from jaxprep.reference import prepare_reference
from jaxprep.reference.requests import spec_decode_reference
from jaxprep.walkthrough.examples import example_a_config, example_a_step2, sequential_block_table
from support.feature_batches import KERNEL_MODES, RUN_MODES, feature_batches, pad, run_step

K = 3
CONFIG = PrepConfig(max_num_reqs=6, max_model_len=64, max_num_batched_tokens=48, block_size=4,
                    features=FeatureConfig(num_speculative_tokens=K))


def spec_fields(step) -> dict:
    return {f.name: np.asarray(getattr(step.spec_decode, f.name)) for f in dataclasses.fields(step.spec_decode)}


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_worked_example_from_source(mode):
    """docs/semantics.md#spec-decode: cu_num_tokens [4,104,107,207,209], D [3,0,2,0,1]."""
    config = PrepConfig(max_num_reqs=5, max_model_len=128, max_num_batched_tokens=256, block_size=16,
                        features=FeatureConfig(num_speculative_tokens=3))
    scheduled = np.array([4, 100, 3, 100, 2], np.int32)
    token_ids = (1000 * np.arange(5)[:, None] + np.arange(128)[None, :]).astype(np.int32)
    arrays = dict(token_ids=token_ids, block_table=sequential_block_table(-(-scheduled // 16), 8),
                  num_computed_tokens=np.zeros(5, np.int32), num_scheduled_tokens=scheduled,
                  num_draft_tokens=np.array([3, 0, 2, 0, 1], np.int32))
    step = run_step(arrays, config, mode)
    spec = spec_fields(step)
    num_logits, num_drafts = int(step.spec_decode.num_logits), int(step.spec_decode.total_num_draft_tokens)
    assert (num_logits, num_drafts, int(spec["max_spec_len"])) == (11, 6, 3)
    assert spec["cu_num_sampled_tokens"].tolist() == [4, 5, 8, 9, 11]
    assert spec["cu_num_draft_tokens"].tolist() == [3, 3, 5, 5, 6]
    assert spec["logits_indices"][:num_logits].tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert spec["target_logits_indices"][:num_drafts].tolist() == [0, 1, 2, 5, 6, 9]
    assert spec["bonus_logits_indices"].tolist() == [3, 4, 7, 8, 10]
    # the drafts are the last D scheduled tokens of each row: token (row r, position p) = 1000 r + p
    assert spec["draft_token_ids"][:num_drafts].tolist() == [1, 2, 3, 2001, 2002, 4001]


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_worked_example_seed_step2(mode):
    """The small example in docs/semantics.md#spec-decode: example A step 2 with 2 drafts on request 2, input_ids
    [14,23,36,37,38]."""
    config = dataclasses.replace(example_a_config(), features=FeatureConfig(num_speculative_tokens=2))
    arrays = example_a_step2()
    arrays["token_ids"][0, 3], arrays["token_ids"][1, 2] = 14, 23
    arrays["token_ids"][2, 5:8] = [36, 37, 38]
    arrays["num_draft_tokens"] = np.array([0, 0, 2], np.int32)
    step = run_step(arrays, config, mode)
    spec = spec_fields(step)
    assert np.asarray(step.input_ids)[:5].tolist() == [14, 23, 36, 37, 38]
    assert spec["logits_indices"][:5].tolist() == [0, 1, 2, 3, 4]
    assert spec["cu_num_sampled_tokens"].tolist() == [1, 2, 5]
    assert spec["cu_num_draft_tokens"].tolist() == [0, 0, 2]
    assert spec["bonus_logits_indices"].tolist() == [0, 1, 4]
    assert spec["target_logits_indices"][:2].tolist() == [2, 3]
    assert spec["draft_token_ids"][:2].tolist() == [37, 38]


def expected_spec(arrays: dict, config, step) -> dict:
    """The reference, padded to the step's static sizes (pads: 0; cumsums repeat their total)."""
    rows = np.flatnonzero(arrays["num_scheduled_tokens"] > 0)
    core = prepare_reference(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                             arrays["num_scheduled_tokens"], config.block_size)
    ref = spec_decode_reference(arrays["num_scheduled_tokens"][rows], arrays["num_draft_tokens"][rows],
                                core["input_ids"])
    num_reqs_padded = step.num_reqs_padded
    num_logits_padded, num_drafts_padded = padded_sizes(step.num_tokens_padded, num_reqs_padded, K)
    for name in ("cu_num_draft_tokens", "cu_num_sampled_tokens"):
        ref[name] = pad(ref[name], num_reqs_padded, ref[name][-1])
    for name in ("num_draft_tokens", "bonus_logits_indices"):
        ref[name] = pad(ref[name], num_reqs_padded, 0)
    ref["logits_indices"] = pad(ref["logits_indices"], num_logits_padded, 0)
    for name in ("target_logits_indices", "draft_token_ids"):
        ref[name] = pad(ref[name], num_drafts_padded, 0)
    return ref


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_spec_decode_matches_reference(mode, data):
    arrays = data.draw(feature_batches(CONFIG, max_drafts=K))
    step = run_step(arrays, CONFIG, mode)
    got = spec_fields(step)
    for name, want in expected_spec(arrays, CONFIG, step).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        assert got[name].dtype == np.int32, name


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_bonus_logit_is_each_requests_last_token(data):
    """Invariants: the bonus logit of a row reads its last token; one logit per draft plus one per row."""
    arrays = data.draw(feature_batches(CONFIG, max_drafts=K))
    step = run_step(arrays, CONFIG, "jit")
    spec = step.spec_decode
    num_reqs = int(step.attn_metadata.num_reqs)
    bonus_tokens = np.asarray(spec.logits_indices)[np.asarray(spec.bonus_logits_indices)[:num_reqs]]
    np.testing.assert_array_equal(bonus_tokens, np.asarray(step.logits_indices)[:num_reqs])
    assert int(spec.num_logits) == int(spec.total_num_draft_tokens) + num_reqs
    drafts = arrays["num_draft_tokens"][arrays["num_scheduled_tokens"] > 0]
    assert (int(spec.total_num_draft_tokens), int(spec.max_spec_len)) == (drafts.sum(), drafts.max())


def draft_batch(**overrides) -> dict:
    arrays = dict(token_ids=np.ones((6, 64), np.int32),
                  block_table=np.arange(1, 6 * 16 + 1, dtype=np.int32).reshape(6, 16),
                  num_computed_tokens=np.array([10, 0, 0, 0, 0, 0], np.int32),
                  num_scheduled_tokens=np.array([3, 0, 0, 0, 0, 0], np.int32),
                  num_draft_tokens=np.array([2, 0, 0, 0, 0, 0], np.int32))
    arrays.update(overrides)
    return arrays


@pytest.mark.parametrize("overrides, message", [
    (dict(num_draft_tokens=np.array([3, 0, 0, 0, 0, 0], np.int32)), "below num_draft_tokens \\+ 1 = 4"),
    (dict(num_scheduled_tokens=np.array([5, 0, 0, 0, 0, 0], np.int32),
          num_draft_tokens=np.array([4, 0, 0, 0, 0, 0], np.int32)), "exceeds num_speculative_tokens=3"),
    (dict(num_draft_tokens=np.array([-1, 0, 0, 0, 0, 0], np.int32)), "num_draft_tokens at row 0 is -1"),
    (dict(num_computed_tokens=np.array([62, 0, 0, 0, 0, 0], np.int32)), "drafts of row 0 reach position 64, past"),
    (dict(num_draft_tokens=None), "num_draft_tokens is missing"),
    (dict(num_draft_tokens=np.zeros(5, np.int32)), "num_draft_tokens has 5 rows"),
])
def test_bad_drafts_are_rejected(overrides, message):
    arrays = draft_batch(**overrides)
    validate(BatchState.from_numpy(**draft_batch()), CONFIG)  # the unmodified batch is valid
    with pytest.raises((InvalidBatchError, ValueError), match=message):
        validate(BatchState.from_numpy(**arrays), CONFIG)
