"""Prompt embeddings (docs/semantics.md#prompt-embeddings): per-token is_token_ids and the pool row of each
embedding."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, PrepConfig, validate
from jaxprep.reference import prepare_reference
from jaxprep.reference.tokens import prompt_embeds_reference
from support.feature_batches import RUN_MODES, batch_rows, feature_batches, pad, run_step

CONFIG = PrepConfig(max_num_reqs=5, max_model_len=32, max_num_batched_tokens=32, block_size=4,
                    features=FeatureConfig(prompt_embeds=True))


def one_request(computed: int, scheduled: int) -> dict:
    is_token_ids = np.ones((1, 8), bool)
    is_token_ids[0, :3] = False  # prompt positions 0..2 are embeddings, 3.. token ids
    return dict(token_ids=np.arange(11, 19, dtype=np.int32)[None, :], block_table=np.ones((1, 64), np.int32),
                num_computed_tokens=np.array([computed], np.int32),
                num_scheduled_tokens=np.array([scheduled], np.int32),
                is_token_ids=is_token_ids, prompt_embeds_start=np.array([100], np.int32))


@pytest.mark.parametrize("mode", RUN_MODES)
def test_worked_example(mode):
    """C=1, S=4 over prompt [emb, emb, emb, 14, 15]: embeddings 101, 102, then token ids; their ids become 0."""
    config = PrepConfig(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=8, block_size=2,
                        features=FeatureConfig(prompt_embeds=True))
    step = run_step(one_request(1, 4), config, mode)
    assert np.asarray(step.prompt_embeds.is_token_ids).tolist() == [False, False, True, True] + [True] * 4
    assert np.asarray(step.prompt_embeds.embeds_indices).tolist() == [101, 102, 0, 0, 0, 0, 0, 0]
    assert np.asarray(step.input_ids).tolist() == [0, 0, 14, 15, 0, 0, 0, 0]


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_prompt_embeds_match_reference(mode, data):
    arrays = data.draw(feature_batches(CONFIG))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**20)))
    arrays["is_token_ids"] = rng.random((5, 32)) < 0.5
    arrays["prompt_embeds_start"] = rng.integers(0, 10_000, 5).astype(np.int32)
    step = run_step(arrays, CONFIG, mode)
    rows = batch_rows(arrays)
    token_rows = np.repeat(rows, arrays["num_scheduled_tokens"][rows])
    core = prepare_reference(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                             arrays["num_scheduled_tokens"], CONFIG.block_size)
    flags, indices = prompt_embeds_reference(arrays["is_token_ids"], arrays["prompt_embeds_start"], token_rows,
                                             core["positions"])
    np.testing.assert_array_equal(step.prompt_embeds.is_token_ids, pad(flags, step.num_tokens_padded, True))
    np.testing.assert_array_equal(step.prompt_embeds.embeds_indices, pad(indices, step.num_tokens_padded, 0))
    np.testing.assert_array_equal(step.input_ids, pad(np.where(flags, core["input_ids"], 0), step.num_tokens_padded, 0))


def test_bad_prompt_embeds_inputs_are_rejected():
    config = PrepConfig(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=8, block_size=2,
                        features=FeatureConfig(prompt_embeds=True))
    validate(BatchState.from_numpy(**one_request(0, 5)), config)
    for field in ("is_token_ids", "prompt_embeds_start"):
        with pytest.raises(InvalidBatchError, match=f"{field} is missing: FeatureConfig.prompt_embeds needs it"):
            validate(BatchState.from_numpy(**dict(one_request(0, 5), **{field: None})), config)
    with pytest.raises(InvalidBatchError, match="prompt_embeds_start at row 0 is -1, which is outside"):
        validate(BatchState.from_numpy(**dict(one_request(0, 5), prompt_embeds_start=np.array([-1], np.int32))), config)
    with pytest.raises(TypeError, match="is_token_ids must hold bools"):
        BatchState.from_numpy(**dict(one_request(0, 5), is_token_ids=np.ones((1, 8), np.int32)))
