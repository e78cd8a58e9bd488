"""`StepBuffer`: the prepared step as one int32 buffer equals the plain step, field for field.

`prepare_buffer` packs the step inside the jit that prepares it; its views (`StepBuffer.to_numpy`, one
host view per field through the static layout, and `StepBuffer.inputs`, the views unpacked by a jit) are
compared with `prepare_inputs`' own step (the XLA step, itself checked against the NumPy reference in
test_matches_reference.py) and, for the core fields, with the NumPy reference `prepare_reference`. The
negative control shifts one span of the layout by a word: the comparison names that field.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxprep import BatchState, FeatureConfig, KVCacheGroupSpec, PrepConfig, prepare_inputs
from jaxprep.config import block_table_width
from jaxprep.reference import prepare_reference
from jaxprep.step_buffer import StepBuffer, mismatched_fields, prepare_buffer
from support.feature_batches import block_table, build_feature_batch

BASE = PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4)
CASES = {  # every packing kind: INT32, INT64 (positions, slots), BOOL (the discard mask), nested features
    "plain": FeatureConfig(),
    "spec_groups": FeatureConfig(num_speculative_tokens=2, discard_request_mask=True, request_distribution=True,
                                 kv_groups=(KVCacheGroupSpec(4, kernel_block_size=2), KVCacheGroupSpec(8))),
}


def batch(case: str, seed: int):
    features = CASES[case]
    config = dataclasses.replace(BASE, features=features)
    rng = np.random.default_rng(seed)
    arrays = build_feature_batch(config, lambda lo, hi: int(rng.integers(lo, hi + 1)),
                                 max_drafts=features.num_speculative_tokens)
    if features.kv_groups:
        seq_lens = arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"]
        arrays["extra_block_tables"] = [
            block_table(config.max_num_reqs, block_table_width(config.max_model_len, g.block_size), seq_lens,
                        g.block_size, 10 + i) for i, g in enumerate(features.kv_groups[1:])]
    bucket = config.bucket_for(max(1, int(arrays["num_scheduled_tokens"].sum())))
    return config, arrays, BatchState.from_numpy(**arrays), bucket


@pytest.mark.parametrize("case", sorted(CASES))
def test_buffer_views_equal_the_plain_step(case):
    for seed in range(3):
        config, arrays, state, bucket = batch(case, seed)
        step = prepare_inputs(state, config, bucket)
        buffer = prepare_buffer(state, config, bucket)
        assert isinstance(buffer, StepBuffer) and buffer.words.ndim == 1  # one array out of the call
        assert mismatched_fields(buffer, step) == [], (case, seed)
        unpacked = buffer.inputs()
        for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(unpacked), jax.tree.leaves(step),
                                     strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want), (case, seed, path)
        if case == "plain":  # the core fields against the NumPy oracle too
            ref = prepare_reference(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                                    arrays["num_scheduled_tokens"], config.block_size)
            host = buffer.to_numpy()
            fields = dict(input_ids=host.input_ids, positions=host.positions, idx_mapping=host.idx_mapping,
                          slot_mapping=host.attn_metadata.slot_mapping, seq_lens=host.attn_metadata.seq_lens,
                          query_start_loc=host.attn_metadata.query_start_loc)
            for name, got in fields.items():
                want = np.asarray(ref[name])
                np.testing.assert_array_equal(got[:want.size], want, err_msg=name)


def test_a_shifted_span_is_caught():
    config, _, state, bucket = batch("spec_groups", 0)
    step = prepare_inputs(state, config, bucket)
    buffer = prepare_buffer(state, config, bucket)
    spans = list(buffer.layout.spans)
    k = next(i for i, span in enumerate(spans) if span.name == "seq_lens")
    spans[k] = spans[k]._replace(offset=spans[k].offset - 1)  # one word early
    shifted = StepBuffer(words=buffer.words, extras=buffer.extras,
                         layout=dataclasses.replace(buffer.layout, spans=tuple(spans)))
    assert mismatched_fields(shifted, step) == ["seq_lens"]
    assert mismatched_fields(buffer, step) == []
