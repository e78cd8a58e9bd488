"""Property tests: the jitted preparation equals the NumPy reference over many random batches."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from jaxprep import BatchState, PrepConfig, prepare_inputs, prepare_padded
from support.batches import batches, numpy_batches
from support.expect import assert_step_matches_reference
from support.kernels import on_kernel

CONFIGS = {
    "small_blocks": PrepConfig(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=96, block_size=4),
    "block_size_1": PrepConfig(max_num_reqs=5, max_model_len=33, max_num_batched_tokens=40, block_size=1),
    "one_request": PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=16, block_size=16),
    "more_rows_than_budget": PrepConfig(max_num_reqs=32, max_model_len=40, max_num_batched_tokens=24,
                                        block_size=8),
    "default_ladder": PrepConfig(max_num_reqs=16, max_model_len=128, max_num_batched_tokens=300, block_size=16),
    "bounded_pool": PrepConfig(max_num_reqs=6, max_model_len=48, max_num_batched_tokens=64, block_size=2,
                               num_blocks=200, max_blocks_per_req=24),
}
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", CONFIGS)
@PROPERTY
@given(data=__import__("hypothesis").strategies.data())
def test_prepare_matches_reference(name, data):
    config = CONFIGS[name]
    arrays = data.draw(batches(config))
    step = prepare_inputs(BatchState.from_numpy(**arrays), config, check=True)
    assert_step_matches_reference(step, arrays, config)


@pytest.mark.parametrize("name", ["small_blocks", "more_rows_than_budget", "bounded_pool"])
@settings(max_examples=25, deadline=None)
@given(data=__import__("hypothesis").strategies.data())
def test_prepare_eager_matches_reference(name, data):
    """The same function without jit (op by op), at the top bucket."""
    config = CONFIGS[name]
    arrays = data.draw(batches(config))
    with jax.disable_jit():
        step = prepare_padded(BatchState.from_numpy(**arrays), config, config.max_num_batched_tokens)
    assert_step_matches_reference(step, arrays, config)


@pytest.mark.parametrize("name", CONFIGS)
def test_prepare_matches_reference_fuzz(name):
    """1,000 seeded batches per config (6,000 in all), every bucket each batch fits in."""
    config = CONFIGS[name]
    stream = numpy_batches(config, seed=len(name))
    for _ in range(1000):
        arrays = next(stream)
        step = prepare_inputs(BatchState.from_numpy(**arrays), config)
        assert_step_matches_reference(step, arrays, config)


ONE_BUCKET = {"small_blocks": 96, "more_rows_than_budget": 24, "bounded_pool": 64}
"""Configs and the one bucket each runs at on both kernels: R == Rp, R > Rp (more rows than tokens),
a bounded pool with a wider block table."""


@pytest.mark.parametrize("name", ONE_BUCKET)
def test_each_kernel_matches_reference_at_one_bucket(name, kernel):
    """100 seeded batches per config that fit the bucket, on XLA and on the Pallas kernels (interpreted
    on CPU: one bucket, one executable)."""
    config, bucket = on_kernel(CONFIGS[name], kernel), ONE_BUCKET[name]
    stream = numpy_batches(config, seed=7 + len(name))
    checked = 0
    while checked < 100:
        arrays = next(stream)
        if int(arrays["num_scheduled_tokens"].sum()) > bucket:
            continue
        step = prepare_padded(BatchState.from_numpy(**arrays), config, bucket)
        assert_step_matches_reference(step, arrays, config)
        assert int(step.errors) == 0
        checked += 1


def test_a_shifted_kernel_output_fails_the_reference_check():
    """Negative control: the comparison above sees one slot off by one on the Pallas path."""
    config = on_kernel(CONFIGS["small_blocks"], "pallas")
    arrays = next(numpy_batches(config, seed=3))
    step = prepare_padded(BatchState.from_numpy(**arrays), config, ONE_BUCKET["small_blocks"])
    assert_step_matches_reference(step, arrays, config)
    slots = np.asarray(step.attn_metadata.slot_mapping).copy()
    slots[0] += 1
    shifted = dataclasses.replace(step, attn_metadata=dataclasses.replace(step.attn_metadata, slot_mapping=slots))
    with pytest.raises(AssertionError, match="slot_mapping"):
        assert_step_matches_reference(shifted, arrays, config)
