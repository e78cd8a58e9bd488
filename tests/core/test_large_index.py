"""No index overflows when max_num_reqs * max_model_len >= 2**31 (int32 flat indices would wrap)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import BatchState, PrepConfig, prepare_inputs
from support.kernels import KERNELS

ROWS, MAX_MODEL_LEN, BLOCK_SIZE = 2**16, 2**15 + 1, 1024
GIB = 2**30


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


@pytest.mark.bigmem
@pytest.mark.skipif(_available_bytes() < 12 * GIB, reason="needs 12 GiB free for an 8 GiB token table")
@pytest.mark.parametrize("kernel", KERNELS)
def test_tokens_past_int32_flat_index_are_gathered(kernel):
    """On the Pallas path the Triton kernels index a table of more than 2**32 bytes with 64-bit offsets;
    Pallas' interpreter would hold the 8 GiB table twice, so that path runs on a GPU only."""
    if kernel == "pallas" and jax.default_backend() != "gpu":
        pytest.skip("the Pallas path's large-index run needs a GPU (its interpreter copies the 8 GiB table)")
    config = PrepConfig(max_num_reqs=ROWS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
                        block_size=BLOCK_SIZE, kernel=kernel)
    assert ROWS * MAX_MODEL_LEN >= 2**31
    # row 65535 decodes at the last position (flat index 65535 * 32769 + 32768 > 2**31);
    # row 40000 prefills 3 tokens from position 30000
    rows = np.array([40000, 40000, 40000, 65535])
    cols = np.array([30000, 30001, 30002, MAX_MODEL_LEN - 1])
    values = np.array([7, 8, 9, 424242], np.int32)

    @jax.jit
    def token_table():
        return jnp.zeros((ROWS, MAX_MODEL_LEN), jnp.int32).at[rows, cols].set(values)

    block_table = np.zeros((ROWS, config.max_blocks_per_req), np.int32)
    block_table[40000, 29] = 11  # positions 29696..30719
    block_table[65535, 32] = 12  # position 32768
    computed = np.zeros(ROWS, np.int32)
    scheduled = np.zeros(ROWS, np.int32)
    computed[[40000, 65535]] = [30000, MAX_MODEL_LEN - 1]
    scheduled[[40000, 65535]] = [3, 1]
    state = BatchState(token_ids=token_table(), block_table=jnp.asarray(block_table),
                       num_computed_tokens=jnp.asarray(computed), num_scheduled_tokens=jnp.asarray(scheduled))
    step = prepare_inputs(state, config, check=True)
    np.testing.assert_array_equal(step.input_ids[:4], [7, 8, 9, 424242])
    np.testing.assert_array_equal(step.positions[:4], [30000, 30001, 30002, MAX_MODEL_LEN - 1])
    np.testing.assert_array_equal(
        step.attn_metadata.slot_mapping[:4],
        [11 * BLOCK_SIZE + 304, 11 * BLOCK_SIZE + 305, 11 * BLOCK_SIZE + 306, 12 * BLOCK_SIZE])
    np.testing.assert_array_equal(step.idx_mapping[:2], [40000, 65535])
