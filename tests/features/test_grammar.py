"""Structured outputs: bitmask rows per logits row, the apply function and invalid drafts, against vLLM's example."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import FeatureConfig, InvalidBatchError, PrepConfig
from jaxprep._constants import NO_GRAMMAR
from jaxprep.features.grammar import apply_grammar_bitmask, grammar_invalid_drafts
from jaxprep.reference.grammar import (
    apply_grammar_bitmask_reference,
    grammar_invalid_drafts_reference,
    grammar_mapping_reference,
)
from jaxprep.reference.logits import logits_indirection_reference
from support.feature_batches import RUN_MODES, feature_batches, run_step
from support.runner_examples import running_config, running_example

VOCAB = 70  # three 32-bit words, the last one partly used


def running_grammar_step(mode: str, **features):
    """The running example with grammars on r0, r2, r3 (bitmask order; r1 is a prefill chunk)."""
    config = running_config(structured_outputs=True, **features)
    arrays = running_example(config)
    arrays["grammar_index"] = np.array([-1, 2, 1, -1, -1, 0], np.int32)  # slots: r3 -> 2, r2 -> 1, r0 -> 0
    return config, arrays, run_step(arrays, config, mode)


def call(fn, *args, mode: str):
    if mode == "eager":
        with jax.disable_jit():
            return fn(*args)
    return fn(*args)


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example_mapping_and_rows(mode):
    """vLLM's worked example: mapping [0,1,2,6,7,8,3,4,5]; logits rows 0-2 <- bitmask 0-2 (r0), 3-4 <- 6-7 (r3,
    its row 8 inactive), 5 <- 3 (r2, rows 4-5 inactive), 6 (r1) untouched."""
    _, _, step = running_grammar_step(mode)
    grammar = step.grammar
    assert np.asarray(grammar.mapping)[:9].tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5]
    assert (np.asarray(grammar.mapping)[9:] == NO_GRAMMAR).all()
    rows = np.asarray(grammar.bitmask_rows)
    assert rows[:7].tolist() == [0, 1, 2, 6, 7, 3, NO_GRAMMAR]
    assert (rows[7:] == NO_GRAMMAR).all()


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("acceptable, want", [([1, 0, 0], [False, False, True, False, True, False, False]),
                                              (None, [False, True, True, False, True, False, False]),
                                              ([2, 0, 1], None)])
def test_running_example_invalid_drafts(mode, acceptable, want):
    _, _, step = running_grammar_step(mode)
    limits = None if acceptable is None else jnp.asarray(acceptable, jnp.int32)
    invalid, any_invalid = call(grammar_invalid_drafts, step.grammar, limits, mode=mode)
    assert bool(any_invalid) == (want is not None)
    expected = want if want is not None else [False] * 7
    assert np.asarray(invalid)[:7].tolist() == expected
    assert not np.asarray(invalid)[7:].any()


def random_bitmask(rng, rows: int) -> np.ndarray:
    words = rng.integers(-(2**31), 2**31, (rows, -(-VOCAB // 32)), dtype=np.int64).astype(np.int32)
    return words


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example_apply_matches_the_kernel_reference(mode):
    _, arrays, step = running_grammar_step(mode)
    rng = np.random.default_rng(0)
    bitmask = random_bitmask(rng, 9)
    logits = rng.standard_normal((step.spec_decode.logits_indices.shape[0], VOCAB)).astype(np.float32)
    got = np.asarray(call(apply_grammar_bitmask, jnp.asarray(logits), jnp.asarray(bitmask), step.grammar, mode=mode))
    want = apply_grammar_bitmask_reference(logits, bitmask, [0, 1, 2, 6, 7, 8, 3, 4, 5], [0, 3, 5, 6, 7], 3)
    np.testing.assert_array_equal(got, want)
    assert np.isneginf(got[:6]).any() and not np.isneginf(got[6:]).any()  # r1 and the padded rows untouched


def test_bit_order_and_all_allowed_rows():
    """Bit v % 32 of word v // 32 allows token v; a word of -1 allows all; a 0 word masks all 32."""
    _, _, step = running_grammar_step("jit")
    bitmask = np.zeros((9, 3), np.int32)
    bitmask[0] = [0b101, -1, -1]  # r0 row 0: tokens 0 and 2 of the first word
    bitmask[1:] = -1
    bitmask[3] = [-1, 0, -1]  # r2's only row: tokens 32..63 masked
    got = np.asarray(apply_grammar_bitmask(jnp.ones((16, VOCAB)), jnp.asarray(bitmask), step.grammar))
    assert np.isfinite(got[0, [0, 2]]).all() and np.isneginf(got[0, [1, 3, 31]]).all()
    assert np.isfinite(got[0, 32:]).all() and np.isfinite(got[1:5]).all()
    assert np.isneginf(got[5, 32:64]).all() and np.isfinite(got[5, :32]).all() and np.isfinite(got[5, 64:]).all()


def test_without_spec_decode_one_row_per_request():
    config = dataclasses.replace(running_config(), features=FeatureConfig(structured_outputs=True, reorder="v2",
                                                                            num_speculative_tokens=0))
    arrays = running_example(config)
    arrays["num_draft_tokens"] = None
    arrays["num_scheduled_tokens"][[5, 1]] = 1  # r0 and r3 decode without drafts
    arrays["grammar_index"] = np.array([-1, 2, 1, -1, -1, 0], np.int32)
    step = run_step(arrays, config, "jit")
    rows = np.asarray(step.idx_mapping)[:4].tolist()
    g = {5: 0, 2: 1, 1: 2, 3: -1}
    assert np.asarray(step.grammar.bitmask_rows)[:4].tolist() == [g[row] for row in rows]
    assert np.asarray(step.grammar.mapping)[:3].tolist() == [rows.index(5), rows.index(2), rows.index(1)]


K = 2
CONFIG = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=32, block_size=4,
                    features=FeatureConfig(num_speculative_tokens=K, structured_outputs=True, reorder="v2"))


@settings(max_examples=25, deadline=None)
@given(arrays=feature_batches(CONFIG, max_drafts=K), data=st.data())
def test_matches_reference_over_random_grammars(arrays, data):
    scheduled_rows = np.flatnonzero(arrays["num_scheduled_tokens"] > 0)
    chosen = [int(r) for r in scheduled_rows if data.draw(st.booleans())]
    order = data.draw(st.permutations(chosen))
    arrays["grammar_index"] = np.full(6, -1, np.int32)
    arrays["grammar_index"][list(order)] = np.arange(len(order))
    step = run_step(arrays, CONFIG, "jit")
    batch_rows = np.asarray(step.idx_mapping)[: int(step.attn_metadata.num_reqs)].tolist()
    grammar_batch_rows = [batch_rows.index(row) for row in order]
    drafts = np.asarray(step.spec_decode.num_draft_tokens)[: len(batch_rows)]
    logits_rows = logits_indirection_reference(batch_rows, np.diff(np.asarray(step.attn_metadata.query_start_loc))
                                               [: len(batch_rows)], drafts, np.asarray(step.positions),
                                               np.asarray(step.input_ids), step.num_tokens_padded)
    num_logits = int(logits_rows["cu_num_logits"][-1])
    np.testing.assert_array_equal(np.asarray(step.grammar.local_pos)[:num_logits], logits_rows["expanded_local_pos"])
    np.testing.assert_array_equal(np.asarray(step.grammar.row_grammar_index)[:num_logits],
                                  arrays["grammar_index"][logits_rows["expanded_idx_mapping"]])
    mapping = grammar_mapping_reference(grammar_batch_rows, K + 1)
    assert np.asarray(step.grammar.mapping)[: len(mapping)].tolist() == mapping
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    bitmask = random_bitmask(rng, max(len(mapping), 1))
    logits = rng.standard_normal((step.spec_decode.logits_indices.shape[0], VOCAB)).astype(np.float32)
    got = np.asarray(apply_grammar_bitmask(jnp.asarray(logits), jnp.asarray(bitmask), step.grammar))
    np.testing.assert_array_equal(got, apply_grammar_bitmask_reference(logits, bitmask, mapping,
                                                                       logits_rows["cu_num_logits"], K + 1))
    acceptable = [data.draw(st.integers(0, K)) for _ in order] if data.draw(st.booleans()) else None
    invalid, any_invalid = grammar_invalid_drafts(step.grammar, None if acceptable is None else
                                                  jnp.asarray(acceptable + [0], jnp.int32))
    want = grammar_invalid_drafts_reference(grammar_batch_rows, acceptable, drafts)
    assert bool(any_invalid) == (want is not None)
    if want is not None:
        assert np.asarray(invalid)[: len(want)].tolist() == want.tolist()
        assert not np.asarray(invalid)[len(want):].any()


def test_grammar_index_must_number_the_bitmask_blocks():
    config, arrays, _ = running_grammar_step("jit")
    for index, message in [([-1, 2, 1, -1, -1, 2], r"0..G-1 once each \(G = 3\), got \[1, 2, 2\]"),
                           ([-1, 3, 1, -1, -1, 0], r"got \[0, 1, 3\]"),
                           ([-1, 2, 1, -1, 6, 0],
                            r"grammar_index at row 4 is 6, which is outside \[-1, max_num_reqs=6\)"),
                           ([-2, 2, 1, -1, -1, 0], "grammar_index at row 0 is -2")]:
        with pytest.raises(InvalidBatchError, match=message):
            run_step(dict(arrays, grammar_index=np.array(index, np.int32)), config, "jit")
    run_step(dict(arrays, grammar_index=np.array([-1, 2, 1, -1, 5, 0], np.int32)), config, "jit")  # row 4 unscheduled
    del arrays["grammar_index"]
    with pytest.raises(InvalidBatchError, match="grammar_index is missing: FeatureConfig.structured_outputs needs it"):
        run_step(arrays, config, "jit")


def test_a_bitmask_too_narrow_for_the_vocabulary_is_rejected():
    _, _, step = running_grammar_step("jit")
    with pytest.raises(ValueError, match=r"fewer than ceil\(vocab_size=70 / 32\)"):
        apply_grammar_bitmask(jnp.zeros((16, VOCAB)), jnp.zeros((9, 2), jnp.int32), step.grammar)
