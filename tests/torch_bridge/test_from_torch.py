"""torch_bridge.from_torch: sampled token ids back into JAX, zero-copy where aligned, checked otherwise."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.walkthrough.examples import example_a_step1  # noqa: E402


def test_aligned_int32_is_shared_not_copied():
    sampled = torch.tensor([104, 203, 309], dtype=torch.int32)
    array = torch_bridge.from_torch(sampled)
    assert array.dtype == jnp.int32 and np.asarray(array).tolist() == [104, 203, 309]
    assert array.unsafe_buffer_pointer() == sampled.data_ptr()


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.arange(40, dtype=torch.int32)[1:9], id="unaligned"),
    pytest.param(lambda: torch.arange(16, dtype=torch.int32).reshape(4, 4).T, id="non-contiguous"),
    pytest.param(lambda: torch.arange(8, dtype=torch.int64), id="int64"),
])
def test_copy_is_explicit(make):
    tensor = make()
    array = torch_bridge.from_torch(tensor)
    assert array.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(array), tensor.cpu().numpy())
    assert array.unsafe_buffer_pointer() != tensor.data_ptr()
    with pytest.raises(BufferError, match="cannot be shared with JAX without a copy"):
        torch_bridge.from_torch(tensor, copy=False)


def test_copy_true_always_copies():
    sampled = torch.tensor([1, 2, 3], dtype=torch.int32)
    array = torch_bridge.from_torch(sampled, copy=True)
    assert array.unsafe_buffer_pointer() != sampled.data_ptr()
    sampled[0] = 99
    assert np.asarray(array).tolist() == [1, 2, 3]


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_int64_outside_int32_raises_naming_the_tensor(bad):
    sampled = torch.tensor([5, bad, 7], dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"sampled_token_ids holds {bad}, outside int32 \[-2147483648, 2147483647\]"):
        torch_bridge.from_torch(sampled, name="sampled_token_ids")


def test_int64_at_the_int32_bounds_is_kept_exactly():
    sampled = torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int64)
    assert np.asarray(torch_bridge.from_torch(sampled)).tolist() == [-(2**31), 0, 2**31 - 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_tensors_are_rejected(dtype):
    with pytest.raises(TypeError, match="sampled must hold integers"):
        torch_bridge.from_torch(torch.zeros(3, dtype=dtype), name="sampled")


def test_empty_tensor():
    array = torch_bridge.from_torch(torch.zeros((0,), dtype=torch.int64))
    assert array.shape == (0,) and array.dtype == jnp.int32


@functools.partial(jax.jit, donate_argnums=0)
def append_sampled(state: jaxprep.BatchState, sampled: jax.Array) -> jaxprep.BatchState:
    """Writes each scheduled row's sampled token after its last scheduled token (state rows in order)."""
    rows = jnp.arange(state.num_scheduled_tokens.shape[0])
    ends = state.num_computed_tokens + state.num_scheduled_tokens
    token_ids = state.token_ids.at[rows, ends].set(sampled)
    return dataclasses.replace(state, token_ids=token_ids, num_computed_tokens=ends)


def test_sampled_ids_round_trip_into_the_state():
    arrays = example_a_step1()
    state = jaxprep.BatchState.from_numpy(**arrays)
    sampled = torch.tensor([104, 203, 309], dtype=torch.int64)  # what a torch sampler returns
    new_state = append_sampled(state, torch_bridge.from_torch(sampled, name="sampled_token_ids"))
    token_ids = np.asarray(new_state.token_ids)
    assert token_ids[0, 3] == 104 and token_ids[1, 2] == 203 and token_ids[2, 5] == 309
    np.testing.assert_array_equal(np.asarray(new_state.num_computed_tokens), [3, 2, 5])


@pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu", reason="needs CUDA torch and JAX")
def test_cuda_int32_is_shared():  # pragma: no cover - no GPU in CI
    sampled = torch.arange(64, dtype=torch.int32, device="cuda")
    array = torch_bridge.from_torch(sampled)
    assert array.unsafe_buffer_pointer() == sampled.data_ptr()
    np.testing.assert_array_equal(np.asarray(array), np.arange(64))
