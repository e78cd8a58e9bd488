"""Bad feature inputs on the unchecked path (what a serving loop runs), every feature on, V1 and V2 order.

One row per kind of bad input (tests/support/bad_feature_inputs.py): the checked path raises naming the
field and the bound; the unchecked path sets the kind's bit of ``step.errors``, checkify's index checks
find no read or write out of bounds, every output index lies in range, and the state is unchanged.
Shapes that are wrong at trace time raise there, naming the field, on both paths.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from jaxprep import BatchState, InvalidBatchError, prepare_inputs, prepare_padded, validate
from jaxprep.prepare import prepare_body
from jaxprep.validate import describe_errors
from support.bad_feature_inputs import BAD_KINDS, assert_outputs_in_range, config, corrupt, valid_arrays

RUNNERS = ("v1", "v2")


@functools.cache
def checked_body():
    return jax.jit(checkify.checkify(prepare_body, errors=checkify.index_checks), static_argnums=(1, 2))


def host_copy(state: BatchState) -> dict:
    return {name: tuple(np.copy(a) for a in value) if isinstance(value, tuple) else np.copy(value)
            for name, value in state.to_numpy().items()}


def assert_unchanged(state: BatchState, before: dict) -> None:
    for name, value in state.to_numpy().items():
        for got, want in zip(value if isinstance(value, tuple) else (value,),
                             before[name] if isinstance(value, tuple) else (before[name],)):
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_valid_state_passes_and_sets_no_bit(runner):
    cfg = config(runner)
    state = BatchState.from_numpy(**valid_arrays())
    validate(state, cfg, num_tokens_padded=16)
    step = prepare_padded(state, cfg, 16)
    assert int(step.errors) == 0
    assert_outputs_in_range(step, cfg)
    error, _ = checked_body()(state, cfg, 16)
    assert error.get() is None
    # the negative control of the range checks: the valid step's own outputs, shifted, fail them
    with pytest.raises(AssertionError, match="logits_indices"):
        assert_outputs_in_range(dataclasses.replace(step, logits_indices=step.logits_indices + 16), cfg)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_input_is_named_flagged_and_stays_in_bounds(kind, runner):
    bad, cfg = BAD_KINDS[kind], config(runner)
    state = BatchState.from_numpy(**corrupt(kind))
    before = host_copy(state)
    with pytest.raises(InvalidBatchError, match=bad.named):
        prepare_inputs(state, cfg, 16, check=True)
    step = prepare_padded(state, cfg, 16)
    errors = int(step.errors)
    assert errors & bad.bit, (kind, errors)
    assert describe_errors(errors, cfg, 16)
    assert_outputs_in_range(step, cfg)
    error, _ = checked_body()(state, cfg, 16)
    assert error.get() is None, error.get()
    assert_unchanged(state, before)


def _narrow_group_table(arrays):
    arrays["extra_block_tables"] = [arrays["extra_block_tables"][0][:, :2]]


def _mrope_two_rows(arrays):
    arrays["mrope_positions"] = arrays["mrope_positions"][:, :2]


def _no_drafts(arrays):
    del arrays["num_draft_tokens"]


def _no_lora_slots(arrays):
    del arrays["lora_slots"]


def _short_sampling_rows(arrays):
    arrays["output_bin_counts"] = arrays["output_bin_counts"][:, :50]


TRACE_TIME = {
    "group table narrower than the config": (_narrow_group_table, r"extra_block_tables\[0\].*shape \(5, 2\).*W >= 5"),
    "M-RoPE table of shape [R, 2, M]": (_mrope_two_rows, r"mrope_positions has shape \(5, 2, 40\).*\(5, 3, 40\)"),
    "missing num_draft_tokens": (_no_drafts, r"num_draft_tokens is missing: FeatureConfig.num_speculative_tokens"),
    "missing lora_slots": (_no_lora_slots, r"lora_slots is missing: FeatureConfig.lora"),
    "sampling table of the wrong vocabulary": (_short_sampling_rows, r"output_bin_counts has shape \(5, 50\)"),
}


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("kind", TRACE_TIME)
def test_a_wrong_shape_raises_at_trace_time_naming_the_field(kind, check):
    change, named = TRACE_TIME[kind]
    arrays = valid_arrays()
    change(arrays)
    with pytest.raises(InvalidBatchError, match=named):
        prepare_inputs(BatchState.from_numpy(**arrays), config("v1"), 16, check=check)
    with pytest.raises(InvalidBatchError, match=named):  # nothing compiles: eval_shape traces only
        jax.eval_shape(functools.partial(prepare_body, config=config("v1"), num_tokens_padded=16),
                       BatchState.from_numpy(**arrays))


# --- a random corruption of a random valid state ------------------------------------------------

HOST_ONLY = {"output_bin_counts"}
"""Fields whose bound only the host checks: negative bin counts drive no read of the step."""
NOT_CORRUPTED = {"token_ids", "prev_sampled_token_ids", "prev_draft_token_ids", "seeds"}
"""Token values (no vocabulary bound in a PrepConfig) and seed words (every value is a seed)."""


def random_valid_arrays(draw) -> dict:
    """`valid_arrays` with random sampling rows, adapters, drafts, last-step rows and token ids."""
    arrays = valid_arrays()
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    arrays["token_ids"] = rng.integers(1, 90, arrays["token_ids"].shape, dtype=np.int32)
    arrays["temperature"] = rng.uniform(0, 2, 5).astype(np.float32)
    arrays["top_k"] = rng.integers(1, 101, 5, dtype=np.int32)
    arrays["top_p"] = rng.uniform(0.05, 1, 5).astype(np.float32)
    arrays["lora_ids"] = rng.choice(np.array([0, 4, 9], np.int32), 5)
    arrays["num_draft_tokens"][1] = rng.integers(0, 3)  # row 1 schedules 3 tokens: up to 2 drafts
    arrays["prev_batch_rows"] = np.where(arrays["num_scheduled_tokens"] > 0, rng.permutation(5), -1).astype(np.int32)
    return arrays


def corrupt_one_field(arrays: dict, draw) -> str:
    """Writes one drawn value (edge values likely) at one drawn index of one drawn field; returns the field."""
    name = draw(st.sampled_from(sorted(set(arrays) - NOT_CORRUPTED)))
    target = arrays[name][0] if name == "extra_block_tables" else arrays[name]
    index = tuple(draw(st.integers(0, n - 1)) for n in target.shape)
    if target.dtype == bool:
        value = draw(st.booleans())
    elif np.issubdtype(target.dtype, np.floating):
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf, -1.0, 0.0, 1.5]) | st.floats(-4, 4, width=32))
    else:
        value = draw(st.sampled_from([-2**31, -2, -1, 0, 1, 2**31 - 1]) | st.integers(-3, 100))
    target[index] = value
    return name


@pytest.mark.parametrize("runner", RUNNERS)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_corrupted_field_is_flagged_as_validate_sees_it_and_stays_in_bounds(runner, data):
    cfg = config(runner)
    arrays = random_valid_arrays(data.draw)
    name = corrupt_one_field(arrays, data.draw)
    state = BatchState.from_numpy(**arrays)
    before = host_copy(state)
    try:
        validate(state, cfg, num_tokens_padded=16)
        rejected = False
    except InvalidBatchError:
        rejected = True
    step = prepare_padded(state, cfg, 16)
    errors = int(step.errors)
    assert not errors or rejected, (name, describe_errors(errors, cfg, 16))  # no false alarm
    assert errors or not rejected or name in HOST_ONLY, name  # every host rejection has its bit
    assert_outputs_in_range(step, cfg)
    error, _ = checked_body()(state, cfg, 16)
    assert error.get() is None, (name, error.get())
    assert_unchanged(state, before)


# --- BatchState checks its leaves whichever constructor built it ----------------------------------

def _direct(**changes) -> BatchState:
    arrays = {name: jnp.asarray(value) for name, value in valid_arrays().items()
              if name in ("token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens")}
    return BatchState(**{**arrays, **changes})


@pytest.mark.parametrize("field, value, named", [
    ("token_ids", np.zeros((5, 40), np.float32), r"token_ids has dtype float32, expected int32"),
    ("num_scheduled_tokens", np.ones(5, bool), r"num_scheduled_tokens has dtype bool, expected int32"),
    ("token_ids", np.full((5, 40), 2**40 + 7, np.int64), r"token_ids has dtype int64, expected int32"),
    ("num_computed_tokens", np.zeros((5, 1), np.int32), r"num_computed_tokens must be 1-D"),
    ("num_computed_tokens", np.zeros(4, np.int32), r"num_computed_tokens has 4 rows, but token_ids has 5"),
    ("temperature", np.zeros(5, np.float64), r"temperature has dtype float64, expected float32"),
    ("extra_block_tables", (np.zeros((5, 5), np.int64),), r"extra_block_tables\[0\] has dtype int64"),
])
def test_a_state_built_directly_is_checked_like_from_numpy(field, value, named):
    with pytest.raises((TypeError, ValueError), match=named):
        _direct(**{field: value})
    _direct(**{field: None} if field in ("temperature", "extra_block_tables") else {})  # the control passes


def test_tracers_and_shape_structs_pass_the_leaf_checks():
    state = BatchState.from_numpy(**valid_arrays())
    shapes = jax.eval_shape(lambda s: s, state)  # rebuilt with ShapeDtypeStruct leaves
    assert isinstance(shapes, BatchState)
    doubled = jax.jit(lambda s: dataclasses.replace(s, num_computed_tokens=s.num_computed_tokens * 2))(state)
    np.testing.assert_array_equal(doubled.num_computed_tokens, valid_arrays()["num_computed_tokens"] * 2)
