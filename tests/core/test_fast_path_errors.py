"""Bad input on the unchecked path (``check=False``, what a serving loop runs).

Every kind of bad input sets its flag in ``step.errors``; nothing is read or written out of
bounds (no slot outside the KV cache, no read outside the tables, checked with checkify's index
checks); the state is unchanged; ``check=True`` raises the named error. What is static (shapes,
the bucket) raises on both paths before anything compiles.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.experimental import checkify

from jaxprep import BatchState, InvalidBatchError, PrepConfig, prepare_inputs, prepare_padded
from jaxprep._constants import NULL_BLOCK_ID
from jaxprep.metadata import step_fields
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
from support.kernels import KERNELS, on_kernel

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


def kernel_cases() -> dict[str, tuple[dict[str, np.ndarray], int]]:
    """Every core bad-input kind at bucket 16, a bucket below the total (every row dropped), an
    out-of-pool id in a column only the computed tokens use (`safe_block_table`'s bit, no token's)
    and one past the used columns (nulled, no bit)."""
    cases = {kind: (corrupt(kind), 16) for kind in BAD_KINDS}
    cases["over bucket"] = (valid_arrays(), 8)
    stale = valid_arrays()
    stale["block_table"][1, 0] = 40  # row 1 decodes position 9 (column 2); column 0 holds computed tokens
    cases["block id too large in a computed column"] = (stale, 16)
    unused = valid_arrays()
    unused["block_table"][1, 5] = 77  # row 1's seq_len 10 uses columns 0..2
    cases["block id too large past the used columns"] = (unused, 16)
    return cases


KERNEL_CASES = kernel_cases()


def differing_fields(step, other) -> list[str]:
    """The step fields (every output and the error word) where two steps differ."""
    theirs = step_fields(other)
    return [name for name, value in step_fields(step).items()
            if not np.array_equal(np.asarray(value), np.asarray(theirs[name]))]


@pytest.mark.parametrize("kind", KERNEL_CASES)
def test_the_kernels_drop_and_null_what_xla_does(kind):
    """The Pallas path's step equals the XLA path's bit for bit on bad input: the same error word,
    the flagged rows dropped from the batch, the out-of-pool block ids nulled in the block table.
    Negative control: the XLA step of the valid batch differs (the bad input changes the outputs),
    and the comparison sees a single output shifted by one."""
    arrays, bucket = KERNEL_CASES[kind]
    state = BatchState.from_numpy(**arrays)
    pallas = prepare_padded(state, on_kernel(CONFIG, "pallas"), bucket)
    xla = prepare_padded(state, CONFIG, bucket)
    assert differing_fields(pallas, xla) == [], differing_fields(pallas, xla)
    valid = prepare_padded(BatchState.from_numpy(**valid_arrays()), CONFIG, bucket)
    if kind.endswith("past the used columns"):  # nulled, unflagged: the valid batch's step exactly
        assert int(pallas.errors) == 0 and int(pallas.attn_metadata.block_table[1, 5]) == NULL_BLOCK_ID
        assert differing_fields(pallas, valid) == []
    elif kind != "over bucket":  # that one is the valid batch itself: its worked values are below
        assert int(pallas.errors) != 0 and differing_fields(pallas, valid)
    shifted = dataclasses.replace(xla, positions=xla.positions.at[0].add(1))
    assert differing_fields(pallas, shifted) == ["positions"]


def test_over_the_bucket_every_row_is_dropped_on_both_paths():
    """Worked values (not computed by the code under test): 9 tokens in bucket 8 leave an empty
    step, every output its padding."""
    state = BatchState.from_numpy(**valid_arrays())
    for kernel in KERNELS:
        step = prepare_padded(state, on_kernel(CONFIG, kernel), 8)
        meta = step.attn_metadata
        assert int(step.errors) == OVER_BUCKET and int(meta.num_reqs) == 0 and int(meta.num_actual_tokens) == 0
        np.testing.assert_array_equal(meta.query_start_loc, np.zeros(5, np.int32))
        np.testing.assert_array_equal(step.idx_mapping, np.full(4, -1, np.int32))
        np.testing.assert_array_equal(meta.slot_mapping, np.full(8, -1, np.int32))
        np.testing.assert_array_equal(meta.block_table, np.zeros((4, CONFIG.max_blocks_per_req), np.int32))


def test_a_dropped_row_leaves_the_batch_on_the_kernels():
    """Row 1 (the decode) past max_model_len is dropped: rows 0 and 3 make the batch, 8 tokens."""
    step = prepare_padded(BatchState.from_numpy(**corrupt("past max_model_len")), on_kernel(CONFIG, "pallas"), 16)
    meta = step.attn_metadata
    assert int(step.errors) == PAST_MAX_MODEL_LEN
    np.testing.assert_array_equal(step.idx_mapping, [0, 3, -1, -1])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 5, 8, 8, 8])
    np.testing.assert_array_equal(meta.seq_lens, [5, 7, 0, 0])
    np.testing.assert_array_equal(step.positions[:8], [0, 1, 2, 3, 4, 4, 5, 6])


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
