"""Bad input on the unchecked path (``check=False``, what a serving loop runs).

Every kind of bad input sets its flag in ``step.errors``; nothing is read or written out of
bounds (no slot outside the KV cache, no read outside the tables, checked with checkify's index
checks); the state is unchanged; ``check=True`` raises the named error. What is static (shapes,
the bucket) raises on both paths before anything compiles.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.experimental import checkify

from jaxprep import BatchState, InvalidBatchError, PrepConfig, prepare_inputs, prepare_padded
from jaxprep.prepare import prepare_body
from jaxprep.validate import (
    BLOCK_ID_OUT_OF_RANGE,
    NEGATIVE_COUNT,
    NULL_BLOCK,
    OVER_BUCKET,
    PAST_MAX_MODEL_LEN,
    describe_errors,
)
from support.batches import numpy_batches
from support.kernels import on_kernel

CONFIG = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4, num_blocks=40)
NUM_SLOTS = 40 * 4


def valid_arrays() -> dict[str, np.ndarray]:
    """Rows: a 5-token prefill from 0, a decode at 9, nothing, a 3-token chunk from 4 (total 9)."""
    block_table = np.zeros((4, CONFIG.max_blocks_per_req), np.int32)
    block_table[0, :2] = [1, 2]
    block_table[1, :3] = [3, 4, 5]
    block_table[3, :2] = [6, 7]
    token_ids = np.arange(4 * 32, dtype=np.int32).reshape(4, 32) + 100
    return dict(token_ids=token_ids, block_table=block_table, num_computed_tokens=np.array([0, 9, 0, 4], np.int32),
                num_scheduled_tokens=np.array([5, 1, 0, 3], np.int32))


def corrupt(kind: str) -> dict[str, np.ndarray]:
    arrays = valid_arrays()
    if kind == "negative scheduled":
        arrays["num_scheduled_tokens"][1] = -3
    elif kind == "negative computed":
        arrays["num_computed_tokens"][3] = -6
    elif kind == "past max_model_len":
        arrays["num_computed_tokens"][1] = 31
        arrays["num_scheduled_tokens"][1] = 2
    elif kind == "int32 wrap":
        arrays["num_computed_tokens"][1] = 2**31 - 2  # computed + scheduled wraps negative in int32
        arrays["num_scheduled_tokens"][1] = 5
    elif kind == "block id too large":
        arrays["block_table"][0, 1] = 40  # num_blocks 40: ids 1..39
    elif kind == "negative block id":
        arrays["block_table"][3, 1] = -4
    elif kind == "null block":
        arrays["block_table"][1, 2] = 0  # row 1 decodes position 9: block column 2
    return arrays


BAD_KINDS = {
    "negative scheduled": NEGATIVE_COUNT, "negative computed": NEGATIVE_COUNT,
    "past max_model_len": PAST_MAX_MODEL_LEN, "int32 wrap": PAST_MAX_MODEL_LEN,
    "block id too large": BLOCK_ID_OUT_OF_RANGE, "negative block id": BLOCK_ID_OUT_OF_RANGE,
    "null block": NULL_BLOCK,
}
FIELD_NAMED = {NEGATIVE_COUNT: "num_", PAST_MAX_MODEL_LEN: "max_model_len", BLOCK_ID_OUT_OF_RANGE: "block_table",
               NULL_BLOCK: "null block"}


def assert_in_bounds(step) -> None:
    """Slots lie in the KV cache or are PAD; every input id is one the token table holds (or PAD)."""
    slots = np.asarray(step.attn_metadata.slot_mapping)
    assert ((slots == -1) | ((slots >= 0) & (slots < NUM_SLOTS))).all(), slots
    ids = np.asarray(step.input_ids)
    assert ((ids == 0) | ((ids >= 100) & (ids < 100 + 4 * 32))).all(), ids


def test_valid_batches_have_no_error_flags(kernel):
    config = on_kernel(CONFIG, kernel)
    stream = numpy_batches(config, seed=3)
    for _ in range(100):
        arrays = next(stream)
        total = int(arrays["num_scheduled_tokens"].sum())
        step = prepare_padded(BatchState.from_numpy(**arrays), config, 8 if total <= 8 else 16)
        assert int(step.errors) == 0


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_input_sets_its_flag_reads_in_bounds_and_leaves_the_state(kind, kernel):
    arrays = corrupt(kind)
    before = {name: value.copy() for name, value in arrays.items()}
    state = BatchState.from_numpy(**arrays)
    step = prepare_padded(state, on_kernel(CONFIG, kernel), 16)
    errors = int(step.errors)
    assert errors & BAD_KINDS[kind], (kind, errors)
    assert_in_bounds(step)
    for name, value in before.items():
        np.testing.assert_array_equal(np.asarray(getattr(state, name)), value, err_msg=name)
    assert any(FIELD_NAMED[BAD_KINDS[kind]] in message for message in describe_errors(errors, CONFIG, 16))


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_no_gather_or_scatter_leaves_its_array_on_bad_input(kind):
    """checkify's index checks see every gather and scatter of the step: none goes out of bounds."""
    checked = jax.jit(checkify.checkify(prepare_body, errors=checkify.index_checks), static_argnums=(1, 2))
    error, _ = checked(BatchState.from_numpy(**corrupt(kind)), CONFIG, 16)
    assert error.get() is None, error.get()


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_check_true_raises_the_named_error(kind):
    with pytest.raises(InvalidBatchError):
        prepare_inputs(BatchState.from_numpy(**corrupt(kind)), CONFIG, 16, check=True)


def test_a_bucket_below_the_total_is_flagged_and_stays_in_bounds(kernel):
    arrays = valid_arrays()  # 9 tokens
    step = prepare_padded(BatchState.from_numpy(**arrays), on_kernel(CONFIG, kernel), 8)
    assert int(step.errors) == OVER_BUCKET
    assert_in_bounds(step)
    with pytest.raises(InvalidBatchError, match="exceeds num_tokens_padded=8"):
        prepare_inputs(BatchState.from_numpy(**arrays), CONFIG, 8, check=True)


@pytest.mark.parametrize("bucket", [12, 17, 1024])
@pytest.mark.parametrize("check", [False, True])
def test_a_bucket_off_the_ladder_or_above_the_budget_raises_before_compiling(bucket, check):
    state = BatchState.from_numpy(**valid_arrays())
    with pytest.raises((ValueError, InvalidBatchError), match=f"num_tokens_padded={bucket}"):
        prepare_inputs(state, CONFIG, bucket, check=check)


@pytest.mark.parametrize("check", [False, True])
def test_a_state_with_more_rows_than_the_config_raises_on_both_paths(check):
    bigger = PrepConfig(max_num_reqs=6, max_model_len=32, max_num_batched_tokens=16, block_size=4, num_blocks=40)
    arrays = {name: np.concatenate([value, value[:2]]) for name, value in valid_arrays().items()}
    assert arrays["num_scheduled_tokens"].shape == (bigger.max_num_reqs,)
    with pytest.raises(InvalidBatchError, match=r"row-count mismatch: BatchState has 6 rows.*max_num_reqs=4"):
        prepare_inputs(BatchState.from_numpy(**arrays), CONFIG, 16, check=check)


COUNT_BITS = NEGATIVE_COUNT | PAST_MAX_MODEL_LEN | OVER_BUCKET


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_the_kernels_flag_what_xla_flags(kind):
    """The Pallas path's error word against the XLA path's: the bits of the counts agree on every
    kind; with valid counts (bad block ids) the whole word does. With bad counts the token layout is
    not defined, so which tokens then read a bad block differs between the two (both stay in bounds)."""
    state = BatchState.from_numpy(**corrupt(kind))
    words = {kernel: int(prepare_padded(state, on_kernel(CONFIG, kernel), 16).errors) for kernel in ("xla", "pallas")}
    assert words["pallas"] & BAD_KINDS[kind], words
    assert words["pallas"] & COUNT_BITS == words["xla"] & COUNT_BITS, words
    if not BAD_KINDS[kind] & COUNT_BITS:
        assert words["pallas"] == words["xla"], words


def test_two_token_flags_in_one_step_are_both_set_once():
    """The token kernel ORs each block-id bit in once, however many of its programs see it (bucket 16:
    4 programs of 4 tokens). Token 5 (program 1) reads the null block; tokens 6-8 (programs 1 and 2)
    read a block id past the pool. A bit added twice would carry into the next bit."""
    arrays = corrupt("null block")  # row 1's decode (token 5) reads the null block
    arrays["block_table"][3, 1] = 40  # row 3's tokens 6-8, positions 4-6: a block id past num_blocks=40
    state = BatchState.from_numpy(**arrays)
    step = prepare_padded(state, on_kernel(CONFIG, "pallas"), 16)
    assert int(step.errors) == NULL_BLOCK | BLOCK_ID_OUT_OF_RANGE
    assert int(prepare_padded(state, CONFIG, 16).errors) == NULL_BLOCK | BLOCK_ID_OUT_OF_RANGE
