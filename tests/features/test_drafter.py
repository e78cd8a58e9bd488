"""EAGLE / MTP drafter inputs: the running example as vLLM produced it, the NumPy reference, clamps, bad input."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxprep._constants as pads
from jaxprep import FeatureConfig, InvalidBatchError, PrepConfig
from jaxprep.features import DrafterConfig
from jaxprep.features.drafter import check_verification, draft_decode_advance, draft_decode_start, draft_prefill
from jaxprep.reference.drafter import (
    STALE,
    draft_decode_reference,
    draft_prefill_reference,
    next_prefill_tokens_reference,
    num_sampled_and_rejected_reference,
)
from jaxprep.reference.requests import prepare_reference_ordered
from support.feature_batches import RUN_MODES, feature_batches, pad, run_step
from support.runner_examples import IDX_MAPPING, running_config, running_example

EAGLE, GEMMA4 = DrafterConfig(), DrafterConfig(advance_draft_positions=False)


def drafter_run(step, num_sampled, last_sampled, mode: str):
    """`draft_prefill` under jit, or op by op."""
    args = (step, jnp.asarray(num_sampled, jnp.int32), jnp.asarray(last_sampled, jnp.int32))
    if mode == "eager":
        with jax.disable_jit():
            return draft_prefill(*args)
    return draft_prefill(*args)


def decode_run(fn, previous, draft_tokens, step, config, mode: str):
    if mode == "eager":
        with jax.disable_jit():
            return fn(previous, jnp.asarray(draft_tokens, jnp.int32), step, config=config)
    return fn(previous, jnp.asarray(draft_tokens, jnp.int32), step, config=config)


def running_drafter(mode: str, drafter=EAGLE):
    """The running example verified as vLLM's worked example: r0 accepts 2 (55, 56), r3 and r2 one each
    (48, 43); r1 is a chunk, whose sampler output is discarded (passed as 1 here)."""
    config = running_config(drafter=drafter)
    step = run_step(running_example(config), config, mode)
    last_sampled = np.zeros(6, np.int32)
    last_sampled[[5, 1, 2]] = [56, 48, 43]
    num_sampled = pad([2, 1, 1, 1], 6, 0)
    return config, step, drafter_run(step, num_sampled, last_sampled, mode)


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example_draft_step0(mode):
    """vLLM's worked example: ids_d [50,56,·,48,·,43,25..30], pos_d [9,10,·,7,·,12,4..9], qsl_d, seq_lens_d."""
    _, step, draft = running_drafter(mode)
    assert np.asarray(step.drafter.next_prefill_tokens).tolist() == [0, 0, 0, 30, 0, 0]  # tok(1, 10) for r1
    assert np.asarray(draft.idx_mapping).tolist() == [5, 1, 2, 3, -1, -1]
    assert np.asarray(draft.num_sampled).tolist() == [2, 1, 1, 0, 0, 0]
    assert np.asarray(draft.num_rejected).tolist() == [1, 1, 0, 0, 0, 0]
    assert np.asarray(draft.last_token_indices).tolist() == [1, 3, 5, 11, 0, 0]
    stale_id, stale_pos = pads.DRAFT_REJECTED_INPUT_ID, pads.DRAFT_REJECTED_POSITION
    assert np.asarray(draft.input_ids).tolist() == [50, 56, stale_id, 48, stale_id, 43, 25, 26, 27, 28, 29, 30,
                                                    0, 0, 0, 0]
    assert np.asarray(draft.positions).tolist() == [9, 10, stale_pos, 7, stale_pos, 12, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0]
    assert np.asarray(draft.query_start_loc).tolist() == [0, 3, 5, 6, 12, 12, 12]
    assert np.asarray(draft.seq_lens).tolist() == [12, 9, 13, 10, 0, 0]
    assert np.asarray(draft.decode_positions).tolist() == [10, 7, 12, 9, 0, 0]
    assert np.asarray(draft.sample_src_positions).tolist() == [11, 8, 13, 10, 0, 0]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example_draft_decode_steps(mode):
    """Step 1 with drafts [61, 3, 1, 63] (vLLM's stand-in sampler), then step 2 with [7, 8, 9, 10]."""
    config, step, draft = running_drafter(mode)
    one = decode_run(draft_decode_start, draft, pad([61, 3, 1, 63], 6, 0), step, config, mode)
    assert np.asarray(one.input_ids).tolist() == [61, 3, 1, 63, 0, 0]
    assert np.asarray(one.positions).tolist() == [11, 8, 13, 10, 0, 0]
    assert np.asarray(one.seq_lens).tolist() == [12, 9, 14, 11, 0, 0]
    assert np.asarray(one.query_start_loc).tolist() == [0, 1, 2, 3, 4, 4, 4]
    assert np.asarray(one.sample_src_positions).tolist() == [12, 9, 14, 11, 0, 0]
    # r0 (blocks 1,2,3) at position 11 -> block 3 slot 15; r3 (11,12,13) at 8 -> 13*4; r2 (7..10) at 13 -> 10*4+1
    assert np.asarray(one.slot_mapping).tolist() == [15, 52, 41, 26, -1, -1]
    two = decode_run(draft_decode_advance, one, pad([7, 8, 9, 10], 6, 0), step, config, mode)
    assert np.asarray(two.input_ids).tolist() == [7, 8, 9, 10, 0, 0]
    assert np.asarray(two.positions).tolist() == [12, 9, 14, 11, 0, 0]
    assert np.asarray(two.seq_lens).tolist() == [13, 10, 15, 12, 0, 0]
    assert np.asarray(two.sample_src_positions).tolist() == [13, 10, 15, 12, 0, 0]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_gemma4_keeps_positions_and_seq_lens(mode):
    """``advance_draft_positions=False``: positions stay at the last accepted token, seq_lens at
    target - rejected; only the sampling key moves."""
    config, step, draft = running_drafter(mode, GEMMA4)
    one = decode_run(draft_decode_start, draft, pad([61, 3, 1, 63], 6, 0), step, config, mode)
    assert np.asarray(one.positions).tolist() == [10, 7, 12, 9, 0, 0]
    assert np.asarray(one.seq_lens).tolist() == [11, 8, 13, 10, 0, 0]
    assert np.asarray(one.sample_src_positions).tolist() == [12, 9, 14, 11, 0, 0]
    two = decode_run(draft_decode_advance, one, pad([7, 8, 9, 10], 6, 0), step, config, mode)
    assert np.asarray(two.positions).tolist() == [10, 7, 12, 9, 0, 0]
    assert np.asarray(two.seq_lens).tolist() == [11, 8, 13, 10, 0, 0]
    assert np.asarray(two.sample_src_positions).tolist() == [13, 10, 15, 12, 0, 0]


def test_decode_steps_clamp_to_the_model_length():
    """A request at the end of max_model_len: positions stop at M - 1, seq_lens at M."""
    config = dataclasses.replace(running_config(drafter=DrafterConfig()), max_model_len=32)
    arrays = running_example(config)
    arrays["num_computed_tokens"][2] = 30  # r2 decodes position 30 of a 32-token window
    arrays["block_table"][2, :8] = [7, 8, 9, 10, 15, 16, 17, 18]
    step = run_step(arrays, config, "jit")
    last = np.zeros(6, np.int32)
    draft = draft_prefill(step, jnp.asarray(pad([2, 1, 1, 1], 6, 0), jnp.int32), jnp.asarray(last))
    assert int(draft.decode_positions[2]) == 30 and int(draft.seq_lens[2]) == 31
    state = draft_decode_start(draft, jnp.zeros(6, jnp.int32), step, config=config)
    got = [(int(state.positions[2]), int(state.seq_lens[2]))]
    for _ in range(2):
        state = draft_decode_advance(state, jnp.zeros(6, jnp.int32), step, config=config)
        got.append((int(state.positions[2]), int(state.seq_lens[2])))
    assert got == [(31, 32), (31, 32), (31, 32)]


def test_padding_contract_of_drafter_inputs():
    assert (pads.DRAFT_REJECTED_INPUT_ID, pads.DRAFT_REJECTED_POSITION, pads.PAD_LAST_TOKEN_INDEX,
            pads.PAD_SAMPLE_SRC_POSITION, pads.PAD_NEXT_PREFILL_TOKEN) == (0, 0, 0, 0, 0)


K = 3
CONFIG = PrepConfig(max_num_reqs=6, max_model_len=48, max_num_batched_tokens=40, block_size=4,
                    features=FeatureConfig(num_speculative_tokens=K, drafter=DrafterConfig(), reorder="v2"))


def reference_inputs(arrays: dict, step, num_sampled_raw, last_sampled) -> dict:
    """The drafter reference over `prepare_reference_ordered` (the target step from NumPy)."""
    rows = np.asarray(step.idx_mapping)[: int(step.attn_metadata.num_reqs)]
    ref = prepare_reference_ordered(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                                    arrays["num_scheduled_tokens"], CONFIG.block_size, rows)
    computed, scheduled = arrays["num_computed_tokens"][rows], arrays["num_scheduled_tokens"][rows]
    prefill_len = arrays["prefill_len"][rows]
    sampled, rejected = num_sampled_and_rejected_reference(num_sampled_raw[:len(rows)],
                                                           arrays["num_draft_tokens"][rows], ref["seq_lens"],
                                                           prefill_len)
    next_tokens = next_prefill_tokens_reference(arrays["token_ids"][rows], computed, scheduled, prefill_len)
    out = draft_prefill_reference(ref["query_start_loc"], ref["seq_lens"], ref["positions"], ref["input_ids"], rows,
                                  sampled, rejected, last_sampled, next_tokens, step.num_reqs_padded)
    return dict(out, num_sampled=sampled, num_rejected=rejected, next_prefill_tokens=next_tokens)


def compare_padded(got, want, length: int, stale_value: int, pad_value: int, name: str) -> None:
    """``want`` (unpadded, STALE where vLLM writes nothing) against ``got`` (padded)."""
    want = pad(np.where(want == STALE, stale_value, want), length, pad_value)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


@settings(max_examples=25, deadline=None)
@given(arrays=feature_batches(CONFIG, max_drafts=K), data=st.data())
def test_matches_reference_over_random_acceptance(arrays, data):
    step = run_step(arrays, CONFIG, "jit")
    num_reqs, r_pad, t_pad = int(step.attn_metadata.num_reqs), step.num_reqs_padded, step.num_tokens_padded
    drafts = np.asarray(step.spec_decode.num_draft_tokens)
    num_sampled = np.array([data.draw(st.integers(1, int(d) + 1)) for d in drafts[:num_reqs]]
                           + [0] * (r_pad - num_reqs))
    last_sampled = np.array(data.draw(st.lists(st.integers(1, 50_000), min_size=6, max_size=6)), np.int32)
    check_verification(step, num_sampled, last_sampled)
    draft = draft_prefill(step, jnp.asarray(num_sampled, jnp.int32), jnp.asarray(last_sampled))
    want = reference_inputs(arrays, step, num_sampled, last_sampled)
    compare_padded(draft.input_ids, want["input_ids"], t_pad, pads.DRAFT_REJECTED_INPUT_ID, pads.PAD_INPUT_ID, "ids")
    compare_padded(draft.positions, want["positions"], t_pad, pads.DRAFT_REJECTED_POSITION, pads.PAD_POSITION, "pos")
    for name in ("num_sampled", "num_rejected", "next_prefill_tokens", "decode_positions", "sample_src_positions"):
        got = draft if name != "next_prefill_tokens" else step.drafter
        compare_padded(getattr(got, name), want[name], r_pad, 0, 0, name)
    for name in ("idx_mapping", "query_start_loc", "seq_lens", "last_token_indices"):
        np.testing.assert_array_equal(np.asarray(getattr(draft, name)), want[name][: len(np.asarray(getattr(draft,
                                                                                                        name)))],
                                      err_msg=name)
    decode_steps_match_reference(step, draft, want, data)


def decode_steps_match_reference(step, draft, want, data) -> None:
    """Step 1 and two more decode steps against the reference kernels."""
    num_reqs, r_pad = int(step.attn_metadata.num_reqs), step.num_reqs_padded
    positions, seq_lens, src = want["decode_positions"], want["seq_lens"][:num_reqs], want["sample_src_positions"]
    rejected, state = want["num_rejected"], draft
    for k in range(3):
        tokens = np.array(data.draw(st.lists(st.integers(1, 50_000), min_size=r_pad, max_size=r_pad)))
        fn = draft_decode_start if k == 0 else draft_decode_advance
        state = fn(state, jnp.asarray(tokens, jnp.int32), step, config=CONFIG)
        ref = draft_decode_reference(tokens[:num_reqs], positions, seq_lens, src, CONFIG.max_model_len, r_pad,
                                     True, rejected if k == 0 else None)
        for name in ("input_ids", "positions", "seq_lens", "sample_src_positions"):
            np.testing.assert_array_equal(np.asarray(getattr(state, name)), pad(ref[name], r_pad, 0),
                                          err_msg=f"step {k + 1} {name}")
        np.testing.assert_array_equal(np.asarray(state.query_start_loc), ref["query_start_loc"])
        positions, seq_lens, src = ref["positions"], ref["seq_lens"], ref["sample_src_positions"]


def test_bad_verification_results_name_the_bound():
    _, step, _ = running_drafter("jit")
    last = np.zeros(6, np.int32)
    with pytest.raises(InvalidBatchError, match=r"num_sampled at batch row 0 is 4, outside \[1, num_draft_tokens"):
        check_verification(step, pad([4, 1, 1, 0], 6, 0), last)
    with pytest.raises(InvalidBatchError, match="num_sampled at batch row 2 is 0"):
        check_verification(step, pad([1, 1, 0, 0], 6, 0), last)
    with pytest.raises(InvalidBatchError, match="one entry per batch row"):
        check_verification(step, np.ones(4), last)
    with pytest.raises(InvalidBatchError, match="last_sampled"):
        check_verification(step, pad([1, 1, 1, 0], 6, 0), np.zeros(3))
    check_verification(step, pad([3, 2, 1, 0], 6, 0), last)  # r1 is a chunk: anything goes there


def test_drafter_needs_spec_decode_and_prefill_lengths():
    with pytest.raises(ValueError, match="drafter needs num_speculative_tokens > 0"):
        FeatureConfig(drafter=DrafterConfig())
    config = running_config(drafter=DrafterConfig())
    arrays = running_example(config)
    del arrays["prefill_len"]
    with pytest.raises(InvalidBatchError, match="prefill_len is missing: FeatureConfig.drafter needs it"):
        run_step(arrays, config, "jit")


def test_running_example_rows_are_the_v2_batch():
    config = running_config(drafter=DrafterConfig())
    step = run_step(running_example(config), config, "jit")
    assert np.asarray(step.idx_mapping)[:4].tolist() == list(IDX_MAPPING)
