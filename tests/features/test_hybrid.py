"""Hybrid (Mamba) metadata: vLLM's three worked examples, the NumPy reference, padding, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxprep._constants as pads
from jaxprep import FeatureConfig, InvalidBatchError, PrepConfig
from jaxprep.features import HybridConfig
from jaxprep.features.hybrid_chunks import max_num_chunks
from jaxprep.reference.hybrid import chunk_metadata_reference, hybrid_reference
from jaxprep.walkthrough.examples import sequential_block_table
from support.feature_batches import RUN_MODES, feature_batches, pad, run_step
from support.runner_examples import running_config, running_example


def prefill_batch(computed, scheduled, hybrid: HybridConfig, **extra):
    """Prefill rows only (prompts longer than this step), one state block each."""
    n = len(computed)
    config = PrepConfig(max_num_reqs=n, max_model_len=64, max_num_batched_tokens=48, block_size=4,
                        features=FeatureConfig(hybrid=hybrid))
    computed, scheduled = np.array(computed, np.int32), np.array(scheduled, np.int32)
    arrays = dict(token_ids=np.arange(n * 64, dtype=np.int32).reshape(n, 64),
                  block_table=sequential_block_table(-(-(computed + scheduled) // 4), config.max_blocks_per_req),
                  num_computed_tokens=computed, num_scheduled_tokens=scheduled,
                  prefill_len=computed + scheduled + 1,
                  mamba_block_table=np.arange(100, 100 + n, dtype=np.int32)[:, None], **extra)
    return config, arrays


@pytest.mark.parametrize("mode", RUN_MODES)
def test_worked_example_chunks(mode):
    """chunk 8, num_computed [5, 0, 16], qsl_p [0, 10, 13, 33] -> cu [0,3,10,13,21,29,33], seq_idx [0,0,1,2,2,2],
    last [1, 2, 5]."""
    config, arrays = prefill_batch([5, 0, 16], [10, 3, 20], HybridConfig(chunk_size=8))
    chunks = run_step(arrays, config, mode).hybrid.chunks
    num = int(chunks.num_chunks)
    assert num == 6
    assert np.asarray(chunks.cu_chunk_seqlen)[:num + 1].tolist() == [0, 3, 10, 13, 21, 29, 33]
    assert np.asarray(chunks.seq_idx)[:num].tolist() == [0, 0, 1, 2, 2, 2]
    assert np.asarray(chunks.last_chunk_indices).tolist() == [1, 2, 5]
    assert (np.asarray(chunks.cu_chunk_seqlen)[num:] == 33).all()
    assert (np.asarray(chunks.seq_idx)[num:] == pads.PAD_CHUNK_SEQ_IDX).all()
    assert chunks.checkpoint_chunk_indices is None


@pytest.mark.parametrize("mode", RUN_MODES)
def test_worked_example_checkpoints(mode):
    """Checkpoint offsets [0, 5], num_computed [5, 6], qsl_p [0, 2, 12] -> cu [0,2,4,7,12], seq_idx [0,1,1,1],
    last [0, 3], checkpoint chunks [-1, 2]."""
    config, arrays = prefill_batch([5, 6], [2, 10], HybridConfig(chunk_size=8, checkpoints=True),
                                   mamba_checkpoint_offsets=np.array([0, 5], np.int32))
    chunks = run_step(arrays, config, mode).hybrid.chunks
    num = int(chunks.num_chunks)
    assert np.asarray(chunks.cu_chunk_seqlen)[:num + 1].tolist() == [0, 2, 4, 7, 12]
    assert np.asarray(chunks.seq_idx)[:num].tolist() == [0, 1, 1, 1]
    assert np.asarray(chunks.last_chunk_indices).tolist() == [0, 3]
    assert np.asarray(chunks.checkpoint_chunk_indices).tolist() == [-1, 2]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_worked_example_align_state_indices(mode):
    """Align mode, B 16, 2 speculative blocks, seq_lens [33, 16, 1], rows [1..5], [6..11], [12..15]
    -> [[3, 4, 5], [6, 7, 8], [12, 13, 14]]."""
    hybrid = HybridConfig(mode="align", block_size=16, num_speculative_blocks=2)
    config, arrays = prefill_batch([32, 15, 0], [1, 1, 1], hybrid)
    table = np.zeros((3, hybrid.table_width(64)), np.int32)
    table[0, :5], table[1, :6], table[2, :4] = range(1, 6), range(6, 12), range(12, 16)
    step = run_step(dict(arrays, mamba_block_table=table), config, mode)
    assert np.asarray(step.hybrid.state_indices).tolist() == [[3, 4, 5], [6, 7, 8], [12, 13, 14]]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_running_example_split(mode):
    """The running example: r0, r3, r2 decode (S <= 1 + K), r1 is a prefill chunk."""
    config = running_config(hybrid=HybridConfig(num_speculative_blocks=2, chunk_size=4))
    arrays = running_example(config)
    arrays["mamba_block_table"] = np.array([[0, 0, 0], [11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43],
                                            [51, 52, 53]], np.int32)
    arrays["num_accepted_tokens"] = np.array([1, 2, 1, 1, 1, 3], np.int32)
    hybrid = run_step(arrays, config, mode).hybrid
    assert np.asarray(hybrid.split).tolist() == [3, 1, 6, 6]
    assert np.asarray(hybrid.state_indices_d)[:4].tolist() == [[51, 52, 53], [11, 12, 13], [21, 22, 23], [0, 0, 0]]
    assert np.asarray(hybrid.state_indices_p).tolist() == [31, 0, 0, 0, 0, 0]
    assert np.asarray(hybrid.query_start_loc_p).tolist() == [0, 6, 6, 6, 6, 6, 6]
    assert np.asarray(hybrid.query_start_loc_d).tolist() == [0, 3, 5, 6, 6, 6, 6]
    assert np.asarray(hybrid.has_initial_states_p).tolist() == [True, False, False, False, False, False]
    assert np.asarray(hybrid.num_accepted_tokens).tolist() == [3, 2, 1, 1, 1, 1]
    assert np.asarray(hybrid.num_decode_draft_tokens).tolist() == [2, 1, 0, -1, -1, -1]
    # r1: C 4, 6 tokens, chunk 4 -> [4, 8) then [8, 10)
    assert np.asarray(hybrid.chunks.cu_chunk_seqlen)[:3].tolist() == [0, 4, 6]


def test_prompt_tails_over_existing_state_run_as_decodes():
    """A one-token prompt extension over existing state (S - D == 1, C > 0) is a decode; a one-token
    first chunk (C == 0) stays a prefill, and so does everything after the first prefill."""
    hybrid = HybridConfig()
    config = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                        features=FeatureConfig(hybrid=hybrid))
    computed, scheduled = np.array([6, 3, 0, 5], np.int32), np.array([1, 1, 1, 1], np.int32)
    arrays = dict(token_ids=np.zeros((4, 32), np.int32), block_table=sequential_block_table([2, 1, 1, 2], 32),
                  num_computed_tokens=computed, num_scheduled_tokens=scheduled,
                  prefill_len=np.array([4, 10, 10, 10], np.int32),
                  mamba_block_table=np.array([[1], [2], [3], [4]], np.int32))
    hybrid_meta = run_step(arrays, config, "jit").hybrid
    assert np.asarray(hybrid_meta.is_prefilling).tolist() == [False, False, True, False]
    assert np.asarray(hybrid_meta.split).tolist() == [2, 2, 2, 2]  # row 3 decodes, but after the first prefill
    assert np.asarray(hybrid_meta.has_initial_states_p)[:2].tolist() == [False, True]


def test_padding_contract():
    assert (pads.PAD_STATE_INDEX, pads.PAD_NUM_ACCEPTED_TOKENS, pads.NO_DECODE_DRAFTS) == (pads.NULL_BLOCK_ID, 1, -1)
    assert (pads.PAD_CHUNK_SEQ_IDX, pads.PAD_LAST_CHUNK_INDEX, pads.NO_CHECKPOINT_CHUNK) == (0, 0, -1)
    assert max_num_chunks(6, 16, 8, False) == 14 and max_num_chunks(64, 512, 128, False) == 132
    assert max_num_chunks(4, 256, 16, True) == 32  # 2*4 + 16 + 8


K = 2
BASE = PrepConfig(max_num_reqs=6, max_model_len=48, max_num_batched_tokens=40, block_size=4)
VARIANTS = {
    "none, no spec": (FeatureConfig(hybrid=HybridConfig(chunk_size=8)), 0),
    "none, spec, checkpoints": (FeatureConfig(num_speculative_tokens=K, reorder="v2", hybrid=HybridConfig(
        num_speculative_blocks=K, chunk_size=4, checkpoints=True)), K),
    "align, spec": (FeatureConfig(num_speculative_tokens=K, reorder="decode_first", hybrid=HybridConfig(
        mode="align", block_size=8, num_speculative_blocks=1, chunk_size=16)), K),
    "align, no chunks": (FeatureConfig(hybrid=HybridConfig(mode="align", block_size=4)), 0),
}


def hybrid_inputs(arrays: dict, config, data) -> dict:
    """Mamba tables with distinct ids, accepted counts and valid checkpoint offsets for a drawn batch."""
    hybrid, rows = config.features.hybrid, config.max_num_reqs
    width = hybrid.table_width(config.max_model_len)
    arrays["mamba_block_table"] = (1 + np.arange(rows * width, dtype=np.int32)).reshape(rows, width)
    if config.features.spec_decode:
        arrays["num_accepted_tokens"] = np.array([data.draw(st.integers(1, 1 + K)) for _ in range(rows)], np.int32)
    if hybrid.checkpoints:
        arrays["mamba_checkpoint_offsets"] = np.array(
            [data.draw(st.integers(0, max(int(s) - 1, 0))) for s in arrays["num_scheduled_tokens"]], np.int32)
    return arrays


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_matches_reference(variant, data):
    features, k = VARIANTS[variant]
    config = dataclasses.replace(BASE, features=features)
    arrays = hybrid_inputs(data.draw(feature_batches(config, max_drafts=k)), config, data)
    step = run_step(arrays, config, "jit")
    meta = step.hybrid
    rows = np.asarray(step.idx_mapping)[: int(step.attn_metadata.num_reqs)]
    computed, scheduled = arrays["num_computed_tokens"][rows], arrays["num_scheduled_tokens"][rows]
    drafts = arrays["num_draft_tokens"][rows] if k else np.zeros(len(rows), np.int32)
    qsl = np.concatenate([[0], np.cumsum(scheduled)])
    want = hybrid_reference(qsl, computed, scheduled, drafts, arrays["prefill_len"][rows],
                            arrays["mamba_block_table"][rows], arrays.get("num_accepted_tokens", np.ones(6))[rows],
                            k, features.hybrid)
    r_pad = step.num_reqs_padded
    num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = want["split"]
    assert np.asarray(meta.split).tolist() == want["split"]
    check = {"state_indices": (want["state_indices"], pads.PAD_STATE_INDEX),
             "is_prefilling": (want["is_prefilling"], False),
             "state_indices_d": (want["state_indices_d"], pads.PAD_STATE_INDEX),
             "state_indices_p": (want["state_indices_p"], pads.PAD_STATE_INDEX),
             "query_start_loc_p": (want["query_start_loc_p"], num_prefill_tokens),
             "has_initial_states_p": (want["has_initial_states_p"], False)}
    if k:
        check.update(query_start_loc_d=(want["query_start_loc_d"], num_decode_tokens),
                     num_accepted_tokens=(want["num_accepted_tokens"], pads.PAD_NUM_ACCEPTED_TOKENS),
                     num_decode_draft_tokens=(want["num_decode_draft_tokens"], pads.NO_DECODE_DRAFTS))
    for name, (values, fill) in check.items():
        got = np.asarray(getattr(meta, name))
        np.testing.assert_array_equal(got, pad(values, got.shape[0], fill).astype(got.dtype), err_msg=name)
    if features.hybrid.chunk_size:
        chunks_match_reference(meta.chunks, want, computed, arrays, rows, features.hybrid, r_pad)


def chunks_match_reference(chunks, want, computed, arrays, rows, hybrid, r_pad) -> None:
    num_decodes, num_prefills = want["split"][:2]
    prefill = slice(num_decodes, num_decodes + num_prefills)
    offsets = arrays["mamba_checkpoint_offsets"][rows][prefill] if hybrid.checkpoints else None
    cu, seq_idx, last, ckpt = chunk_metadata_reference(hybrid.chunk_size, computed[prefill],
                                                       want["query_start_loc_p"][:num_prefills + 1], offsets)
    num = len(seq_idx)
    assert int(chunks.num_chunks) == num
    got_cu = np.asarray(chunks.cu_chunk_seqlen)
    np.testing.assert_array_equal(got_cu, pad(cu, got_cu.shape[0], cu[-1]))
    np.testing.assert_array_equal(np.asarray(chunks.seq_idx), pad(seq_idx, got_cu.shape[0] - 1,
                                                                  pads.PAD_CHUNK_SEQ_IDX))
    np.testing.assert_array_equal(np.asarray(chunks.last_chunk_indices), pad(last, r_pad, pads.PAD_LAST_CHUNK_INDEX))
    if hybrid.checkpoints:
        np.testing.assert_array_equal(np.asarray(chunks.checkpoint_chunk_indices), pad(ckpt, r_pad, -1))


def test_bad_hybrid_inputs_name_field_and_bound():
    config, arrays = prefill_batch([5, 6], [2, 10], HybridConfig(chunk_size=8, checkpoints=True),
                                   mamba_checkpoint_offsets=np.array([0, 5], np.int32))
    cases = [(dict(mamba_checkpoint_offsets=np.array([0, 10], np.int32)),
              r"mamba_checkpoint_offsets at row 1 is 10, which is outside \[0, num_scheduled_tokens\)"),
             (dict(mamba_block_table=np.array([[100], [0]], np.int32)),
              "mamba_block_table .the row's current state block. at row 1 is 0, which is the null block 0"),
             (dict(mamba_block_table=np.zeros((2, 2, 1), np.int32)), "mamba_block_table must be 2-D"),
             (dict(mamba_block_table=np.array([[100], [-3]], np.int32)), "which is below 0")]
    for update, message in cases:
        with pytest.raises((InvalidBatchError, ValueError), match=message):
            run_step(dict(arrays, **update), config, "jit")
    spec = running_config(hybrid=HybridConfig(num_speculative_blocks=2))
    spec_arrays = running_example(spec)
    spec_arrays["mamba_block_table"] = np.arange(1, 19, dtype=np.int32).reshape(6, 3)
    spec_arrays["num_accepted_tokens"] = np.array([1, 1, 1, 1, 1, 4], np.int32)
    with pytest.raises(InvalidBatchError, match=r"num_accepted_tokens at row 5 is 4, .* \[1, 1 \+ num_speculative"):
        run_step(spec_arrays, spec, "jit")
    del spec_arrays["num_accepted_tokens"]
    with pytest.raises(InvalidBatchError, match="num_accepted_tokens is missing: FeatureConfig.hybrid with spec"):
        run_step(spec_arrays, spec, "jit")


def test_hybrid_config_bounds():
    with pytest.raises(ValueError, match="mode='full' must be one of"):
        HybridConfig(mode="full")
    with pytest.raises(ValueError, match="block_size is needed in mode 'align'"):
        HybridConfig(mode="align")
    with pytest.raises(ValueError, match="checkpoints splits SSD chunks"):
        HybridConfig(checkpoints=True)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        HybridConfig(chunk_size=0)
    assert HybridConfig(mode="align", block_size=16, num_speculative_blocks=2).table_width(240) == 17
