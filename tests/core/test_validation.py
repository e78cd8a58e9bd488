"""Bad batches are rejected with an error naming the field and the bound; nothing is changed."""

import dataclasses

import numpy as np
import pytest

from jaxprep import BatchState, InvalidBatchError, PrepConfig, prepare_inputs, validate
from jaxprep.walkthrough.examples import example_a_config, example_a_step2

CONFIG = example_a_config()  # B=2, M=12, budget 10, 3 rows


def _state(**changes):
    arrays = example_a_step2()
    arrays.update(changes)
    return BatchState.from_numpy(**arrays)


def _expect_error(state, pattern, **kwargs):
    before = state.to_numpy()
    with pytest.raises(InvalidBatchError, match=pattern):
        prepare_inputs(state, CONFIG, check=True, **kwargs)
    with pytest.raises(InvalidBatchError, match=pattern):
        validate(state, CONFIG, **kwargs)
    for name, value in state.to_numpy().items():
        np.testing.assert_array_equal(value, before[name], err_msg=f"{name} changed")


def test_valid_example_passes():
    validate(_state(), CONFIG)


def test_rejects_zero_scheduled_total():
    _expect_error(_state(num_scheduled_tokens=np.zeros(3, np.int32)), r"sum\(num_scheduled_tokens\) is 0")


def test_rejects_total_above_budget():
    _expect_error(_state(num_computed_tokens=np.zeros(3, np.int32), num_scheduled_tokens=np.array([4, 3, 4])),
                  r"sum\(num_scheduled_tokens\)=11 exceeds max_num_batched_tokens=10")


def test_rejects_total_above_padded_size():
    config = dataclasses.replace(CONFIG, token_buckets=(4, 8, 10))
    for check in (lambda: validate(_state(), config, num_tokens_padded=4),
                  lambda: prepare_inputs(_state(), config, 4, check=True)):
        with pytest.raises(InvalidBatchError, match=r"sum\(num_scheduled_tokens\)=5 exceeds num_tokens_padded=4"):
            check()


@pytest.mark.parametrize("pad", [4, 9, 16, 1024])
def test_rejects_a_pad_off_the_ladder_or_above_the_budget_as_prepare_inputs_does(pad):
    """validate(num_tokens_padded=...) agrees with prepare_inputs: only a rung of (8, 10) is a step's pad."""
    _expect_error(_state(), rf"num_tokens_padded={pad} is not a rung of PrepConfig.token_buckets \(8, 10\)",
                  num_tokens_padded=pad)
    with pytest.raises(InvalidBatchError, match=rf"num_tokens_padded={pad} is not a rung"):
        prepare_inputs(_state(), CONFIG, pad)
    validate(_state(), CONFIG, num_tokens_padded=8)  # the control: a rung passes


def test_five_rows_for_a_three_row_config_is_a_row_count_mismatch():
    arrays = {name: np.concatenate([value, value[:2]]) for name, value in example_a_step2().items()}
    state = BatchState.from_numpy(**arrays)
    for call in (lambda: validate(state, CONFIG), lambda: prepare_inputs(state, CONFIG),
                 lambda: prepare_inputs(state, CONFIG, check=True), lambda: prepare_inputs(state, CONFIG, 8)):
        with pytest.raises(InvalidBatchError, match=r"row-count mismatch: BatchState has 5 rows.*max_num_reqs=3"):
            call()


def test_rejects_negative_counts():
    _expect_error(_state(num_computed_tokens=np.array([3, -1, 5])),
                  r"num_computed_tokens at row 1 is -1, which is below 0")
    _expect_error(_state(num_scheduled_tokens=np.array([1, 1, -3])), r"num_scheduled_tokens at row 2 is -3")


def test_rejects_sequence_past_max_model_len():
    _expect_error(_state(num_computed_tokens=np.array([3, 2, 10])),
                  r"num_computed_tokens \+ num_scheduled_tokens at row 2 is 13, which exceeds max_model_len=12")


def test_sequence_ending_exactly_at_max_model_len_is_valid():
    arrays = example_a_step2()
    arrays["num_computed_tokens"] = np.array([3, 2, 9], np.int32)
    arrays["block_table"][2, :6] = [4, 5, 6, 8, 9, 10]
    validate(BatchState.from_numpy(**arrays), CONFIG)


def test_rejects_unallocated_block():
    table = example_a_step2()["block_table"]
    table[2, 3] = 0  # position 6 and 7 of row 2 fall in block column 3
    _expect_error(_state(block_table=table), r"block_table\[2, 3\] is the null block 0")


def test_rejects_block_id_out_of_range():
    config = dataclasses.replace(CONFIG, num_blocks=8)
    table = example_a_step2()["block_table"]
    table[1, 1] = 8
    state = _state(block_table=table)
    with pytest.raises(InvalidBatchError,
                       match=r"block_table\[1, 1\] = 8 is outside the block ids \[0, max_block_id=7\]"):
        validate(state, config)
    table[1, 1] = -5
    with pytest.raises(InvalidBatchError, match=r"block_table\[1, 1\] = -5"):
        validate(_state(block_table=table), config)


def test_rejects_shape_mismatch():
    arrays = example_a_step2()
    arrays = {k: v[:2] for k, v in arrays.items()}
    _expect_error(BatchState.from_numpy(**arrays),
                  r"row-count mismatch: BatchState has 2 rows.*max_num_reqs=3")
    wide = dict(example_a_step2(), token_ids=np.zeros((3, 13), np.int32))
    _expect_error(BatchState.from_numpy(**wide), r"BatchState.token_ids has shape \(3, 13\), config expects \(3, 12\)")
    narrow = example_a_step2()["block_table"][:, :5]
    _expect_error(_state(block_table=narrow),
                  r"block_table has shape \(3, 5\).*W >= cdiv\(max_model_len, block_size\) = 6")


def _unchecked_state(**fields):
    """A BatchState built without its constructor, as a caller without the shape annotations could."""
    state = object.__new__(BatchState)
    for name, value in fields.items():
        object.__setattr__(state, name, value)
    return state


def test_rejects_wrong_dtype():
    fields = _state().to_numpy()
    wrong = _unchecked_state(**{**fields, "num_computed_tokens": fields["num_computed_tokens"].astype(np.float32)})
    with pytest.raises(InvalidBatchError, match="num_computed_tokens has dtype float32, expected int32"):
        validate(wrong, CONFIG)


def test_from_numpy_rejects_non_integer_and_overflow():
    arrays = example_a_step2()
    with pytest.raises(TypeError, match="token_ids must hold integers"):
        BatchState.from_numpy(**{**arrays, "token_ids": arrays["token_ids"].astype(np.float32)})
    with pytest.raises(ValueError, match="outside int32"):
        BatchState.from_numpy(**{**arrays, "token_ids": arrays["token_ids"].astype(np.int64) + 2**40})
    with pytest.raises(ValueError, match="num_scheduled_tokens has 2 rows, but token_ids has 3"):
        BatchState.from_numpy(**{**arrays, "num_scheduled_tokens": np.array([1, 1])})


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PrepConfig(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=8, block_size=0)
    with pytest.raises(ValueError, match="must end at max_num_batched_tokens=64"):
        PrepConfig(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=64, block_size=4, token_buckets=(8, 128))
    with pytest.raises(ValueError, match="strictly increasing"):
        PrepConfig(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=64, block_size=4, token_buckets=(16, 8, 64))
    with pytest.raises(ValueError, match="max_blocks_per_req=1 is below"):
        PrepConfig(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=8, block_size=4, max_blocks_per_req=1)
    with pytest.raises(ValueError, match="overflows int32 slot ids"):
        PrepConfig(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=8, block_size=16, num_blocks=2**28)
