"""`FeatureConfig(runner="v2")`: vLLM's model runner V2 under one switch (batch order, logits rows, LoRA)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxprep import FeatureConfig, LoRAConfig, PrepConfig
from support import mrv2_examples as ex
from support.feature_batches import KERNEL_MODES, run_step
from support.mrv2_examples import full_graph_arrays, full_graph_config


def test_runner_v2_implies_the_v2_order_and_the_logits_indirection():
    v2 = FeatureConfig(runner="v2")
    assert v2.batch_order == "v2" and v2.logits_indirection_on and v2.any_on
    assert not FeatureConfig(runner="v2", logits_indirection=False).logits_indirection_on
    v1 = FeatureConfig()
    assert v1.runner == "v1" and v1.batch_order is None and not v1.logits_indirection_on and not v1.any_on
    assert FeatureConfig(reorder="v2").runner == "v1"  # V1 outputs in V2's row order stays available
    # the implied values follow the runner through dataclasses.replace
    assert dataclasses.replace(v1, runner="v2").logits_indirection_on
    assert dataclasses.replace(v2, runner="v1").batch_order is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(runner="v2", reorder="decode_first"), "runner='v2', reorder='decode_first'\\) contradicts itself"),
    (dict(runner="v3"), "FeatureConfig.runner='v3' must be one of \\('v1', 'v2'\\)"),
])
def test_contradictory_or_bad_switches_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FeatureConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_loras=0), "LoRAConfig.max_loras must be a positive int"),
    (dict(max_loras=2, vocab_size=0), "LoRAConfig.vocab_size must be a positive int"),
    (dict(max_loras=2, prompt_mapping="tokens"), "prompt_mapping='tokens' must be one of"),
    (dict(max_loras=3, vocab_size=2**30), "overflows int32 embeddings_indices"),
])
def test_bad_lora_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_lora_budget_that_overflows_sampler_indices_padded_is_rejected():
    with pytest.raises(ValueError, match="max_num_batched_tokens \\* \\(max_loras \\+ 1\\) overflows int32"):
        PrepConfig(max_num_reqs=4, max_model_len=16, max_num_batched_tokens=2**28, block_size=4,
                   features=FeatureConfig(lora=LoRAConfig(max_loras=15)))


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_running_example_core_outputs_in_v2(mode):
    """The step of vLLM's V2 runner on the running example: batch [r0, r3, r2, r1], slots [5, 1, 2, 3]."""
    step = run_step(ex.arrays(ex.V2_SLOTS), ex.config_for(mode), mode)
    meta = step.attn_metadata
    assert np.asarray(step.idx_mapping).tolist() == [5, 1, 2, 3, -1, -1]
    assert np.asarray(meta.query_start_loc)[:5].tolist() == [0, 3, 5, 6, 12]
    assert np.asarray(meta.seq_lens)[:4].tolist() == [12, 9, 13, 10]
    assert np.asarray(step.positions)[:12].tolist() == [9, 10, 11, 7, 8, 12, 4, 5, 6, 7, 8, 9]
    assert np.asarray(step.input_ids)[:12].tolist() == [19, 50, 51, 47, 60, 42, 24, 25, 26, 27, 28, 29]
    assert np.asarray(meta.slot_mapping).tolist() == [13, 14, 15, 51, 52, 40, 20, 21, 22, 23, 24, 25, -1, -1, -1, -1]


@pytest.mark.parametrize("mode", ["jit", "pallas"])
def test_v2_ties_go_by_descending_slot_and_v1_order_by_row(mode):
    """Two decodes with one draft each (K 1) at slots 4 and 5: V2 took slot 5 for the first arrival."""
    config = full_graph_config("v2")
    step = run_step(full_graph_arrays(), config, mode)
    assert np.asarray(step.idx_mapping)[:2].tolist() == [5, 4]
    v1 = run_step(full_graph_arrays(), dataclasses.replace(config, features=FeatureConfig(num_speculative_tokens=1,
                                                                                          reorder="v2")), mode)
    assert np.asarray(v1.idx_mapping)[:2].tolist() == [4, 5]
