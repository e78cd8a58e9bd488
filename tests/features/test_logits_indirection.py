"""V2's logits indirection (`FeatureConfig.logits_indirection`): worked examples and random batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import FeatureConfig
from jaxprep._constants import (
    PAD_INPUT_ID,
    PAD_LOCAL_POS,
    PAD_LOGITS_INDEX,
    PAD_NUM_DRAFT_TOKENS,
    PAD_POSITION,
    PAD_STATE_ROW,
)
from jaxprep.reference.logits import logits_indirection_reference
from support import mrv2_examples as ex
from support.feature_batches import KERNEL_MODES, RUN_MODES, feature_batches, run_step
from support.mrv2_examples import full_graph_arrays, full_graph_config

PADS = {"logits_indices": PAD_LOGITS_INDEX, "expanded_idx_mapping": PAD_STATE_ROW, "expanded_local_pos": PAD_LOCAL_POS,
        "logits_pos": PAD_POSITION, "logits_input_ids": PAD_INPUT_ID, "num_draft_tokens_per_req": PAD_NUM_DRAFT_TOKENS}


def fields(step) -> dict[str, np.ndarray]:
    return {f.name: np.asarray(getattr(step.logits_indirection, f.name))
            for f in dataclasses.fields(step.logits_indirection)}


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_running_example(mode):
    """Batch [r0, r3, r2, r1] with D [2, 1, 0, 0]: 7 logits rows, 12 tokens in a 16-token bucket."""
    got = fields(run_step(ex.arrays(ex.V2_SLOTS), ex.config_for(mode), mode))
    assert got["cu_num_logits"].tolist() == [0, 3, 5, 6, 7, 7, 7]  # [0, 3, 5, 6, 7], pads repeat L
    assert got["logits_indices"][:7].tolist() == [0, 1, 2, 3, 4, 5, 11]
    assert got["expanded_idx_mapping"][:7].tolist() == [5, 5, 5, 1, 1, 2, 3]
    assert got["expanded_local_pos"][:7].tolist() == [0, 1, 2, 0, 1, 0, 0]
    assert got["logits_pos"][:7].tolist() == [9, 10, 11, 7, 8, 12, 9]
    assert got["logits_input_ids"][:7].tolist() == [19, 50, 51, 47, 60, 42, 29]
    assert got["num_draft_tokens_per_req"][:4].tolist() == [2, 1, 0, 0]
    assert got["is_padding"].tolist() == [False] * 12 + [True] * 4


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_full_graph_example(mode):
    """K 1, two decodes with one draft each (C 9 and 7) at slots 5 and 4, 4 tokens in an 8-token bucket.

    vLLM pads this FULL graph to R_pad 4; jaxprep's rows are min(8, max_num_reqs 6) = 6, padded alike
    (query_start_loc repeats N, seq_lens 0).
    """
    step = run_step(full_graph_arrays(), full_graph_config("v2"), mode, num_tokens_padded=8)
    got, meta = fields(step), step.attn_metadata
    assert np.asarray(step.idx_mapping).tolist() == [5, 4, -1, -1, -1, -1]
    assert np.asarray(meta.query_start_loc).tolist()[:5] == [0, 2, 4, 4, 4]
    assert np.asarray(meta.seq_lens).tolist()[:4] == [11, 9, 0, 0]
    assert got["cu_num_logits"][:3].tolist() == [0, 2, 4] and (got["cu_num_logits"][3:] == 4).all()
    assert got["logits_indices"][:4].tolist() == [0, 1, 2, 3]
    assert got["expanded_idx_mapping"][:4].tolist() == [5, 5, 4, 4]
    assert got["expanded_local_pos"][:4].tolist() == [0, 1, 0, 1]
    assert got["is_padding"].tolist() == [False] * 4 + [True] * 4
    assert np.asarray(meta.slot_mapping)[4:].tolist() == [-1] * 4


def test_no_drafts_this_step_takes_the_no_draft_branch():
    """K > 0 but no drafts scheduled: cu_num_logits = arange(R + 1), expanded = idx_mapping, local 0."""
    arrays = ex.arrays(ex.V2_SLOTS)
    arrays["num_draft_tokens"][:] = 0
    step = run_step(arrays, ex.config("v2"), "jit")
    got = fields(step)
    assert got["cu_num_logits"][:5].tolist() == [0, 1, 2, 3, 4]
    assert got["expanded_idx_mapping"][:4].tolist() == np.asarray(step.idx_mapping)[:4].tolist()
    assert got["expanded_local_pos"][:4].tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(got["logits_indices"][:4], np.asarray(step.attn_metadata.query_start_loc)[1:5] - 1)


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), runner=st.sampled_from(["v1", "v2"]), k=st.sampled_from([0, 1, 3]))
def test_random_batches_match_reference(mode, data, runner, k):
    features = FeatureConfig(num_speculative_tokens=k, runner=runner, logits_indirection=True)
    config = dataclasses.replace(ex.BASE, features=features)
    arrays = data.draw(feature_batches(config, max_drafts=k))
    step = run_step(arrays, config, mode)
    num_reqs = int(step.attn_metadata.num_reqs)
    rows = np.asarray(step.idx_mapping)[:num_reqs]
    drafts = arrays["num_draft_tokens"][rows] if k else np.zeros(num_reqs, np.int64)
    want = logits_indirection_reference(rows, arrays["num_scheduled_tokens"][rows], drafts, np.asarray(step.positions),
                                        np.asarray(step.input_ids), step.num_tokens_padded)
    got = fields(step)
    num_logits = len(want["logits_indices"])
    np.testing.assert_array_equal(got["cu_num_logits"][: num_reqs + 1], want["cu_num_logits"])
    assert (got["cu_num_logits"][num_reqs + 1:] == num_logits).all()
    np.testing.assert_array_equal(got["is_padding"], want["is_padding"])
    for name, pad in PADS.items():
        real = num_reqs if name == "num_draft_tokens_per_req" else num_logits
        np.testing.assert_array_equal(got[name][:real], want[name], err_msg=name)
        assert (got[name][real:] == pad).all(), name
    if k:  # the same logits rows as V1's spec-decode metadata
        np.testing.assert_array_equal(got["logits_indices"], np.asarray(step.spec_decode.logits_indices))
