"""The attention state ladder (docs/semantics.md#ascend-state): one test per rung, and the reference over random
batches."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import AttnState, FeatureConfig, PrepConfig
from jaxprep.reference.requests import attn_state_reference
from support.feature_batches import RUN_MODES, batch_rows, feature_batches, run_step


def test_enum_matches_vllm_ascend():
    assert [(s.name, s.value) for s in AttnState] == [
        ("PrefillNoCache", 0), ("PrefillCacheHit", 1), ("DecodeOnly", 2), ("ChunkedPrefill", 3), ("SpecDecoding", 4)]


def make_config(k: int = 0, method: str | None = None, chunked: bool = True) -> PrepConfig:
    return PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=24, block_size=4,
                      features=FeatureConfig(attn_state=True, num_speculative_tokens=k, speculative_method=method,
                                             enable_chunked_prefill=chunked))


def batch(computed, scheduled, drafts=None) -> dict:
    """Rows after the given ones hold cached tokens but have no work: they must not count."""
    pad = 4 - len(computed)
    arrays = dict(token_ids=np.ones((4, 32), np.int32), block_table=np.ones((4, 8), np.int32),
                  num_computed_tokens=np.array(list(computed) + [5] * pad, np.int32),
                  num_scheduled_tokens=np.array(list(scheduled) + [0] * pad, np.int32))
    if drafts is not None:
        arrays["num_draft_tokens"] = np.array(list(drafts) + [0] * pad, np.int32)
    return arrays


RUNGS = [
    # rung 1: nothing cached, whatever else holds
    ("no cache", make_config(), batch([0, 0], [3, 5]), AttnState.PrefillNoCache),
    ("no cache, one token each", make_config(), batch([0, 0], [1, 1]), AttnState.PrefillNoCache),
    # rung 2: every request one token
    ("decode", make_config(), batch([4, 9], [1, 1]), AttnState.DecodeOnly),
    ("decode, spec not mtp", make_config(2, "eagle"), batch([4, 9], [1, 1], [0, 0]), AttnState.DecodeOnly),
    ("decode, mtp", make_config(2, "mtp"), batch([4, 9], [1, 1], [0, 0]), AttnState.SpecDecoding),
    # rung 3: one token plus drafts each
    ("drafts, mtp", make_config(2, "mtp"), batch([4, 9], [1, 3], [0, 2]), AttnState.SpecDecoding),
    ("drafts, eagle (backend sees ChunkedPrefill)", make_config(2, "eagle"), batch([4, 9], [1, 3], [0, 2]),
     AttnState.ChunkedPrefill),
    ("drafts, chunked prefill off", make_config(2, "mtp", chunked=False), batch([4, 9], [2, 3], [1, 2]),
     AttnState.SpecDecoding),
    # rung 4: chunked prefill enabled
    ("mixed", make_config(), batch([4, 0], [1, 7]), AttnState.ChunkedPrefill),
    ("mixed with drafts", make_config(2, "mtp"), batch([4, 0], [3, 7], [2, 0]), AttnState.ChunkedPrefill),
    # rung 5: otherwise
    ("cache hit", make_config(chunked=False), batch([4, 0], [1, 7]), AttnState.PrefillCacheHit),
    ("cache hit, all cached", make_config(chunked=False), batch([8, 16], [4, 2]), AttnState.PrefillCacheHit),
]


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("name, config, arrays, expected", RUNGS, ids=[r[0] for r in RUNGS])
def test_every_rung_of_the_ladder(mode, name, config, arrays, expected):
    step = run_step(arrays, config, mode)
    assert step.attn_state.shape == () and step.attn_state.dtype == np.int32
    assert AttnState(int(step.attn_state)) == expected
    features = config.features
    rows = batch_rows(arrays)
    drafts = arrays.get("num_draft_tokens", np.zeros(4, np.int32))[rows]
    assert attn_state_reference(arrays["num_computed_tokens"][rows], arrays["num_scheduled_tokens"][rows], drafts,
                                spec_decode=features.spec_decode, method=features.speculative_method,
                                enable_chunked_prefill=features.enable_chunked_prefill) == expected


CONFIGS = [make_config(), make_config(2, "mtp"), make_config(2, "eagle"), make_config(chunked=False),
           make_config(1, "mtp", chunked=False)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"k{c.features.num_speculative_tokens}-"
                         f"{c.features.speculative_method}-chunked{c.features.enable_chunked_prefill}")
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_attn_state_matches_reference(config, data):
    features = config.features
    arrays = data.draw(feature_batches(config, max_drafts=features.num_speculative_tokens))
    if data.draw(st.booleans()):  # make cache-free and decode-only batches common
        arrays["num_computed_tokens"][:] = 0 if data.draw(st.booleans()) else arrays["num_computed_tokens"]
    step = run_step(arrays, config, "jit")
    rows = batch_rows(arrays)
    drafts = arrays.get("num_draft_tokens", np.zeros(4, np.int32))[rows]
    want = attn_state_reference(arrays["num_computed_tokens"][rows], arrays["num_scheduled_tokens"][rows], drafts,
                                spec_decode=features.spec_decode, method=features.speculative_method,
                                enable_chunked_prefill=features.enable_chunked_prefill)
    assert int(step.attn_state) == want
