"""The fused Pallas step with the features it covers (spec decode, the batch orders, V2's logits rows):
equal to the XLA step bit for bit, every output and the error word, on random batches and on bad input.

The kernels run in Pallas' interpreter on CPU (jaxprep/kernels/). Four feature sets reach every code path
of the kernels: the row kernel's scan (state-row order) and its ranking (V2's sort with ascending and
descending ties, decode-first), the logits rows over ``cu_num_logits`` and over ``cu_num_sampled_tokens``,
the draft rows, the clamp of placeholder drafts. Each compiles once, at one bucket, and is reused.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxprep import BatchState, FeatureConfig, PrepConfig, bounds, prepare_padded  # bounds: the core bits
from jaxprep.features import flags as bits
from support.batches import allocate_blocks
from support.feature_batches import build_feature_batch

BUCKET = 16
FEATURES = {
    "spec decode, runner v2": FeatureConfig(num_speculative_tokens=2, runner="v2"),
    "spec decode and V2's logits rows, state order": FeatureConfig(num_speculative_tokens=2, logits_indirection=True),
    "spec decode, V2 order, runner v1": FeatureConfig(num_speculative_tokens=2, reorder="v2"),
    "decode first and V2's logits rows, no drafts": FeatureConfig(reorder="decode_first", logits_indirection=True),
}


def config(name: str, kernel: str = "xla") -> PrepConfig:
    return PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=BUCKET, block_size=4, num_blocks=64,
                      features=FEATURES[name], kernel=kernel)


def leaves(step) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(step)}


def differing(step, other) -> list[str]:
    """The leaves (every output, the error word) where two steps differ in value or dtype."""
    theirs = leaves(other)
    return [name for name, value in leaves(step).items()
            if not (value.dtype == theirs[name].dtype and np.array_equal(value, theirs[name]))]


def both_paths(arrays: dict, name: str):
    state = BatchState.from_numpy(**arrays)
    return prepare_padded(state, config(name, "pallas"), BUCKET), prepare_padded(state, config(name), BUCKET)


@pytest.mark.parametrize("name", FEATURES)
def test_the_kernels_equal_xla_on_random_batches(name):
    """Twelve random batches (decodes with drafts, chunks, idle rows), some with -1 placeholder drafts.
    Negative control: one entry of one feature output shifted is the one difference seen."""
    rng = np.random.default_rng(sum(map(ord, name)))
    k = FEATURES[name].num_speculative_tokens
    for _ in range(12):
        arrays = build_feature_batch(config(name), lambda lo, hi: int(rng.integers(lo, hi + 1)), max_drafts=k)
        del arrays["prefill_len"]  # read by no feature here: the bad-input test's executable serves
        if k and rng.random() < 0.5:  # a -1 placeholder draft: kept in draft_token_ids, 0 in input_ids
            arrays["token_ids"][rng.integers(0, 5), rng.integers(0, 40)] = -1
        pallas, xla = both_paths(arrays, name)
        assert differing(pallas, xla) == [], differing(pallas, xla)
    field, shifted = ("spec_decode", "target_logits_indices") if k else ("logits_indirection", "expanded_local_pos")
    feature = getattr(xla, field)
    changed = dataclasses.replace(xla, **{field: dataclasses.replace(
        feature, **{shifted: getattr(feature, shifted).at[0].add(1)})})
    assert differing(pallas, changed) == [f".{field}.{shifted}"]


def valid_arrays() -> dict:
    """R 5, M 40, B 4, K 2; 14 tokens: a 6-token prefill chunk from 0; a decode at 12 with 2 drafts (their ids
    at positions 13, 14); no work; a 4-token chunk from 4; a decode at 20."""
    computed, scheduled = np.array([0, 12, 0, 4, 20], np.int32), np.array([6, 3, 0, 4, 1], np.int32)
    needed = [-(-int(n) // 4) for n in computed + scheduled]
    return dict(token_ids=np.arange(5 * 40, dtype=np.int32).reshape(5, 40) % 90 + 1,
                block_table=allocate_blocks(5, 10, needed, 63, 3), num_computed_tokens=computed,
                num_scheduled_tokens=scheduled, num_draft_tokens=np.array([0, 2, 0, 0, 0], np.int32))


BAD = {  # kind -> ((field, index, value), ...), the bit it sets
    "negative scheduled": ((("num_scheduled_tokens", 1, -3),), bounds.NEGATIVE_COUNT),
    "negative computed": ((("num_computed_tokens", 3, -6),), bounds.NEGATIVE_COUNT),
    "past max_model_len": ((("num_computed_tokens", 4, 39), ("num_scheduled_tokens", 4, 2)), bounds.PAST_MAX_MODEL_LEN),
    "int32 wrap": ((("num_computed_tokens", 4, 2**31 - 2),), bounds.PAST_MAX_MODEL_LEN),
    "block id too large": ((("block_table", (0, 0), 64),), bounds.BLOCK_ID_OUT_OF_RANGE),
    "negative block id": ((("block_table", (3, 1), -4),), bounds.BLOCK_ID_OUT_OF_RANGE),
    "null block": ((("block_table", (4, 5), 0),), bounds.NULL_BLOCK),
    "over the bucket": ((("num_scheduled_tokens", 0, 12),), bounds.OVER_BUCKET),
    "drafts above K": ((("num_draft_tokens", 1, 3), ("num_scheduled_tokens", 1, 4)), bits.DRAFTS_OUT_OF_RANGE),
    "negative drafts on an idle row": ((("num_draft_tokens", 2, -1),), bits.DRAFTS_OUT_OF_RANGE),
    "drafts near 2**31": ((("num_draft_tokens", 1, 2**31 - 1),), bits.DRAFTS_OUT_OF_RANGE),
    "S below D + 1": ((("num_draft_tokens", 4, 1),), bits.DRAFTS_PAST_SCHEDULED),
}
ON_BAD_INPUT = ("spec decode, runner v2", "spec decode and V2's logits rows, state order")
"""The row kernel's ranking and its scan."""


@pytest.mark.parametrize("name", ON_BAD_INPUT)
@pytest.mark.parametrize("kind", BAD)
def test_bad_input_sets_the_same_bits_and_drops_the_same_rows_as_xla(kind, name):
    """Each kind sets its bit on both paths, and every output equals the XLA step's. Negative control: the
    bad input changes the step (the valid batch's differs), so equality is not vacuous."""
    arrays = valid_arrays()
    changes, bit = BAD[kind]
    for field, index, value in changes:
        arrays[field][index] = value
    pallas, xla = both_paths(arrays, name)
    assert int(pallas.errors) & bit, (kind, int(pallas.errors))
    assert differing(pallas, xla) == [], differing(pallas, xla)
    valid, _ = both_paths(valid_arrays(), name)
    assert int(valid.errors) == 0 and differing(pallas, valid)
