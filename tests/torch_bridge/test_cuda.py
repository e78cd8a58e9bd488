"""torch_bridge on a CUDA GPU: zero copies, no host synchronisation, torch ordered after JAX.

These run only where JAX and torch both see a CUDA GPU (the GPU runbook,
`benchmarks/accelerator_check.sh`); elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.reference import pad_reference, prepare_reference  # noqa: E402
from jaxprep.walkthrough.examples import example_b, example_b_config  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu",
                                reason="needs CUDA torch and JAX on a CUDA GPU")
STRATEGIES = ("packed", "per_field")
SLOW_STEPS = 300  # 2048x2048 products: milliseconds on an H100, still running when torch reads


@jax.jit
def slow_token_ids(token_ids, seed):
    """``token_ids`` unchanged, returned only after a long chain of products that depends on ``seed``."""
    x = jnp.full((2048, 2048), seed, jnp.float32) * 1e-3

    def body(_, x):
        return jnp.tanh(x @ x)

    x = jax.lax.fori_loop(0, SLOW_STEPS, body, x)
    return token_ids + (x[0, 0] > 2.0).astype(jnp.int32)  # tanh < 1: adds 0, but only once x is done


def expected_step():
    arrays, config = example_b(), example_b_config()
    ref = prepare_reference(**arrays, block_size=config.block_size)
    bucket = config.bucket_for(ref["num_actual_tokens"])
    return arrays, config, pad_reference(ref, bucket, config.num_reqs_padded(bucket))


def test_dlpack_handoff_returns_before_jax_finishes_and_torch_reads_the_finished_values():
    """No host sync in `jax_to_torch`: the step is still running when it returns, yet a torch
    kernel on torch's current stream reads the final values (DLPack made that stream wait).

    (`to_torch` also fills the host mirrors vLLM reads on the CPU, ``seq_lens_cpu`` and the
    scalars: that one read of the packed buffer's tail does wait for the step.)
    """
    arrays, config, expected = expected_step()
    state = jaxprep.BatchState.from_numpy(**arrays)
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    # compile both outside the checked path: a compile would outlast the slow step
    jax.block_until_ready(jaxprep.prepare_inputs(dataclasses.replace(
        state, token_ids=slow_token_ids(state.token_ids, 1.0)), config, bucket))
    state = dataclasses.replace(state, token_ids=slow_token_ids(state.token_ids, 1.0))
    step = jaxprep.prepare_inputs(state, config, bucket)
    input_ids = torch_bridge.jax_to_torch(step.input_ids)
    still_running = not step.input_ids.is_ready()
    copied = (input_ids.to(torch.int64) + 0).cpu()  # a torch kernel on the current stream, then a copy
    assert still_running, "jax_to_torch waited for the step: the handoff synchronised the host"
    np.testing.assert_array_equal(copied.numpy(), expected["input_ids"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_fields_are_the_jax_buffers(strategy):
    """Zero copy: per_field tensors start at their JAX array's buffer; packed ones inside the one buffer."""
    arrays, config, expected = expected_step()
    step = jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**arrays), config)
    inputs = torch_bridge.to_torch(step, strategy=strategy)
    assert inputs.input_ids.device.type == "cuda" and inputs.attn_metadata.seq_lens_cpu.device.type == "cpu"
    if strategy == "per_field":
        assert inputs.input_ids.data_ptr() == step.input_ids.unsafe_buffer_pointer()
        assert inputs.attn_metadata.seq_lens.data_ptr() == step.attn_metadata.seq_lens.unsafe_buffer_pointer()
    else:
        start = inputs.jax_buffers[0].unsafe_buffer_pointer()
        end = start + inputs.jax_buffers[0].size * 4
        for tensor in (inputs.input_ids, inputs.positions, inputs.attn_metadata.slot_mapping):
            assert start <= tensor.data_ptr() < end
    np.testing.assert_array_equal(inputs.positions.cpu().numpy(), expected["positions"])
    np.testing.assert_array_equal(inputs.attn_metadata.slot_mapping.cpu().numpy(), expected["slot_mapping"])
