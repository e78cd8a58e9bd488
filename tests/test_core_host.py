"""`prepare_to_host` returns the same step as `prepare_padded`, as NumPy views of one buffer."""

import jax
import numpy as np
import pytest

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep.host import packed_offsets, prepare_to_host
from jaxprep.ragged import token_prefix_sum

from batches import numpy_batches
from expect import assert_step_matches_reference, step_fields

CONFIG = PrepConfig(max_num_reqs=12, max_model_len=96, max_num_batched_tokens=300, block_size=8)


def test_host_step_matches_device_step_and_reference():
    stream = numpy_batches(CONFIG, seed=11)
    for _ in range(200):
        arrays = next(stream)
        bucket = CONFIG.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
        host = prepare_to_host(BatchState.from_numpy(**arrays), CONFIG, bucket)
        device = step_fields(prepare_padded(BatchState.from_numpy(**arrays), CONFIG, bucket))
        for name, value in step_fields(host).items():
            assert isinstance(value, np.ndarray), name
            np.testing.assert_array_equal(value, device[name], err_msg=name)
        assert_step_matches_reference(host, arrays, CONFIG)


def test_packed_offsets_example():
    assert packed_offsets(8, 3) == (0, 8, 16, 24, 28, 31, 34, 37, 38, 39, 40, 41)


@pytest.mark.parametrize("length", [1, 63, 64, 127, 128, 129, 1000, 4096])
def test_token_prefix_sum_matches_numpy(length):
    values = np.random.default_rng(length).integers(0, 5, length).astype(np.int32)
    np.testing.assert_array_equal(jax.jit(token_prefix_sum)(values), np.cumsum(values))
