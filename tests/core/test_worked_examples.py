"""The worked examples in docs/semantics.md#examples, with the values written there (golden tests)."""

import numpy as np
import pytest

from jaxprep import BatchState, prepare_inputs, prepare_padded
from jaxprep.reference import prepare_reference
from jaxprep.walkthrough.examples import example_a_config, example_a_step1, example_a_step2, example_b, example_b_config
from support.kernels import on_kernel


def _prepare(arrays, config, num_tokens_padded=None, kernel="xla"):
    """The checked step on ``kernel`` (the ``kernel`` fixture runs a test on XLA and on the Pallas kernels)."""
    return prepare_inputs(BatchState.from_numpy(**arrays), on_kernel(config, kernel), num_tokens_padded, check=True)


def test_example_a_step1_matches_spec(kernel):
    step = _prepare(example_a_step1(), example_a_config(), kernel=kernel)
    meta = step.attn_metadata
    assert step.num_tokens_padded == 10
    np.testing.assert_array_equal(step.positions, [0, 1, 2, 0, 1, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(meta.slot_mapping, [2, 3, 4, 6, 7, 8, 9, 10, 11, 12])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 3, 5, 10])
    np.testing.assert_array_equal(meta.seq_lens, [3, 2, 5])
    np.testing.assert_array_equal(step.logits_indices, [2, 4, 9])
    np.testing.assert_array_equal(step.input_ids, [101, 102, 103, 201, 202, 301, 302, 303, 304, 305])
    assert (int(meta.num_actual_tokens), int(meta.num_reqs), int(meta.max_query_len), int(meta.max_seq_len)) == (
        10, 3, 5, 5)


def test_example_a_step1_token_indices_match_spec():
    arrays = example_a_step1()
    ref = prepare_reference(block_size=2, **arrays)
    np.testing.assert_array_equal(ref["token_indices"], [0, 1, 2, 12, 13, 24, 25, 26, 27, 28])
    np.testing.assert_array_equal(ref["positions"], [0, 1, 2, 0, 1, 0, 1, 2, 3, 4])


def test_example_a_step2_matches_spec(kernel):
    step = _prepare(example_a_step2(), example_a_config(), kernel=kernel)
    meta = step.attn_metadata
    np.testing.assert_array_equal(step.positions[:5], [3, 2, 5, 6, 7])
    np.testing.assert_array_equal(meta.slot_mapping[:5], [5, 14, 13, 16, 17])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 1, 2, 5])
    np.testing.assert_array_equal(meta.seq_lens, [4, 3, 8])
    np.testing.assert_array_equal(step.logits_indices, [0, 1, 4])
    ref = prepare_reference(block_size=2, **example_a_step2())
    np.testing.assert_array_equal(ref["token_indices"], [3, 14, 29, 30, 31])


def test_example_a_step2_padded_to_8_matches_spec(kernel):
    """docs/semantics.md#example-a-step-2-padded: N_pad=8 gives positions [3,2,5,6,7,0,0,0] and slots
    [5,14,13,16,17,-1,-1,-1]."""
    step = _prepare(example_a_step2(), example_a_config(), num_tokens_padded=8, kernel=kernel)
    assert step.num_tokens_padded == 8
    np.testing.assert_array_equal(step.positions, [3, 2, 5, 6, 7, 0, 0, 0])
    np.testing.assert_array_equal(step.attn_metadata.slot_mapping, [5, 14, 13, 16, 17, -1, -1, -1])
    np.testing.assert_array_equal(step.input_ids[5:], [0, 0, 0])


def test_example_a_step2_with_four_padded_requests_matches_spec(kernel):
    """docs/semantics.md#example-a-step-2-padded with R_pad=4: qsl [0,1,2,5,5] and seq_lens [4,3,8,0]."""
    arrays = example_a_step2()
    arrays = {k: np.concatenate([v, np.zeros((1,) + v.shape[1:], v.dtype)]) for k, v in arrays.items()}
    config = example_a_config()
    config = type(config)(max_num_reqs=4, max_model_len=12, max_num_batched_tokens=10, block_size=2, kernel=kernel)
    step = prepare_padded(BatchState.from_numpy(**arrays), config, 8)
    np.testing.assert_array_equal(step.attn_metadata.query_start_loc, [0, 1, 2, 5, 5])
    np.testing.assert_array_equal(step.attn_metadata.seq_lens, [4, 3, 8, 0])
    np.testing.assert_array_equal(step.idx_mapping, [0, 1, 2, -1])
    np.testing.assert_array_equal(step.attn_metadata.block_table[3], np.zeros(64))


def test_example_b_matches_spec(kernel):
    step = _prepare(example_b(), example_b_config(), kernel=kernel)
    meta = step.attn_metadata
    slots = np.asarray(meta.slot_mapping)
    assert step.num_tokens_padded == 200
    assert slots[:4].tolist() == [70, 225, 240, 241]
    assert slots[-4:].tolist() == [442, 443, 444, 445]
    np.testing.assert_array_equal(meta.query_start_loc, [0, 1, 2, 95, 170, 200])
    np.testing.assert_array_equal(meta.seq_lens, [55, 146, 93, 75, 30])
    np.testing.assert_array_equal(step.logits_indices, [0, 1, 94, 169, 199])
    np.testing.assert_array_equal(step.positions[:2], [54, 145])


@pytest.mark.parametrize("kernel, hole_rows", [("xla", [0]), ("xla", [1, 3]), ("xla", [0, 2, 4, 6]),
                                               ("pallas", [0]), ("pallas", [0, 2, 4, 6])])
def test_example_a_with_holes_keeps_row_order(kernel, hole_rows):
    """Rows without work take no part: the batch is the condensed rows, and idx_mapping says which."""
    arrays = example_a_step2()
    rows = 3 + len(hole_rows)
    order = [r for r in range(rows) if r not in hole_rows]
    spread = {}
    for name, value in arrays.items():
        out = np.zeros((rows,) + value.shape[1:], value.dtype)
        out[order] = value
        if name == "num_computed_tokens":
            out[hole_rows] = 7  # a parked request still holds its computed count
        spread[name] = out
    config = type(example_a_config())(max_num_reqs=rows, max_model_len=12, max_num_batched_tokens=10, block_size=2,
                                      kernel=kernel)
    step = prepare_inputs(BatchState.from_numpy(**spread), config, 8, check=True)
    np.testing.assert_array_equal(step.idx_mapping[:3], order)
    np.testing.assert_array_equal(step.attn_metadata.slot_mapping, [5, 14, 13, 16, 17, -1, -1, -1])
    np.testing.assert_array_equal(step.attn_metadata.seq_lens[:3], [4, 3, 8])
