"""M-RoPE (docs/semantics.md#m-rope): Qwen2-VL prompt positions and the [3, T_pad] positions of a step."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, PrepConfig, qwen2vl_prompt_positions, validate
from jaxprep.reference.tokens import mrope_reference, qwen2vl_positions_reference
from support.feature_batches import RUN_MODES, batch_rows, feature_batches, pad, run_step

WORKED_SEGMENTS = [2, ("image", (1, 4, 4)), 3]
WORKED_T = [0, 1, 2, 2, 2, 2, 4, 5, 6]
WORKED_H = [0, 1, 2, 2, 3, 3, 4, 5, 6]
WORKED_W = [0, 1, 2, 3, 2, 3, 4, 5, 6]
CONFIG = PrepConfig(max_num_reqs=5, max_model_len=48, max_num_batched_tokens=40, block_size=4,
                    features=FeatureConfig(mrope=True))


def test_qwen2vl_worked_example():
    """docs/semantics.md#m-rope: 2 text tokens, a 1x4x4 image with merge 2 (4 tokens), 3 text tokens: P = 9, delta
    -2."""
    positions, delta = qwen2vl_prompt_positions(WORKED_SEGMENTS, spatial_merge_size=2)
    assert positions.tolist() == [WORKED_T, WORKED_H, WORKED_W]
    assert delta == -2
    assert positions.dtype == np.int32


segments_strategy = st.lists(st.one_of(
    st.integers(0, 5),
    st.tuples(st.just("image"), st.tuples(st.integers(1, 2), st.sampled_from([2, 4, 6]), st.sampled_from([2, 4]))),
    st.tuples(st.just("video"), st.tuples(st.integers(1, 3), st.sampled_from([2, 4]), st.sampled_from([2, 4])),
              st.sampled_from([0.5, 1.0, 2.0]))), max_size=5)


@settings(max_examples=60, deadline=None)
@given(segments=segments_strategy, tokens_per_second=st.sampled_from([1.0, 2.0, 4.0]))
def test_qwen2vl_positions_match_reference(segments, tokens_per_second):
    got, delta = qwen2vl_prompt_positions(segments, tokens_per_second=tokens_per_second)
    want, want_delta = qwen2vl_positions_reference(segments, tokens_per_second=tokens_per_second)
    np.testing.assert_array_equal(got, want)
    assert delta == want_delta


@given(lengths=st.lists(st.integers(0, 6), max_size=4))
def test_text_only_prompts_count_up_on_every_row(lengths):
    positions, delta = qwen2vl_prompt_positions(lengths)
    np.testing.assert_array_equal(positions, np.tile(np.arange(sum(lengths)), (3, 1)))
    assert delta == 0


def worked_request(computed: int, scheduled: int) -> dict:
    positions, delta = qwen2vl_prompt_positions(WORKED_SEGMENTS)
    table = np.full((1, 3, 16), -1, np.int32)
    table[0, :, :9] = positions
    return dict(token_ids=np.ones((1, 16), np.int32), block_table=np.ones((1, 64), np.int32),
                num_computed_tokens=np.array([computed], np.int32),
                num_scheduled_tokens=np.array([scheduled], np.int32),
                prefill_len=np.array([9], np.int32), mrope_positions=table,
                mrope_position_delta=np.array([delta], np.int32))


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("computed, scheduled, expected", [
    (0, 9, [WORKED_T, WORKED_H, WORKED_W]),
    (9, 1, [[7], [7], [7]]),  # the first decode token: 9 - 2 on every row
    (7, 4, [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]]),  # prompt columns 7, 8, then 9 - 2, 10 - 2
])
def test_worked_example_positions(mode, computed, scheduled, expected):
    config = PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=16, block_size=2,
                        features=FeatureConfig(mrope=True))
    step = run_step(worked_request(computed, scheduled), config, mode)
    got = np.asarray(step.mrope_positions)
    assert got.shape == (3, step.num_tokens_padded) and got.dtype == np.int32
    assert got[:, :scheduled].tolist() == expected
    assert (got[:, scheduled:] == 0).all()


def with_prompts(arrays: dict, data, config) -> dict:
    """Gives every row a random multimodal (or text-only) prompt that fits the token table."""
    rows, width = config.max_num_reqs, config.max_model_len
    table = np.full((rows, 3, width), -1, np.int32)
    prompt_lens, deltas = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for row in range(rows):
        positions, delta = qwen2vl_prompt_positions(data.draw(segments_strategy))
        prompt_lens[row] = min(positions.shape[1], width)
        table[row, :, : prompt_lens[row]] = positions[:, : prompt_lens[row]]
        deltas[row] = delta
    return dict(arrays, mrope_positions=table, mrope_position_delta=deltas, prefill_len=prompt_lens)


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_mrope_positions_match_reference(mode, data):
    arrays = with_prompts(data.draw(feature_batches(CONFIG)), data, CONFIG)
    step = run_step(arrays, CONFIG, mode)
    rows = batch_rows(arrays)
    want = mrope_reference(arrays["mrope_positions"][rows], arrays["mrope_position_delta"][rows],
                           arrays["prefill_len"][rows], arrays["num_computed_tokens"][rows],
                           arrays["num_scheduled_tokens"][rows])
    np.testing.assert_array_equal(step.mrope_positions, pad(want.T, step.num_tokens_padded, 0).T)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_text_only_rows_equal_the_1d_positions(data):
    arrays = data.draw(feature_batches(CONFIG))
    prompts = [data.draw(st.integers(0, CONFIG.max_model_len)) for _ in range(CONFIG.max_num_reqs)]
    table = np.full((5, 3, 48), -1, np.int32)
    for row, length in enumerate(prompts):
        table[row, :, :length] = qwen2vl_prompt_positions([length])[0]
    arrays.update(mrope_positions=table, mrope_position_delta=np.zeros(5, np.int32),
                  prefill_len=np.array(prompts, np.int32))
    step = run_step(arrays, CONFIG, "jit")
    np.testing.assert_array_equal(step.mrope_positions, np.tile(np.asarray(step.positions), (3, 1)))


def test_missing_mrope_positions_are_rejected():
    config = PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=16, block_size=2,
                        features=FeatureConfig(mrope=True))
    validate(BatchState.from_numpy(**worked_request(0, 9)), config)
    unfilled = worked_request(0, 9)
    unfilled["mrope_positions"][0, 1, 4] = -1
    with pytest.raises(InvalidBatchError, match="mrope_positions\\[0, :, 4\\] is missing \\(-1\\), but row 0 "
                                                "schedules prompt position 4"):
        validate(BatchState.from_numpy(**unfilled), config)
    validate(BatchState.from_numpy(**worked_request(9, 1)), config)  # decodes read no prompt column
    for field in ("mrope_positions", "mrope_position_delta", "prefill_len"):
        with pytest.raises(InvalidBatchError, match=f"{field} is missing: FeatureConfig.mrope needs it"):
            validate(BatchState.from_numpy(**dict(worked_request(0, 9), **{field: None})), config)
    state = dataclasses.replace(BatchState.from_numpy(**worked_request(0, 9)),
                                mrope_positions=np.zeros((1, 3, 8), np.int32))
    message = "mrope_positions has shape \\(1, 3, 8\\), config expects \\(1, 3, 16\\)"
    with pytest.raises(InvalidBatchError, match=message):
        validate(state, config)
