"""Features that are off cost nothing; features that are on compose."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import (
    BatchState,
    FeatureConfig,
    KVCacheGroupSpec,
    LoRAConfig,
    PrepConfig,
    SamplingConfig,
    count_compiles,
    prepare_padded,
)
from jaxprep.config import block_table_width
from jaxprep.features import DrafterConfig, HybridConfig
from jaxprep.features.sampling import empty_sampling_rows
from jaxprep.state import OPTIONAL_FIELDS
from jaxprep.walkthrough.examples import example_a_config, example_a_step2
from support.all_features import ALL
from support.feature_batches import block_table, feature_batches, run_step
from support.runner_examples import check_pieces_make_the_step

OPTIONAL_OUTPUTS = ("spec_decode", "discard_request_mask", "kv_groups", "mrope_positions", "prompt_embeds",
                    "attn_state", "attn_mask", "request_distribution", "lora", "logits_indirection", "sampling",
                    "drafter", "hybrid", "grammar", "ubatches")


def test_plain_step_has_no_feature_outputs_or_inputs():
    config = example_a_config()
    assert not config.features.any_on
    step = run_step(example_a_step2(), config, "jit")
    assert all(getattr(step, name) is None for name in OPTIONAL_OUTPUTS)
    assert step.attn_metadata.dcp_local_seq_lens is None
    state = BatchState.empty(config)
    assert all(getattr(state, name) is None for name in OPTIONAL_FIELDS)


def test_equal_feature_configs_share_one_executable():
    """FeatureConfig is part of the static config: equal configs hit the same cache entry."""
    state = BatchState.from_numpy(**example_a_step2())
    first = dataclasses.replace(example_a_config(), max_num_batched_tokens=10, token_buckets=(4, 10))
    prepare_padded(state, first, 10)
    again = dataclasses.replace(first, features=FeatureConfig())
    with count_compiles() as count:
        prepare_padded(state, again, 10)
    assert count.compiles == 0


@pytest.mark.parametrize("features", [FeatureConfig(num_speculative_tokens=2), FeatureConfig(mrope=True),
                                      FeatureConfig(async_tokens=True, prompt_embeds=True),
                                      FeatureConfig(runner="v2", lora=LoRAConfig(max_loras=2)),
                                      FeatureConfig(sampling=SamplingConfig(vocab_size=40)),
                                      FeatureConfig(kv_groups=(KVCacheGroupSpec(4), KVCacheGroupSpec(8))),
                                      FeatureConfig(num_speculative_tokens=1, drafter=DrafterConfig(),
                                                    structured_outputs=True, hybrid=HybridConfig(
                                                        mode="align", block_size=4, chunk_size=4,
                                                        checkpoints=True))])
def test_empty_state_holds_every_input_a_feature_needs(features):
    config = PrepConfig(max_num_reqs=3, max_model_len=16, max_num_batched_tokens=8, block_size=4, features=features)
    state = BatchState.empty(config)
    arrays = {k: tuple(map(np.array, v)) if isinstance(v, tuple) else np.array(v) for k, v in state.to_numpy().items()}
    arrays["num_scheduled_tokens"][0] = 1
    arrays["block_table"][0, 0] = 1
    if "extra_block_tables" in arrays:
        arrays["extra_block_tables"][0][0, 0] = 1
    if "mrope_positions" in arrays:
        arrays["mrope_positions"][0, :, 0] = 0
    if "mamba_block_table" in arrays:
        arrays["mamba_block_table"][0, 0] = 1
    run_step(arrays, config, "jit")  # validates: nothing is missing


SINGLES = {
    "spec_decode": FeatureConfig(num_speculative_tokens=2),
    "discard_request_mask": FeatureConfig(discard_request_mask=True),
    "kv_groups": FeatureConfig(kv_groups=ALL.kv_groups, dcp=ALL.dcp),
    "mrope_positions": FeatureConfig(mrope=True),
    "prompt_embeds": FeatureConfig(prompt_embeds=True),
    "attn_state": FeatureConfig(attn_state=True, num_speculative_tokens=2, speculative_method="mtp"),
    "attn_mask": FeatureConfig(attn_mask="rows_bool"),
    "request_distribution": FeatureConfig(request_distribution=True, num_speculative_tokens=2),
    "drafter": FeatureConfig(num_speculative_tokens=2, drafter=DrafterConfig()),
    "hybrid": FeatureConfig(num_speculative_tokens=2, hybrid=ALL.hybrid),
    "grammar": FeatureConfig(num_speculative_tokens=2, structured_outputs=True),
    "lora": FeatureConfig(lora=ALL.lora, num_speculative_tokens=2),
    "logits_indirection": FeatureConfig(logits_indirection=True, num_speculative_tokens=2),
    "sampling": FeatureConfig(sampling=ALL.sampling, num_speculative_tokens=2),
}


@pytest.mark.parametrize("runner", ["v1", "v2"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_all_features_at_once_match_each_feature_alone(runner, data):
    base = PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4)
    config = dataclasses.replace(base, features=dataclasses.replace(ALL, runner=runner))
    arrays = data.draw(feature_batches(config, max_drafts=2))
    seq_lens = arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"]
    arrays["extra_block_tables"] = [block_table(5, block_table_width(40, 8), seq_lens, 8, 2)]
    prompts = arrays["prefill_len"]
    table = np.full((5, 3, 40), -1, np.int32)
    for row, length in enumerate(prompts):
        table[row, :, :length] = np.arange(length)
    arrays.update(mrope_positions=table, mrope_position_delta=np.zeros(5, np.int32),
                  is_token_ids=np.ones((5, 40), bool), prompt_embeds_start=np.zeros(5, np.int32),
                  prev_sampled_token_ids=np.zeros(5, np.int32), prev_batch_rows=np.full(5, -1, np.int32),
                  prev_draft_token_ids=np.zeros((5, 2), np.int32),
                  mamba_block_table=np.arange(1, 16, dtype=np.int32).reshape(5, 3),
                  num_accepted_tokens=np.ones(5, np.int32),
                  mamba_checkpoint_offsets=np.minimum(arrays["num_scheduled_tokens"] // 2, 3).astype(np.int32),
                  grammar_index=np.where(arrays["num_scheduled_tokens"] > 0,
                                         np.cumsum(arrays["num_scheduled_tokens"] > 0) - 1, -1).astype(np.int32),
                  lora_ids=np.array([0, 4, 9, 4, 0], np.int32),
                  lora_slots=np.array([9, -1, 4], np.int32),
                  **dict(empty_sampling_rows(5, ALL.sampling), temperature=np.array([0, 0.5, 1, 0.7, 2], np.float32),
                         top_k=np.array([100, 3, 100, 7, 100], np.int32)))
    # one bucket (the top) for every example: one executable per config instead of one per config and
    # bucket; the padding of each bucket is the padding contract's own test
    step = run_step(arrays, config, "jit", base.max_num_batched_tokens)
    for name, features in SINGLES.items():
        if runner == "v2":  # V2's order reads the drafts (decode_query_len = 1 + K): give every step the same
            features = dataclasses.replace(features, runner=runner, num_speculative_tokens=2)
        alone = run_step(arrays, dataclasses.replace(base, features=features), "jit", base.max_num_batched_tokens)
        want, got = jax.tree_util.tree_leaves(getattr(alone, name)), jax.tree_util.tree_leaves(getattr(step, name))
        assert len(want) == len(got) > 0, name
        for leaf_want, leaf_got in zip(want, got):
            np.testing.assert_array_equal(leaf_got, leaf_want, err_msg=name)
    assert step.attn_metadata.dcp_local_seq_lens is not None
    check_pieces_make_the_step(step)  # the micro-batches split this step's own (DCP, async) outputs


def test_torch_bridge_carries_feature_outputs():
    """torch_bridge.to_torch passes attn_state, attn_mask and spec_decode through (AttnState values)."""
    pytest.importorskip("torch")
    import torch_bridge
    from jaxprep import AttnState, prepare_inputs

    features = FeatureConfig(attn_state=True, attn_mask="rows_bool", num_speculative_tokens=2)
    arrays = dict(example_a_step2(), num_draft_tokens=np.array([0, 0, 2], np.int32))
    step = prepare_inputs(BatchState.from_numpy(**arrays), dataclasses.replace(example_a_config(), features=features))
    bridged = torch_bridge.to_torch(step)
    assert bridged.attn_metadata.attn_state == AttnState.ChunkedPrefill  # rung 3, no "mtp" method
    np.testing.assert_array_equal(bridged.attn_metadata.attn_mask.cpu().numpy(), np.asarray(step.attn_mask))
    assert bridged.spec_decode.draft_token_ids[:2].tolist() == [307, 308]
