"""Sampling metadata (`FeatureConfig.sampling`): the running example's worked values, random batches
against the NumPy reference, padding, validation and the admission normalisation."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, SamplingConfig, SamplingParams, validate
from jaxprep._constants import (
    PAD_FREQUENCY_PENALTY,
    PAD_MIN_P,
    PAD_PRESENCE_PENALTY,
    PAD_REPETITION_PENALTY,
    PAD_SEED,
    PAD_STATE_ROW,
    PAD_TEMPERATURE,
    PAD_TOP_P,
)
from jaxprep.features.sampling_params import seed_words, state_row
from jaxprep.reference.sampling import penalties_reference, sampling_rows_reference
from jaxprep.serving.sample.sampler import apply_min_p, apply_penalties, apply_temperature
from support import mrv2_examples as ex
from support.feature_batches import RUN_MODES, feature_batches, run_step
from support.sampling_examples import PARAMS, PROMPT, SAMPLING, V, example_arrays, example_config, slot_arrays

PADS = {"temperature": PAD_TEMPERATURE, "top_p": PAD_TOP_P, "min_p": PAD_MIN_P, "seeds": PAD_SEED,
        "repetition_penalty": PAD_REPETITION_PENALTY, "frequency_penalty": PAD_FREQUENCY_PENALTY,
        "presence_penalty": PAD_PRESENCE_PENALTY, "top_k": V, "idx_mapping": PAD_STATE_ROW}


def test_admission_normalises_as_vllm():
    """The worked example's slot arrays, slots 0..5 (slot 0 never written)."""
    arrays = example_arrays()
    np.testing.assert_allclose(arrays["temperature"], [0, 1.5, 1.0, 0, 0.5, 0.7])
    assert arrays["top_k"].tolist() == [64, 64, 64, 64, 3, 20]  # greedy r1's top_k 5 is dropped
    np.testing.assert_allclose(arrays["top_p"], [1, 0.8, 1, 1, 0.5, 0.9])
    np.testing.assert_allclose(arrays["min_p"], [0, 0, 0.1, 0, 0.2, 0])
    assert arrays["seeds_set"].tolist() == [False, False, False, False, True, True]
    assert tuple(arrays["seeds"][5]) == (0, 11)
    np.testing.assert_allclose(arrays["repetition_penalty"], [1, 1, 1.2, 1, 1.5, 1])
    np.testing.assert_allclose(arrays["frequency_penalty"], [0, 0.3, 0, 0, 0, 0])
    np.testing.assert_allclose(arrays["presence_penalty"], [0, 0, 0.5, 0, 0, 0])
    assert [p.use_penalty for p in (PARAMS[s] for s in (1, 2, 3, 4, 5))] == [True, True, False, True, False]


@pytest.mark.parametrize(("given_", "want"), [
    (dict(temperature=0.005), dict(temperature=0.01)),
    (dict(temperature=1e-6, top_p=0.5), dict(temperature=0.01, top_p=0.5)),  # raised first: not greedy
    (dict(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2), dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)),
    (dict(seed=-1), dict(seed=None)),
])
def test_sampling_params_normalisation(given_, want):
    params = SamplingParams(**given_)
    assert {name: getattr(params, name) for name in want} == want


@pytest.mark.parametrize(("field", "value", "bound"), [
    ("temperature", -0.1, ">= 0"), ("top_p", 0.0, "(0, 1]"), ("top_k", -2, ">= -1"), ("min_p", 1.5, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"), ("frequency_penalty", 2.5, "[-2, 2]"), ("presence_penalty", -3.0, "[-2, 2]"),
])
def test_sampling_params_reject_out_of_bounds(field, value, bound):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*{re.escape(bound)}"):
        SamplingParams(**{field: value})


def test_state_row_top_k_and_seed_words():
    assert state_row(SamplingParams(top_k=100), V)["top_k"] == V  # > V means V
    assert state_row(SamplingParams(top_k=-1), V)["top_k"] == V
    assert seed_words(-1) == (-1, -1) and seed_words(2**32 + 5) == (1, 5)
    row = state_row(SamplingParams(), V, np.random.default_rng(1))
    again = state_row(SamplingParams(), V, np.random.default_rng(1))
    assert row["seeds_set"] is False and row["seeds"] == again["seeds"]  # drawn on the host: reproducible given rng


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example(mode):
    """Per-row values and flags of the worked example (e = [5,5,5,1,1,2,3])."""
    step = run_step(example_arrays(), example_config(), mode)
    rows = step.sampling
    assert np.asarray(rows.idx_mapping)[:7].tolist() == [5, 5, 5, 1, 1, 2, 3]
    assert np.asarray(rows.top_k)[:7].tolist() == [20, 20, 20, 64, 64, 64, 64]
    np.testing.assert_allclose(np.asarray(rows.top_p)[:7], [0.9, 0.9, 0.9, 0.8, 0.8, 1, 1])
    assert bool(rows.any_greedy) and bool(rows.any_explicit_seed) and bool(rows.has_topp_only_rows)
    assert not bool(rows.all_greedy) and not bool(rows.all_random)
    ones = apply_temperature(np.ones((rows.temperature.shape[0], V), np.float32), rows)
    np.testing.assert_allclose(np.asarray(ones)[:7, 0], [1 / 0.7] * 3 + [1 / 1.5] * 2 + [1, 1], rtol=1e-6)
    ramp = np.tile(-0.05 * np.arange(V, dtype=np.float32), (rows.temperature.shape[0], 1))
    kept = np.isfinite(np.asarray(apply_min_p(ramp, rows))).sum(axis=1)
    assert kept[:7].tolist() == [64, 64, 64, 64, 64, 47, 64]  # row 5 (min_p 0.1) keeps v <= 46


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example_penalties(mode):
    """Logits of 2.0 through the penalties: r3's outputs 1.7 (and its draft 60 on row 4); r2's prompt
    2 / 1.2, its outputs 2 / 1.2 - 0.5; r0's and r1's rows unchanged."""
    arrays = example_arrays()
    step = run_step(arrays, example_config(), mode)
    state = BatchState.from_numpy(**arrays)
    logits = np.full((step.sampling.temperature.shape[0], V), 2.0, np.float32)
    if mode == "eager":
        with jax.disable_jit():
            got = np.asarray(apply_penalties(logits, step.sampling, state))
    else:
        got = np.asarray(jax.jit(apply_penalties)(logits, step.sampling, state))
    for row in (0, 1, 2, 6):
        assert (got[row] == 2.0).all(), row
    want3, want4, want5 = (np.full(V, 2.0) for _ in range(3))
    want3[44:48] = want4[44:48] = want4[60] = 1.7
    want5[30:38], want5[38:43] = 2 / 1.2, 2 / 1.2 - 0.5
    for row, want in ((3, want3), (4, want4), (5, want5)):
        np.testing.assert_allclose(got[row], want, rtol=1e-6, err_msg=f"row {row}")
    np.testing.assert_allclose(got[5, 30], 1.6667, atol=1e-4)
    np.testing.assert_allclose(got[5, 38], 1.1667, atol=1e-4)


def random_params(draw) -> SamplingParams:
    greedy = draw(st.booleans())
    return SamplingParams(
        temperature=0.0 if greedy else draw(st.sampled_from([0.3, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 1, 5, 200])), top_p=draw(st.sampled_from([1.0, 0.5, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.1])), seed=draw(st.sampled_from([None, 3, -7, 2**40])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.4])), presence_penalty=draw(st.sampled_from([0.0, -0.6])))


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), runner=st.sampled_from(["v1", "v2"]), k=st.sampled_from([0, 2]))
def test_random_batches_match_reference(mode, data, runner, k):
    features = FeatureConfig(num_speculative_tokens=k, runner=runner, sampling=SAMPLING)
    config = dataclasses.replace(ex.BASE, features=features)
    arrays = data.draw(feature_batches(config, max_drafts=k))
    arrays["token_ids"] %= V
    rows_total = config.max_num_reqs
    params = {slot: random_params(data.draw) for slot in range(rows_total) if data.draw(st.booleans())}
    prompt = {slot: int(arrays["prefill_len"][slot]) for slot in params}
    arrays.update(slot_arrays(params, arrays["token_ids"], prompt, prompt, rows_total))
    step = run_step(arrays, config, mode)
    num_reqs = int(step.attn_metadata.num_reqs)
    cu = np.asarray(step.sampling.cu_num_logits)
    num_logits = int(cu[num_reqs])
    expanded = np.asarray(step.sampling.idx_mapping)[:num_logits]
    want = sampling_rows_reference(arrays, expanded, np.asarray(step.idx_mapping)[:num_reqs], V)
    for name, pad in PADS.items():
        got = np.asarray(getattr(step.sampling, name))
        if name != "idx_mapping":
            np.testing.assert_array_equal(got[:num_logits], want[name], err_msg=name)
        assert (got[num_logits:] == pad).all(), name
    for flag in ("any_greedy", "all_greedy", "all_random", "any_explicit_seed", "do_top_k", "do_top_p", "do_min_p",
                 "do_penalties", "has_topp_only_rows"):
        assert bool(getattr(step.sampling, flag)) == want[flag], flag


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_penalties_match_reference(data):
    """Random slots, drafts and logits: `apply_penalties` against the per-row loop of the reference."""
    arrays = example_arrays()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    for slot in (1, 2, 3, 5):
        arrays["repetition_penalty"][slot] = rng.choice([1.0, 1.4, 0.7])
        arrays["frequency_penalty"][slot] = rng.choice([0.0, 0.3, -0.5])
        arrays["presence_penalty"][slot] = rng.choice([0.0, 0.6])
        arrays["output_bin_counts"][slot] = rng.integers(0, 3, V) * (rng.random(V) < 0.2)
    step = run_step(arrays, example_config(), "jit")
    logits = rng.normal(0, 2, (step.sampling.temperature.shape[0], V)).astype(np.float32)
    got = np.asarray(jax.jit(apply_penalties)(logits, step.sampling, BatchState.from_numpy(**arrays)))
    rows, cu = step.sampling, np.asarray(step.sampling.cu_num_logits)
    input_ids = np.asarray(rows.input_ids)
    for j in range(int(cu[4])):
        slot, p = int(rows.idx_mapping[j]), int(rows.expanded_local_pos[j])
        prompt = arrays["token_ids"][slot, :PROMPT[slot]]
        want = penalties_reference(logits[j], slot, p, input_ids[j - p:j + 1], prompt,
                                   arrays["output_bin_counts"][slot], arrays["repetition_penalty"][slot],
                                   arrays["frequency_penalty"][slot], arrays["presence_penalty"][slot])
        np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5, err_msg=f"row {j}")


@pytest.mark.parametrize(("field", "value", "bound"), [
    ("temperature", -1.0, "finite and >= 0"), ("top_k", 0, "in \\[1, vocab_size=64\\]"),
    ("top_k", 65, "vocab_size"), ("top_p", 1.5, "\\(0, 1\\]"), ("min_p", -0.1, "\\[0, 1\\]"),
    ("repetition_penalty", 0.0, "> 0"), ("frequency_penalty", np.inf, "finite"),
])
def test_validation_names_field_and_bound(field, value, bound):
    arrays = example_arrays()
    arrays[field][4] = value
    with pytest.raises(InvalidBatchError, match=rf"BatchState\.{field} at row 4 .*{bound}"):
        validate(BatchState.from_numpy(**arrays), example_config())


def test_validation_of_shapes_and_missing_fields():
    arrays = example_arrays()
    wrong = dict(arrays, output_bin_counts=np.zeros((6, V + 1), np.int32))
    with pytest.raises(InvalidBatchError, match=r"output_bin_counts has shape \(6, 65\), config expects \(6, 64\)"):
        validate(BatchState.from_numpy(**wrong), example_config())
    missing = {k: v for k, v in arrays.items() if k != "seeds"}
    with pytest.raises(InvalidBatchError, match="BatchState.seeds is missing: FeatureConfig.sampling"):
        validate(BatchState.from_numpy(**missing), example_config())


def test_sampling_config_is_checked():
    with pytest.raises(ValueError, match="SamplingConfig.vocab_size must be a positive int"):
        SamplingConfig(vocab_size=0)
    with pytest.raises((ValueError, TypeError), match="sampling"):  # TypeError: the tests' runtime type checks
        FeatureConfig(sampling=64)


def test_pad_constants_are_vllms_initial_values():
    """vLLM V2's never-written slot: T 0, top_p 1, min_p 0, seed 0, repetition 1, frequency 0, presence 0."""
    assert (PAD_TEMPERATURE, PAD_TOP_P, PAD_MIN_P, PAD_SEED) == (0.0, 1.0, 0.0, 0)
    assert (PAD_REPETITION_PENALTY, PAD_FREQUENCY_PENALTY, PAD_PRESENCE_PENALTY) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("bucket", [16, 24, 32])
def test_padding_contract(bucket):
    """Every bucket: L_pad = min(T_pad, R_pad (K + 1)) rows, the 7 real rows equal, the tail the pads."""
    config = dataclasses.replace(example_config(), max_num_batched_tokens=32, token_buckets=(16, 24, 32))
    step = run_step(example_arrays(), config, "jit", num_tokens_padded=bucket)
    base = run_step(example_arrays(), config, "jit", num_tokens_padded=16)
    num_logits_padded = min(bucket, 6 * (ex.K + 1))
    assert step.sampling.temperature.shape == (num_logits_padded,)
    assert step.sampling.seeds.shape == (num_logits_padded, 2)
    for name, pad in PADS.items():
        got, want = np.asarray(getattr(step.sampling, name)), np.asarray(getattr(base.sampling, name))
        np.testing.assert_array_equal(got[:7], want[:7], err_msg=name)
        assert (got[7:] == pad).all(), name
