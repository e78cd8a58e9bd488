"""Async scheduling with spec decode: a draft no step wrote stays vLLM's placeholder -1 for the sampler.

vLLM V1's async scheduler schedules ``[-1] * K`` as every request's drafts; the runner overwrites
them with last step's drafts only for requests sampled last step, reads ``draft_token_ids`` from
``input_ids``, and only then clamps ``input_ids`` to >= 0. So the model sees 0 there, while the
rejection sampler compares -1 with the target's token and never accepts it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import FeatureConfig, PrepConfig
from jaxprep._constants import PAD_INPUT_ID, PLACEHOLDER_TOKEN_ID
from jaxprep.reference import prepare_reference
from jaxprep.reference.requests import async_input_ids_reference, spec_decode_reference
from support.feature_batches import RUN_MODES, batch_rows, feature_batches, pad, run_step

K = 2
CONFIG = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=32, block_size=4,
                    features=FeatureConfig(async_tokens=True, num_speculative_tokens=K))


def example() -> dict:
    """Row 0 decodes with 2 drafts, sampled last step at batch row 1 (its drafts 601, 602 come from there);
    row 1 decodes with 1 draft but was not sampled last step: its draft is the scheduler's placeholder."""
    token_ids = np.zeros((6, 40), np.int32)
    token_ids[0, :8] = [11, 12, 13, 14, 15, -1, -1, -1]  # prompt + outputs, then sampled + 2 drafts unknown
    token_ids[1, :6] = [21, 22, 23, 24, 25, -1]  # last sampled 25 is known; its draft is not
    block_table = np.zeros((6, 40), np.int32)
    block_table[0, :2], block_table[1, :2] = [1, 2], [3, 4]
    return dict(token_ids=token_ids, block_table=block_table,
                num_computed_tokens=np.array([5, 4, 0, 0, 0, 0], np.int32),
                num_scheduled_tokens=np.array([3, 2, 0, 0, 0, 0], np.int32),
                num_draft_tokens=np.array([2, 1, 0, 0, 0, 0], np.int32),
                prev_sampled_token_ids=np.array([500, 501, 0, 0, 0, 0], np.int32),
                prev_batch_rows=np.array([1, -1, -1, -1, -1, -1], np.int32),
                prev_draft_token_ids=np.array([[600, 600], [601, 602], [0, 0], [0, 0], [0, 0], [0, 0]], np.int32))


@pytest.mark.parametrize("mode", RUN_MODES)
def test_unwritten_draft_is_placeholder_for_the_sampler_and_zero_for_the_model(mode):
    step = run_step(example(), CONFIG, mode)
    assert np.asarray(step.input_ids)[:5].tolist() == [501, 601, 602, 25, PAD_INPUT_ID]
    drafts = np.asarray(step.spec_decode.draft_token_ids)[: int(step.spec_decode.total_num_draft_tokens)]
    assert drafts.tolist() == [601, 602, PLACEHOLDER_TOKEN_ID] == [601, 602, -1]


def test_placeholder_never_matches_a_sampled_token():
    """The rejection sampler accepts draft j when it equals the target's token; no token id is -1."""
    step = run_step(example(), CONFIG, "jit")
    drafts = np.asarray(step.spec_decode.draft_token_ids)[:3]
    sampled_by_target = np.array([601, 602, 0])  # the target "samples" token 0 where the model saw input 0
    assert (drafts == sampled_by_target).tolist() == [True, True, False]


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_async_batches_match_vllm_v1(mode, data):
    """Every decode's sampled token and drafts are placeholders on the host; about half were sampled last step."""
    arrays = data.draw(feature_batches(CONFIG, max_drafts=K))
    rows, scheduled, drafts = CONFIG.max_num_reqs, arrays["num_scheduled_tokens"], arrays["num_draft_tokens"]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**20)))
    is_decode = (scheduled > 0) & (scheduled == drafts + 1)
    for row in np.flatnonzero(is_decode):
        start = arrays["num_computed_tokens"][row]
        arrays["token_ids"][row, start: start + scheduled[row]] = PLACEHOLDER_TOKEN_ID
    prev_rows = np.full(rows, -1, np.int32)
    sampled_last = is_decode & (rng.random(rows) < 0.5)
    prev_rows[sampled_last] = rng.permutation(rows)[: sampled_last.sum()]
    arrays.update(prev_batch_rows=prev_rows, prev_sampled_token_ids=rng.integers(1, 1000, rows).astype(np.int32),
                  prev_draft_token_ids=rng.integers(1000, 2000, (rows, K)).astype(np.int32))
    step = run_step(arrays, CONFIG, mode)
    order = batch_rows(arrays)
    core = prepare_reference(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"], scheduled,
                             CONFIG.block_size)
    args = (core["input_ids"], scheduled[order], drafts[order], prev_rows[order], arrays["prev_sampled_token_ids"],
            arrays["prev_draft_token_ids"])
    np.testing.assert_array_equal(step.input_ids, pad(async_input_ids_reference(*args), step.num_tokens_padded, 0))
    want = spec_decode_reference(scheduled[order], drafts[order], async_input_ids_reference(*args, clamp=False))
    num_drafts = int(step.spec_decode.total_num_draft_tokens)
    np.testing.assert_array_equal(np.asarray(step.spec_decode.draft_token_ids)[:num_drafts], want["draft_token_ids"])
    assert (np.asarray(step.input_ids) >= 0).all()
