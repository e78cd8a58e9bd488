"""Attention masks for Ascend-style kernels (docs/semantics.md#ascend-masks): compressed constant, bool and additive row
masks."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, PrepConfig, prepare_padded, validate
from jaxprep.features.masks import BF16_MASK_VALUE, COMPRESSED_MASK_SIZE
from jaxprep.reference.tokens import row_mask_reference
from jaxprep.walkthrough.examples import example_a_config, example_a_step2
from support.feature_batches import RUN_MODES, feature_batches, run_step

CONFIG = PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4)


def with_mask(config, form, dtype="float16", mask_kv_len=None):
    return dataclasses.replace(config, features=FeatureConfig(attn_mask=form, attn_mask_dtype=dtype,
                                                              mask_kv_len=mask_kv_len))


def test_no_mask_by_default():
    assert run_step(example_a_step2(), example_a_config(), "jit").attn_mask is None


@pytest.mark.parametrize("mode", RUN_MODES)
def test_compressed_mask_is_one_constant(mode):
    config = with_mask(example_a_config(), "compressed")
    step1 = run_step(example_a_step2(), config, mode)
    step2 = run_step(example_a_step2(), config, mode)
    mask = np.asarray(step1.attn_mask)
    assert mask.shape == (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE) and mask.dtype == np.int8
    np.testing.assert_array_equal(mask, np.triu(np.ones_like(mask), k=1))
    assert step1.attn_mask is step2.attn_mask  # built once, not once per step
    assert prepare_padded(BatchState.from_numpy(**example_a_step2()), config, 8).attn_mask is None


@pytest.mark.parametrize("mode", RUN_MODES)
def test_row_mask_worked_example(mode):
    """Example A step 2, positions [3, 2, 5, 6, 7]: token t sees KV positions 0..p_t of its own request."""
    step = run_step(example_a_step2(), with_mask(example_a_config(), "rows_bool"), mode)
    mask = np.asarray(step.attn_mask)
    assert mask.shape == (8, 12) and mask.dtype == np.bool_
    visible = (~mask).sum(axis=1).tolist()
    assert visible == [4, 3, 6, 7, 8, 1, 1, 1]  # padded tokens (position 0) see KV position 0 only


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("form, dtype", [("rows_bool", "float16"), ("rows_additive", "float16"),
                                         ("rows_additive", "bfloat16"), ("rows_additive", "float32")])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_row_masks_match_reference(mode, form, dtype, data):
    config = with_mask(CONFIG, form, dtype)
    arrays = data.draw(feature_batches(config))
    step = run_step(arrays, config, mode)
    masked = row_mask_reference(np.asarray(step.positions), config.max_model_len)
    got = np.asarray(step.attn_mask.astype(np.float32) if form == "rows_additive" else step.attn_mask)
    if form == "rows_bool":
        np.testing.assert_array_equal(got, masked)
        return
    value = BF16_MASK_VALUE if dtype == "bfloat16" else float(np.finfo(dtype).min)
    value = float(jax.numpy.asarray(value, dtype))  # as the dtype holds it (bf16: -10000 -> -9984)
    assert step.attn_mask.dtype == jax.numpy.dtype(dtype)
    np.testing.assert_array_equal(got, np.where(masked, np.float32(value), np.float32(0)))
    assert np.isfinite(got).all()
    row_softmax = jax.nn.softmax(step.attn_mask.astype(np.float32), axis=-1)  # no -inf - -inf: no NaN
    assert np.isfinite(np.asarray(row_softmax)).all()


def test_row_mask_memory_is_bounded_by_the_bucket():
    """Rows = the token bucket, columns = mask_kv_len: never max_model_len ** 2."""
    config = PrepConfig(max_num_reqs=4, max_model_len=4096, max_num_batched_tokens=64, block_size=16,
                        features=FeatureConfig(attn_mask="rows_additive", mask_kv_len=256))
    table = np.zeros((4, 256), np.int32)
    table[0, :4] = [1, 2, 3, 4]
    arrays = dict(token_ids=np.ones((4, 4096), np.int32), block_table=table,
                  num_computed_tokens=np.array([40, 0, 0, 0], np.int32),
                  num_scheduled_tokens=np.array([9, 0, 0, 0], np.int32))
    step = run_step(arrays, config, "jit")
    assert step.attn_mask.shape == (16, 256)
    assert step.attn_mask.nbytes == 16 * 256 * 2
    arrays["num_computed_tokens"][0], arrays["block_table"][0, :17] = 250, np.arange(1, 18)
    with pytest.raises(InvalidBatchError, match="is 259, which exceeds the row mask's FeatureConfig.mask_kv_len=256"):
        validate(BatchState.from_numpy(**arrays), config)
    with pytest.raises(ValueError, match="mask_kv_len=8192 exceeds max_model_len=4096"):
        dataclasses.replace(config, features=FeatureConfig(attn_mask="rows_bool", mask_kv_len=8192))
    with pytest.raises(ValueError, match="attn_mask='dense'"):
        FeatureConfig(attn_mask="dense")
