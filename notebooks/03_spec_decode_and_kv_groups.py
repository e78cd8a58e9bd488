# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Speculative decoding and several KV-cache groups
#
# Two optional features of `jaxprep.prepare_inputs`, switched on statically through
# `PrepConfig(features=jaxprep.FeatureConfig(...))`. Off (the default), a feature adds no work and no
# output; on, its inputs are extra `BatchState` fields and its outputs extra `StepInputs` fields.
# The cells reproduce the worked examples in docs/semantics.md#spec-decode, #kv-groups and assert their values.

# %%
import dataclasses

import numpy as np

import jaxprep
from jaxprep.config import block_table_width
from jaxprep.walkthrough import format_step, prepare_record
from jaxprep.walkthrough.examples import example_a_config, example_a_step1, example_a_step2, sequential_block_table


def spec_fields(step) -> dict:
    """The real entries of the step's spec-decode metadata, as lists."""
    spec = step.spec_decode
    num_logits, num_drafts = int(spec.num_logits), int(spec.total_num_draft_tokens)
    sizes = {"logits_indices": num_logits, "target_logits_indices": num_drafts, "draft_token_ids": num_drafts}
    return {f.name: np.asarray(getattr(spec, f.name))[: sizes.get(f.name)].tolist()
            for f in dataclasses.fields(spec) if f.name != "max_spec_len"}


# %% [markdown]
# ## Speculative decoding (docs/semantics.md#spec-decode)
#
# A request with `D` draft tokens schedules them after its last sampled token: `S = D + 1` tokens.
# The target model then needs logits at **all** of them, not only the last: logit row `j` verifies
# the draft at `j + 1`, and the last row gives the bonus token. `BatchState.num_draft_tokens` says how
# many of each row's scheduled tokens are drafts.
#
# The example from vLLM's source (docs/semantics.md#spec-decode): five requests with `D = [3, 0, 2, 0, 1]` and
# `cu_num_tokens = [4, 104, 107, 207, 209]` (two of them are 100-token prefill chunks with no drafts).

# %%
config = jaxprep.PrepConfig(max_num_reqs=5, max_model_len=128, max_num_batched_tokens=256, block_size=16,
                            features=jaxprep.FeatureConfig(num_speculative_tokens=3))
scheduled = np.array([4, 100, 3, 100, 2], np.int32)
state = jaxprep.BatchState.from_numpy(
    # row r, position p: 1000 r + p
    token_ids=(1000 * np.arange(5)[:, None] + np.arange(128)[None, :]).astype(np.int32),
    block_table=sequential_block_table(-(-scheduled // 16), config.max_blocks_per_req),
    num_computed_tokens=np.zeros(5, np.int32), num_scheduled_tokens=scheduled,
    num_draft_tokens=np.array([3, 0, 2, 0, 1], np.int32))
step = jaxprep.prepare_inputs(state, config, check=True)
spec = spec_fields(step)
for name, value in spec.items():
    print(f"{name:24s} {value}")

# %%
# docs/semantics.md#spec-decode, the worked example from the source
assert np.cumsum(scheduled).tolist() == [4, 104, 107, 207, 209]
assert spec["cu_num_sampled_tokens"] == [4, 5, 8, 9, 11]
assert spec["cu_num_draft_tokens"] == [3, 3, 5, 5, 6]
assert spec["logits_indices"] == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
assert spec["target_logits_indices"] == [0, 1, 2, 5, 6, 9]
assert spec["bonus_logits_indices"] == [3, 4, 7, 8, 10]
assert spec["draft_token_ids"] == [1, 2, 3, 2001, 2002, 4001]  # the last D scheduled tokens of each row

# %% [markdown]
# ### Example A, step 2, read as a draft
#
# docs/semantics.md#two-histories notes that step 2 of example A (`S = [1, 1, 3]`) has two possible histories: request 2
# is
# finishing its prompt (chunked prefill), or it is a decode with 2 drafts. Positions, slots,
# `query_start_loc` and `seq_lens` are the same either way; the sampled logits are not. With token
# ids `10 (r + 1) + p + 1` the inputs are `[14, 23, 36, 37, 38]` and the drafts 37 and 38.

# %%
spec_config = dataclasses.replace(example_a_config(), features=jaxprep.FeatureConfig(num_speculative_tokens=2))
arrays = example_a_step2()
arrays["token_ids"] = (10 * np.arange(1, 4)[:, None] + np.arange(12)[None, :] + 1).astype(np.int32)
arrays["num_draft_tokens"] = np.array([0, 0, 2], np.int32)
record = prepare_record(arrays, spec_config, prompt_lens=[3, 2, 5])
print(format_step(record))
draft_step = jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**arrays), spec_config, check=True)
draft_spec = spec_fields(draft_step)
print(draft_spec)

# %%
# docs/semantics.md#spec-decode, the small example based on the 3-request seed
assert record.matches_reference  # the plain outputs do not change
assert record.unpadded("input_ids").tolist() == [14, 23, 36, 37, 38]
assert record.unpadded("slot_mapping").tolist() == [5, 14, 13, 16, 17]
assert draft_spec["logits_indices"] == [0, 1, 2, 3, 4]
assert draft_spec["cu_num_sampled_tokens"] == [1, 2, 5] and draft_spec["cu_num_draft_tokens"] == [0, 0, 2]
assert draft_spec["bonus_logits_indices"] == [0, 1, 4] and draft_spec["target_logits_indices"] == [2, 3]
assert draft_spec["draft_token_ids"] == [37, 38]

# %% [markdown]
# ### Which samples are thrown away (docs/semantics.md#logits-indices)
#
# Every request gets a logit, even a prefill chunk, but a chunk's sample is discarded:
# `discard_request_mask[r] = computed + scheduled < num_tokens`. In step 1 of example A the mask is
# all False if the prompts are 3, 2 and 5 tokens long, and `[F, F, T]` if request 2's prompt is 8.

# %%
mask_config = dataclasses.replace(example_a_config(), features=jaxprep.FeatureConfig(discard_request_mask=True))
masks = {}
for prompts in ([3, 2, 5], [3, 2, 8]):
    state = jaxprep.BatchState.from_numpy(**example_a_step1(), prefill_len=np.array(prompts, np.int32))
    masks[tuple(prompts)] = np.asarray(jaxprep.prepare_inputs(state, mask_config).discard_request_mask).tolist()
print(masks)
assert masks == {(3, 2, 5): [False, False, False], (3, 2, 8): [False, False, True]}

# %% [markdown]
# ## Several KV-cache groups (docs/semantics.md#kv-groups, #sliding-window)
#
# A hybrid model can keep layers with different cache layouts: each **KV-cache group** has its own
# block table, block size `B_g` and slot mapping. Two details:
#
# - **Kernel block size.** If the attention kernel wants blocks of `b` tokens and the cache manager
#   uses `B` (b divides B), each manager block is split into `k = B / b` kernel blocks:
#   `kernel_bt[r, c*k + j] = BT[r, c] * k + j`. Slots do not change: `blk*B + off ==
#   (blk*k + off//b)*b + off%b`. The example in docs/semantics.md#kv-groups: `B = 32`, `b = 16`, row `[3, 7]` becomes
#   `[6, 7, 14, 15]`, and position 40 has slot `7*32 + 8 = 232` = `14*16 + 8`.
# - **Sliding window.** Blocks wholly outside the window are read as the null block: columns
#   `< max(C - (W - 1), 0) // B` become 0. Slots do not change.
#
# One request decoding its position 40 in a model with two groups: group 0 is the kernel-block
# example, group 1 a sliding-window group (`B = 16`, window 8) holding blocks `[21, 22, 23]`.
# Group 1's values follow from the formulas by hand: slot `23*16 + 40 % 16 = 376`, and its first
# `(40 - 7) // 16 = 2` columns are nulled.

# %%
groups = (jaxprep.KVCacheGroupSpec(block_size=32, kernel_block_size=16),
          jaxprep.KVCacheGroupSpec(block_size=16, sliding_window=8))
kv_config = jaxprep.PrepConfig(max_num_reqs=1, max_model_len=64, max_num_batched_tokens=64, block_size=32,
                               features=jaxprep.FeatureConfig(kv_groups=groups))
table0 = np.zeros((1, kv_config.max_blocks_per_req), np.int32)
table0[0, :2] = [3, 7]
table1 = np.zeros((1, block_table_width(64, 16)), np.int32)
table1[0, :3] = [21, 22, 23]
state = jaxprep.BatchState.from_numpy(token_ids=np.ones((1, 64), np.int32), block_table=table0,
                                      num_computed_tokens=np.array([40], np.int32),
                                      num_scheduled_tokens=np.array([1], np.int32), extra_block_tables=(table1,))
kv_step = jaxprep.prepare_inputs(state, kv_config, check=True)
for g, group in enumerate(kv_step.kv_groups):
    print(f"group {g}: B={group.block_size} kernel b={group.kernel_block_size} "
          f"block_table[0, :4]={np.asarray(group.block_table)[0, :4].tolist()} "
          f"slot_mapping[0]={int(group.slot_mapping[0])}")

# %%
group0, group1 = kv_step.kv_groups
# docs/semantics.md#kv-groups
assert np.asarray(group0.block_table)[0, :4].tolist() == [6, 7, 14, 15]
assert int(group0.slot_mapping[0]) == 232 == 7 * 32 + 8 == 14 * 16 + 8
# The rule in docs/semantics.md#sliding-window on group 1 (window 8, C = 40): columns 0 and 1 are nulled, slot 23 * 16 +
# 8
assert np.asarray(group1.block_table)[0, :3].tolist() == [0, 0, 23]
assert int(group1.slot_mapping[0]) == 376

# %% [markdown]
# The example in docs/semantics.md#sliding-window: window 4, `B = 2`, `C = 9` nulls columns 0..2.

# %%
window_config = jaxprep.PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=8, block_size=2,
                                   features=jaxprep.FeatureConfig(
                                       kv_groups=(jaxprep.KVCacheGroupSpec(2, sliding_window=4),)))
table = np.zeros((1, window_config.max_blocks_per_req), np.int32)
table[0, :6] = [11, 12, 13, 14, 15, 16]
state = jaxprep.BatchState.from_numpy(token_ids=np.ones((1, 16), np.int32), block_table=table,
                                      num_computed_tokens=np.array([9], np.int32),
                                      num_scheduled_tokens=np.array([2], np.int32))
window_group = jaxprep.prepare_inputs(state, window_config, check=True).kv_groups[0]
print(np.asarray(window_group.block_table)[0, :6].tolist(), np.asarray(window_group.slot_mapping)[:2].tolist())
assert np.asarray(window_group.block_table)[0, :6].tolist() == [0, 0, 0, 14, 15, 16]
assert np.asarray(window_group.slot_mapping)[:2].tolist() == [31, 32]  # positions 9 and 10: unchanged slots
