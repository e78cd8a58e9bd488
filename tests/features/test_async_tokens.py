"""Async scheduling (docs/semantics.md#async-scheduling): last step's sampled and draft tokens written into input_ids on
the device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, PrepConfig, prepare_padded, validate
from jaxprep.features.async_tokens import prev_batch_rows_from_step
from jaxprep.reference import prepare_reference
from jaxprep.reference.requests import async_input_ids_reference
from support.feature_batches import RUN_MODES, batch_rows, feature_batches, pad, run_step

K = 2
CONFIG = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=32, block_size=4,
                    features=FeatureConfig(async_tokens=True, num_speculative_tokens=K))
SAMPLED = np.array([501, 502, 503, 0, 0], np.int32)  # last step's sampled ids per batch row (row 2 discarded)


def section_2_9_example() -> dict:
    """This step's batch is [r1, r0, r2] (state rows 0, 1, 2); last step's was [r0, r1, r2], r2 discarded.

    r1 and r0 decode at positions 4 and 6, where the host's table holds the placeholder -1; r2
    prefills its next 3 prompt tokens.
    """
    token_ids = np.zeros((5, 12), np.int32)
    token_ids[0, :5] = [11, 12, 13, 14, -1]  # r1
    token_ids[1, :7] = [21, 22, 23, 24, 25, 26, -1]  # r0
    token_ids[2, :8] = [31, 32, 33, 34, 35, 36, 37, 38]  # r2
    return dict(token_ids=token_ids, block_table=np.arange(1, 5 * 64 + 1, dtype=np.int32).reshape(5, 64),
                num_computed_tokens=np.array([4, 6, 3, 0, 0], np.int32),
                num_scheduled_tokens=np.array([1, 1, 3, 0, 0], np.int32),
                prev_sampled_token_ids=SAMPLED, prev_batch_rows=np.array([1, 0, -1, -1, -1], np.int32))


@pytest.mark.parametrize("mode", RUN_MODES)
def test_section_2_9_example(mode):
    """prev_positions [1, 0, -1]: input_ids[0] = prev[1], input_ids[1] = prev[0]; r2's ids come from the table."""
    config = PrepConfig(max_num_reqs=5, max_model_len=12, max_num_batched_tokens=8, block_size=2,
                        features=FeatureConfig(async_tokens=True))
    step = run_step(section_2_9_example(), config, mode)
    assert np.asarray(step.input_ids).tolist() == [502, 501, 34, 35, 36, 0, 0, 0]


def random_async_batch(data, config) -> dict:
    """A batch whose decode rows were sampled last step: their sampled token and drafts are placeholders."""
    arrays = data.draw(feature_batches(config, max_drafts=K))
    rows, scheduled, drafts = config.max_num_reqs, arrays["num_scheduled_tokens"], arrays["num_draft_tokens"]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**20)))
    prev_rows = np.full(rows, -1, np.int32)
    is_decode = (scheduled > 0) & (scheduled == drafts + 1) & (rng.random(rows) < 0.8)
    prev_rows[is_decode] = rng.permutation(rows)[: is_decode.sum()]
    for row in np.flatnonzero(is_decode):  # the host does not know these ids yet
        start = arrays["num_computed_tokens"][row]
        arrays["token_ids"][row, start: start + scheduled[row]] = -1
    return dict(arrays, prev_batch_rows=prev_rows,
                prev_sampled_token_ids=rng.integers(1, 1000, rows).astype(np.int32),
                prev_draft_token_ids=rng.integers(1000, 2000, (rows, K)).astype(np.int32))


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_async_input_ids_match_reference(mode, data):
    arrays = random_async_batch(data, CONFIG)
    step = run_step(arrays, CONFIG, mode)
    rows = batch_rows(arrays)
    core = prepare_reference(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                             arrays["num_scheduled_tokens"], CONFIG.block_size)
    want = async_input_ids_reference(core["input_ids"], arrays["num_scheduled_tokens"][rows],
                                     arrays["num_draft_tokens"][rows], arrays["prev_batch_rows"][rows],
                                     arrays["prev_sampled_token_ids"], arrays["prev_draft_token_ids"])
    np.testing.assert_array_equal(step.input_ids, pad(want, step.num_tokens_padded, 0))
    # the spec-decode drafts are the ones written from last step
    num_drafts = int(step.spec_decode.total_num_draft_tokens)
    draft_rows = np.repeat(arrays["prev_batch_rows"][rows], arrays["num_draft_tokens"][rows])
    if (draft_rows >= 0).all():
        want_drafts = np.concatenate([arrays["prev_draft_token_ids"][p, :d] for p, d in
                                      zip(arrays["prev_batch_rows"][rows], arrays["num_draft_tokens"][rows])] + [[]])
        np.testing.assert_array_equal(np.asarray(step.spec_decode.draft_token_ids)[:num_drafts], want_drafts)


def test_prev_batch_rows_from_step_example():
    got = prev_batch_rows_from_step(jnp.array([2, 0, -1], jnp.int32), jnp.array([False, True, True]), 4)
    assert np.asarray(got).tolist() == [-1, -1, 0, -1]


@functools.partial(jax.jit, static_argnums=1)
def fake_sampler(step, max_num_reqs: int):
    """Samples "last input id + 100" per request; returns the next step's async inputs."""
    sampled = step.input_ids[step.logits_indices] + 100
    sampled = jnp.pad(sampled, (0, max_num_reqs - sampled.shape[0]))
    return sampled, prev_batch_rows_from_step(step.idx_mapping, step.discard_request_mask, max_num_reqs)


def test_two_steps_stay_on_the_device():
    """Step 1's sampled ids (a device array) feed step 2 through prev_batch_rows_from_step, with transfers off."""
    config = PrepConfig(max_num_reqs=4, max_model_len=16, max_num_batched_tokens=16, block_size=4,
                        features=FeatureConfig(async_tokens=True, discard_request_mask=True))
    token_ids = np.zeros((4, 16), np.int32)
    token_ids[0, :3], token_ids[2, :9] = [11, 12, 13], np.arange(31, 40)
    state1 = BatchState.from_numpy(
        token_ids=token_ids, block_table=np.arange(1, 4 * 64 + 1, dtype=np.int32).reshape(4, 64),
        num_computed_tokens=np.zeros(4, np.int32), num_scheduled_tokens=np.array([3, 0, 5, 0], np.int32),
        prefill_len=np.array([3, 0, 9, 0], np.int32), prev_sampled_token_ids=np.zeros(4, np.int32),
        prev_batch_rows=np.full(4, -1, np.int32))
    token_ids[0, 3] = -1  # the host's placeholder for request 0's sampled token
    state2_host = dataclasses.replace(
        state1, token_ids=jnp.asarray(token_ids), num_computed_tokens=jnp.array([3, 0, 5, 0], jnp.int32),
        num_scheduled_tokens=jnp.array([1, 0, 4, 0], jnp.int32))
    validate(state1, config)
    with jax.transfer_guard("disallow"):
        step1 = prepare_padded(state1, config, 8)
        sampled, prev_rows = fake_sampler(step1, 4)
        state2 = dataclasses.replace(state2_host, prev_sampled_token_ids=sampled, prev_batch_rows=prev_rows)
        step2 = prepare_padded(state2, config, 8)
    assert np.asarray(prev_rows).tolist() == [0, -1, -1, -1]  # request 2's token was discarded (a partial prefill)
    assert np.asarray(step2.input_ids).tolist() == [113, 36, 37, 38, 39, 0, 0, 0]


def test_bad_async_inputs_are_rejected():
    config = PrepConfig(max_num_reqs=5, max_model_len=12, max_num_batched_tokens=8, block_size=2,
                        features=FeatureConfig(async_tokens=True))
    validate(BatchState.from_numpy(**section_2_9_example()), config)
    cases = {
        "prev_batch_rows at row 0 is 5, which is outside \\[-1, max_num_reqs=5\\)": [5, 0, -1, -1, -1],
        "prev_batch_rows at row 1 is -2": [1, -2, -1, -1, -1],
        "maps two scheduled rows to one last-step batch row": [1, 1, -1, -1, -1],
    }
    for message, prev in cases.items():
        arrays = dict(section_2_9_example(), prev_batch_rows=np.array(prev, np.int32))
        with pytest.raises(InvalidBatchError, match=message):
            validate(BatchState.from_numpy(**arrays), config)
    with pytest.raises(InvalidBatchError, match="prev_sampled_token_ids is missing: FeatureConfig.async_tokens"):
        validate(BatchState.from_numpy(**dict(section_2_9_example(), prev_sampled_token_ids=None)), config)
    spec_config = dataclasses.replace(config, features=FeatureConfig(async_tokens=True, num_speculative_tokens=2))
    arrays = dict(section_2_9_example(), num_draft_tokens=np.zeros(5, np.int32))
    with pytest.raises(InvalidBatchError, match="prev_draft_token_ids is missing"):
        validate(BatchState.from_numpy(**arrays), spec_config)
    state = dataclasses.replace(BatchState.from_numpy(**dict(arrays, prev_draft_token_ids=np.zeros((5, 2), np.int32))),
                                prev_draft_token_ids=np.zeros((5, 3), np.int32))
    with pytest.raises(InvalidBatchError, match="prev_draft_token_ids has shape \\(5, 3\\), config expects \\(5, 2\\)"):
        validate(state, spec_config)
