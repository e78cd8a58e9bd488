"""Lifetime: bridged tensors stay valid and unchanged across donated JAX updates and garbage collection."""

from __future__ import annotations

import dataclasses
import functools
import gc

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxprep  # noqa: E402
import torch_bridge  # noqa: E402
from jaxprep.reference import pad_reference, prepare_reference  # noqa: E402
from jaxprep.walkthrough.examples import example_b, example_b_config  # noqa: E402
from support.bridge_checks import JAX_TORCH_DEVICE  # noqa: E402

STRATEGIES = ("packed", "per_field")
HELD_BUFFER_DONATION = "Donation requested for buffer with external reference"
"""PJRT's error on a GPU when a donated argument's buffer is still held by torch (the CPU copies instead)."""


@functools.partial(jax.jit, donate_argnums=0)
def scramble_state(state: jaxprep.BatchState) -> jaxprep.BatchState:
    """A donated state update that rewrites every table (as a serving loop's post-update would)."""
    return dataclasses.replace(state, token_ids=state.token_ids + 1000, block_table=state.block_table * 3 + 1,
                               num_computed_tokens=state.num_computed_tokens + 7,
                               num_scheduled_tokens=state.num_scheduled_tokens[::-1])


@functools.partial(jax.jit, donate_argnums=0)
def scramble_step(step):
    """A donated update of the step's own arrays: every int32 leaf overwritten with -7."""
    return jax.tree.map(lambda leaf: leaf * 0 - 7, step)


def expected_tensors() -> dict[str, np.ndarray]:
    config, arrays = example_b_config(), example_b()
    ref = prepare_reference(**arrays, block_size=config.block_size)
    num_tokens_padded = config.bucket_for(ref["num_actual_tokens"])
    return pad_reference(ref, num_tokens_padded, config.num_reqs_padded(num_tokens_padded))


def bridged_step(strategy: str):
    state = jaxprep.BatchState.from_numpy(**example_b())
    step = jaxprep.prepare_inputs(state, example_b_config())
    return state, step, torch_bridge.to_torch(step, strategy=strategy)


def assert_unchanged(inputs) -> None:
    expected = expected_tensors()
    meta = inputs.attn_metadata
    actual = {"input_ids": inputs.input_ids, "positions": inputs.positions, "slot_mapping": meta.slot_mapping,
              "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
              "block_table": meta.block_table_tensor,
              "idx_mapping": inputs.idx_mapping, "logits_indices": inputs.logits_indices}
    for name, tensor in actual.items():
        np.testing.assert_array_equal(tensor.cpu().numpy(), expected[name], err_msg=name)
    np.testing.assert_array_equal(meta.seq_lens_cpu.cpu().numpy(), expected["seq_lens"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tensors_survive_donating_the_state_they_came_from(strategy):
    state, _, inputs = bridged_step(strategy)
    new_state = scramble_state(state)
    jax.block_until_ready(new_state)
    assert state.token_ids.is_deleted(), "the update must really have consumed the donated state"
    jax.block_until_ready(jaxprep.prepare_inputs(new_state, example_b_config(), 200))  # reuse freed memory
    assert_unchanged(inputs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_shared_buffer_is_never_reused_by_a_donated_update(strategy):
    _, step, inputs = bridged_step(strategy)
    shared = {tensor.data_ptr() for tensor in (inputs.input_ids, inputs.attn_metadata.block_table_tensor)}
    if strategy == "per_field" and JAX_TORCH_DEVICE != "cpu":  # the step's own buffers are held: refused
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=HELD_BUFFER_DONATION):
            jax.block_until_ready(scramble_step(step))  # raised at the call or at the wait, by jax version
        assert_unchanged(inputs)
        return
    scrambled = jax.block_until_ready(scramble_step(step))
    outputs = {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(scrambled)}
    assert not shared & outputs, "a donated update wrote into memory torch still reads"
    assert int(np.asarray(scrambled.input_ids)[0]) == -7
    assert_unchanged(inputs)


def test_per_field_external_reference_blocks_donation():
    """While torch holds a field, PJRT keeps its buffer: the donated argument is not consumed
    (the CPU client copies it; a GPU client refuses the call)."""
    _, step, inputs = bridged_step("per_field")
    if JAX_TORCH_DEVICE == "cpu":
        scramble_step(step)
    else:
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=HELD_BUFFER_DONATION):
            jax.block_until_ready(scramble_step(step))
    assert not step.input_ids.is_deleted()
    assert inputs.input_ids.data_ptr() == step.input_ids.unsafe_buffer_pointer()
    assert_unchanged(inputs)


def test_packed_buffer_is_out_of_reach_of_donation():
    """With the packed strategy the shared buffer is internal: donating the whole step leaves it alone."""
    _, step, inputs = bridged_step("packed")
    scramble_step(step)
    assert step.input_ids.is_deleted(), "the step's own arrays were donated"
    assert not inputs.jax_buffers[0].is_deleted()
    assert_unchanged(inputs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tensors_outlive_every_jax_reference(strategy):
    _, _, inputs = bridged_step(strategy)
    inputs = dataclasses.replace(inputs, jax_buffers=())  # drop the bridge's own references too
    gc.collect()
    churn = [jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**example_b()), example_b_config())
             for _ in range(4)]
    jax.block_until_ready(churn)
    assert_unchanged(inputs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bridging_a_donated_step_names_the_cause(strategy):
    step = jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**example_b()), example_b_config())
    scramble_step(step)
    with pytest.raises(ValueError, match="input_ids was deleted .donated"):
        torch_bridge.to_torch(step, strategy=strategy)
