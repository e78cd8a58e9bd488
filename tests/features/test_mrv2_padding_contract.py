"""The padding contract of the LoRA and logits-indirection outputs: shapes, pads and real counts.

vLLM pads none of these (its arrays have the real length); jaxprep's have static lengths, real
counts in ``indices_len`` / ``cu_num_logits[-1]`` and named pad values past them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxprep import _constants as c
from support import mrv2_examples as ex
from support.feature_batches import run_step


def larger_budget(runner: str):
    """The running example's config with a 32-token budget: buckets 16, 24 and 32 hold its 12 tokens."""
    return dataclasses.replace(ex.config(runner), max_num_batched_tokens=32, token_buckets=(16, 24, 32))


def test_pad_constants_have_vllm_values():
    assert (c.NO_LORA_ID, c.EMPTY_LORA_SLOT, c.NO_LORA_SLOT, c.PLACEHOLDER_TOKEN_ID) == (0, -1, -1, -1)
    assert (c.PAD_ACTIVE_LORA_ID, c.PAD_NUM_TOKENS_PER_LORA, c.PAD_LORA_TOKEN_START_LOC) == (-1, 0, 0)  # vLLM's reset
    assert (c.PAD_SAMPLER_INDEX_PADDED, c.PAD_EMBEDDINGS_INDEX_OFFSET, c.PAD_LOCAL_POS, c.PAD_NUM_DRAFT_TOKENS) == (
        -1, 0, 0, 0)


@pytest.mark.parametrize("runner, rows", [("v1", ex.V1_ROWS), ("v2", ex.V2_SLOTS)])
@pytest.mark.parametrize("bucket", [16, 24, 32])
def test_lora_tail(runner, rows, bucket):
    step = run_step(ex.arrays(rows), larger_budget(runner), "jit", num_tokens_padded=bucket)
    lora, n = step.lora, 12
    num_reqs_padded = 6  # min(16, max_num_reqs)
    prompt_padded = min(bucket, num_reqs_padded * (ex.K + 1)) if runner == "v1" else num_reqs_padded
    num_prompt = int(lora.indices_len[1])
    assert lora.token_lora_mapping.shape == lora.token_lora_indices.shape == lora.embeddings_indices.shape == (bucket,)
    assert lora.prompt_lora_mapping.shape == lora.sampler_indices.shape == lora.sampler_indices_padded.shape == (
        prompt_padded,)
    assert (np.asarray(lora.token_lora_mapping)[n:] == c.NO_LORA_ID).all()
    assert (np.asarray(lora.token_lora_indices)[n:] == c.NO_LORA_SLOT).all()
    assert (np.asarray(lora.embeddings_indices)[n:] == c.PAD_EMBEDDINGS_INDEX_OFFSET).all()
    assert (np.asarray(lora.prompt_lora_mapping)[num_prompt:] == c.NO_LORA_ID).all()
    assert (np.asarray(lora.sampler_indices)[num_prompt:] == c.NO_LORA_SLOT).all()
    assert (np.asarray(lora.sampler_indices_padded)[num_prompt:] == c.PAD_SAMPLER_INDEX_PADDED).all()
    for meta, length in ((lora.token_mapping_meta, bucket), (lora.prompt_mapping_meta, prompt_padded)):
        real = n if meta is lora.token_mapping_meta else num_prompt
        sorted_rows = np.asarray(meta.token_indices_sorted_by_lora_ids)
        assert sorted(sorted_rows.tolist()) == list(range(length))  # a permutation
        assert sorted_rows[real:].tolist() == list(range(real, length))  # the tail is the identity
        num_ids = int((np.asarray(meta.num_tokens_per_lora) > 0).sum())
        assert meta.active_lora_ids.shape == meta.num_tokens_per_lora.shape == (5,)
        assert meta.lora_token_start_loc.shape == (6,)
        assert (np.asarray(meta.active_lora_ids)[num_ids:] == c.PAD_ACTIVE_LORA_ID).all()
        assert (np.asarray(meta.lora_token_start_loc)[num_ids + 1:] == c.PAD_LORA_TOKEN_START_LOC).all()
        assert int(np.asarray(meta.lora_token_start_loc)[num_ids]) == real


@pytest.mark.parametrize("bucket", [16, 24, 32])
def test_logits_indirection_tail(bucket):
    step = run_step(ex.arrays(ex.V2_SLOTS), larger_budget("v2"), "jit", num_tokens_padded=bucket)
    logits, num_logits, num_reqs = step.logits_indirection, 7, 4
    num_logits_padded = min(bucket, 6 * (ex.K + 1))
    assert logits.logits_indices.shape == logits.expanded_idx_mapping.shape == (num_logits_padded,)
    assert logits.cu_num_logits.shape == (7,) and logits.is_padding.shape == (bucket,)
    assert int(logits.num_logits) == num_logits
    assert (np.asarray(logits.cu_num_logits)[num_reqs + 1:] == num_logits).all()
    tail = {"logits_indices": c.PAD_LOGITS_INDEX, "expanded_idx_mapping": c.PAD_STATE_ROW,
            "expanded_local_pos": c.PAD_LOCAL_POS, "logits_pos": c.PAD_POSITION, "logits_input_ids": c.PAD_INPUT_ID}
    for name, pad in tail.items():
        assert (np.asarray(getattr(logits, name))[num_logits:] == pad).all(), name
    assert (np.asarray(logits.num_draft_tokens_per_req)[num_reqs:] == c.PAD_NUM_DRAFT_TOKENS).all()
    assert np.asarray(logits.is_padding).tolist() == [t >= 12 for t in range(bucket)]
