"""A valid state with every feature on, one corruption per kind of bad input, and the checks of the
unchecked path (every output index in range), for tests/features/test_fast_path_feature_errors.py.

Rows of `valid_arrays` (R 5, M 40, B 4, DCP 2: a block-table column holds 8 positions):
  0: a prefill chunk, positions 0..5 of a 10-token prompt, an adapter-free request sampled at last-step row 1
  1: a decode with 2 drafts at positions 12..14, adapter 4, last-step row 0
  2: no work
  3: a chunk 4..7 that ends its 8-token prompt, adapter 4
  4: a decode at position 20, last-step row 2
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxprep import (
    DCPConfig,
    FeatureConfig,
    KVCacheGroupSpec,
    LoRAConfig,
    PrepConfig,
    SamplingConfig,
)
from jaxprep import bounds as core
from jaxprep.features import DrafterConfig, HybridConfig
from jaxprep.features import flags as bits
from jaxprep.features.sampling import empty_sampling_rows
from support.batches import allocate_blocks

NUM_BLOCKS, GROUP_BLOCKS, VOCAB, K = 64, 32, 100, 2
ALL = FeatureConfig(num_speculative_tokens=K, speculative_method="mtp", discard_request_mask=True,
                    kv_groups=(KVCacheGroupSpec(4, kernel_block_size=2), KVCacheGroupSpec(8, num_blocks=GROUP_BLOCKS)),
                    dcp=DCPConfig(2, 1, 2), mrope=True, prompt_embeds=True, async_tokens=True, attn_state=True,
                    attn_mask="rows_bool", request_distribution=True, lora=LoRAConfig(max_loras=3, vocab_size=VOCAB),
                    logits_indirection=True, sampling=SamplingConfig(vocab_size=VOCAB), drafter=DrafterConfig(),
                    hybrid=HybridConfig(num_speculative_blocks=2, chunk_size=4, checkpoints=True),
                    structured_outputs=True, num_ubatches=2)


def config(runner: str) -> PrepConfig:
    return PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4, num_blocks=NUM_BLOCKS,
                      token_buckets=(8, 16, 32), features=dataclasses.replace(ALL, runner=runner))


def valid_arrays() -> dict:
    rows, m = 5, 40
    computed = np.array([0, 12, 0, 4, 20], np.int32)
    scheduled = np.array([6, 3, 0, 4, 1], np.int32)
    prefill = np.array([10, 5, 0, 8, 20], np.int32)
    needed_core = [-(-int(n) // 8) for n in computed + scheduled]  # DCP 2: 8 positions a column
    needed_group = [-(-int(n) // 16) for n in computed + scheduled]
    mrope = np.full((rows, 3, m), -1, np.int32)
    for row, length in enumerate(prefill):
        mrope[row, :, :length] = np.arange(length)
    is_token_ids = np.ones((rows, m), bool)
    is_token_ids[0, 2:5] = False
    sampling = empty_sampling_rows(rows, ALL.sampling)
    sampling.update(temperature=np.array([0, 0.5, 1, 0.7, 2], np.float32), top_k=np.array([100, 3, 100, 7, 100],
                                                                                             np.int32))
    return dict(
        token_ids=np.arange(rows * m, dtype=np.int32).reshape(rows, m) % 90 + 1,
        block_table=allocate_blocks(rows, 10, needed_core, NUM_BLOCKS - 1, 3),
        num_computed_tokens=computed, num_scheduled_tokens=scheduled, prefill_len=prefill,
        num_draft_tokens=np.array([0, 2, 0, 0, 0], np.int32),
        extra_block_tables=[allocate_blocks(rows, 5, needed_group, GROUP_BLOCKS - 1, 4)],
        mrope_positions=mrope, mrope_position_delta=np.zeros(rows, np.int32),
        is_token_ids=is_token_ids, prompt_embeds_start=np.array([100, 0, 0, 0, 0], np.int32),
        prev_sampled_token_ids=np.array([11, 12, 13, 0, 0], np.int32), prev_batch_rows=np.array([1, 0, -1, -1, 2],
                                                                                                  np.int32),
        prev_draft_token_ids=np.array([[21, 22], [23, 24], [25, 26], [0, 0], [0, 0]], np.int32),
        mamba_block_table=np.arange(1, 16, dtype=np.int32).reshape(rows, 3),
        num_accepted_tokens=np.ones(rows, np.int32),
        mamba_checkpoint_offsets=np.array([3, 0, 0, 2, 0], np.int32),
        grammar_index=np.array([0, 2, -1, 1, -1], np.int32),
        lora_ids=np.array([0, 4, 9, 4, 0], np.int32), lora_slots=np.array([9, -1, 4], np.int32),
        **sampling)


def _set(name, index, value):
    def change(arrays):
        if name == "extra_block_tables":
            arrays[name][0][index] = value
        else:
            arrays[name][index] = value
    return change


def _many(*changes):
    def change(arrays):
        for c in changes:
            c(arrays)
    return change


@dataclasses.dataclass(frozen=True)
class BadKind:
    change: object  # arrays -> None, in place
    bit: int  # the error-word bit the unchecked path sets
    named: str  # regex of the field and bound the checked path names


BAD_KINDS = {
    # the core tables
    "negative scheduled": BadKind(_set("num_scheduled_tokens", 1, -3), core.NEGATIVE_COUNT, r"num_scheduled_tokens.*0"),
    "negative computed": BadKind(_set("num_computed_tokens", 3, -6), core.NEGATIVE_COUNT, r"num_computed_tokens.*0"),
    "past max_model_len": BadKind(_many(_set("num_computed_tokens", 4, 39), _set("num_scheduled_tokens", 4, 2)),
                                  core.PAST_MAX_MODEL_LEN, r"(max_model_len|mask_kv_len)=40"),
    "int32 wrap": BadKind(_set("num_computed_tokens", 4, 2**31 - 2), core.PAST_MAX_MODEL_LEN,
                          r"is 2147483647, which exceeds .*(max_model_len|mask_kv_len)=40"),
    "block id too large": BadKind(_set("block_table", (0, 0), NUM_BLOCKS), core.BLOCK_ID_OUT_OF_RANGE,
                                  r"block_table\[0, 0\].*max_block_id=63"),
    "negative block id": BadKind(_set("block_table", (3, 0), -4), core.BLOCK_ID_OUT_OF_RANGE,
                                 r"block_table\[3, 0\].*max_block_id"),
    "null block": BadKind(_set("block_table", (4, 2), 0), core.NULL_BLOCK, r"block_table\[4, 2\] is the null block"),
    "over the bucket": BadKind(_set("num_scheduled_tokens", 0, 12), core.OVER_BUCKET,
                               r"sum\(num_scheduled_tokens\)=20 exceeds num_tokens_padded=16"),
    # KV-cache groups
    "group block id too large": BadKind(_set("extra_block_tables", (0, 0), GROUP_BLOCKS),
                                        bits.KV_GROUP_BLOCK_OUT_OF_RANGE, r"extra_block_tables\[0\]\[0, 0\].*31"),
    "group null block": BadKind(_set("extra_block_tables", (4, 1), 0), bits.KV_GROUP_NULL_BLOCK,
                                r"extra_block_tables\[0\]\[4, 1\] is the null block"),
    # async tokens
    "prev_batch_rows past max_num_reqs": BadKind(_set("prev_batch_rows", 0, 7), bits.PREV_BATCH_ROW_OUT_OF_RANGE,
                                                 r"prev_batch_rows.*\[-1, max_num_reqs=5\)"),
    "prev_batch_rows below -1": BadKind(_set("prev_batch_rows", 2, -3), bits.PREV_BATCH_ROW_OUT_OF_RANGE,
                                        r"prev_batch_rows.*\[-1, max_num_reqs=5\)"),
    "prev_batch_rows claimed twice": BadKind(_set("prev_batch_rows", 4, 1), bits.PREV_BATCH_ROW_OUT_OF_RANGE,
                                             r"prev_batch_rows maps two scheduled rows"),
    # spec decode
    "drafts above K": BadKind(_many(_set("num_draft_tokens", 1, 3), _set("num_scheduled_tokens", 1, 4)),
                              bits.DRAFTS_OUT_OF_RANGE, r"num_draft_tokens.*num_speculative_tokens=2"),
    "negative drafts": BadKind(_set("num_draft_tokens", 2, -1), bits.DRAFTS_OUT_OF_RANGE, r"num_draft_tokens.*0"),
    "drafts near 2**31": BadKind(_set("num_draft_tokens", 1, 2**31 - 1), bits.DRAFTS_OUT_OF_RANGE,
                                 r"num_draft_tokens.*num_speculative_tokens=2"),
    "S below D + 1": BadKind(_set("num_draft_tokens", 4, 1), bits.DRAFTS_PAST_SCHEDULED,
                             r"num_scheduled_tokens at row 4 is 1, below num_draft_tokens \+ 1"),
    # LoRA
    "adapter not loaded": BadKind(_set("lora_ids", 0, 5), bits.LORA_ID_NOT_LOADED, r"lora_ids at row 0 is 5.*no slot"),
    "negative adapter id": BadKind(_set("lora_ids", 3, -2), bits.LORA_ID_NOT_LOADED,
                                   r"lora_ids at row 3 is -2.*below 0"),
    "one adapter in two slots": BadKind(_set("lora_slots", 1, 4), bits.LORA_SLOTS_INVALID,
                                        r"lora_slots holds adapter 4 in two slots"),
    "slot holds id 0": BadKind(_set("lora_slots", 1, 0), bits.LORA_SLOTS_INVALID, r"lora_slots\[1\] is 0"),
    # M-RoPE and the prefill length
    "M-RoPE -1 at a scheduled token": BadKind(_set("mrope_positions", (0, 1, 2), -1), bits.MROPE_POSITION_MISSING,
                                              r"mrope_positions\[0, :, 2\] is missing"),
    "M-RoPE past the limit": BadKind(_set("mrope_positions", (0, 2, 1), 2**31 - 1), bits.MROPE_POSITION_MISSING,
                                     r"mrope_positions\[0, :, 1\] is 2147483647, at or past MROPE_POSITION_LIMIT"),
    "M-RoPE negative completion": BadKind(_set("mrope_position_delta", 4, -30), bits.MROPE_POSITION_MISSING,
                                          r"mrope_position_delta at row 4 is -30"),
    "prefill_len 99": BadKind(_set("prefill_len", 2, 99), bits.PREFILL_LEN_OUT_OF_RANGE,
                              r"prefill_len at row 2 is 99.*\[0, max_model_len=40\]"),
    "prefill_len -4": BadKind(_set("prefill_len", 0, -4), bits.PREFILL_LEN_OUT_OF_RANGE,
                              r"prefill_len at row 0 is -4.*\[0, max_model_len=40\]"),
    # prompt embeddings
    "negative embeds start": BadKind(_set("prompt_embeds_start", 0, -5), bits.PROMPT_EMBEDS_START_OUT_OF_RANGE,
                                     r"prompt_embeds_start at row 0 is -5"),
    "embeds start past the pool bound": BadKind(_set("prompt_embeds_start", 0, 2**31 - 10),
                                                bits.PROMPT_EMBEDS_START_OUT_OF_RANGE, r"prompt_embeds_start at row 0"),
    # sampling rows
    "NaN temperature": BadKind(_set("temperature", 1, np.nan), bits.TEMPERATURE_OUT_OF_RANGE,
                               r"temperature at row 1 is nan.*finite and >= 0"),
    "inf temperature": BadKind(_set("temperature", 2, np.inf), bits.TEMPERATURE_OUT_OF_RANGE, r"temperature at row 2"),
    "top_k 0": BadKind(_set("top_k", 0, 0), bits.TOP_K_OUT_OF_RANGE, r"top_k at row 0 is 0.*\[1, vocab_size=100\]"),
    "top_k above vocab": BadKind(_set("top_k", 3, 101), bits.TOP_K_OUT_OF_RANGE, r"top_k at row 3 is 101"),
    "negative top_k": BadKind(_set("top_k", 4, -1), bits.TOP_K_OUT_OF_RANGE, r"top_k at row 4 is -1"),
    "top_p inf": BadKind(_set("top_p", 1, np.inf), bits.TOP_P_OUT_OF_RANGE, r"top_p at row 1 is inf.*\(0, 1\]"),
    "top_p 0": BadKind(_set("top_p", 1, 0.0), bits.TOP_P_OUT_OF_RANGE, r"top_p at row 1 is 0.0"),
    "min_p 2": BadKind(_set("min_p", 0, 2.0), bits.MIN_P_OUT_OF_RANGE, r"min_p at row 0 is 2.0.*\[0, 1\]"),
    "min_p a negative subnormal": BadKind(_set("min_p", 0, -1e-45), bits.MIN_P_OUT_OF_RANGE,
                                         r"min_p at row 0 is -1\.4\d*e-45"),
    "repetition_penalty 0": BadKind(_set("repetition_penalty", 3, 0.0), bits.REPETITION_PENALTY_OUT_OF_RANGE,
                                    r"repetition_penalty at row 3"),
    "NaN frequency_penalty": BadKind(_set("frequency_penalty", 0, np.nan), bits.FREQUENCY_PENALTY_NOT_FINITE,
                                     r"frequency_penalty at row 0 is nan"),
    "inf presence_penalty": BadKind(_set("presence_penalty", 4, -np.inf), bits.PRESENCE_PENALTY_NOT_FINITE,
                                    r"presence_penalty at row 4 is -inf"),
    # hybrid models and structured outputs
    "negative state block": BadKind(_set("mamba_block_table", (1, 2), -7), bits.MAMBA_STATE_BLOCK_INVALID,
                                    r"mamba_block_table.*row 1"),
    "state block past max_block_id": BadKind(_set("mamba_block_table", (1, 0), NUM_BLOCKS),
                                             bits.MAMBA_STATE_BLOCK_INVALID, r"mamba_block_table.*max_block_id=63"),
    "null state block": BadKind(_set("mamba_block_table", (3, 0), 0), bits.MAMBA_STATE_BLOCK_INVALID,
                                r"mamba_block_table.*row 3.*null block"),
    "accepted tokens 0": BadKind(_set("num_accepted_tokens", 0, 0), bits.NUM_ACCEPTED_TOKENS_OUT_OF_RANGE,
                                 r"num_accepted_tokens at row 0 is 0"),
    "checkpoint past the query": BadKind(_set("mamba_checkpoint_offsets", 3, 4), bits.MAMBA_CHECKPOINT_OUT_OF_RANGE,
                                         r"mamba_checkpoint_offsets at row 3 is 4"),
    "grammar index past max_num_reqs": BadKind(_set("grammar_index", 2, 9), bits.GRAMMAR_INDEX_INVALID,
                                               r"grammar_index at row 2 is 9"),
    "grammar block twice": BadKind(_set("grammar_index", 3, 0), bits.GRAMMAR_INDEX_INVALID,
                                   r"grammar_index of the scheduled rows"),
}


def corrupt(kind: str) -> dict:
    arrays = valid_arrays()
    BAD_KINDS[kind].change(arrays)
    return arrays


NOT_INDICES = ("seeds", ".errors")  # random int32 words and the error word: any value is in range


def assert_outputs_in_range(step, config: PrepConfig) -> None:
    """Every index the step hands out lies inside what it indexes (or is its pad value)."""
    t_pad, m, rows = step.num_tokens_padded, config.max_model_len, config.max_num_reqs
    meta = step.attn_metadata

    def within(name, values, low, high):
        values = np.asarray(values)
        assert ((values >= low) & (values < high)).all(), (name, values)

    within("positions", step.positions, 0, m)
    within("logits_indices", step.logits_indices, 0, t_pad)
    within("idx_mapping", step.idx_mapping, -1, rows)
    within("query_start_loc", meta.query_start_loc, 0, t_pad + 1)
    within("seq_lens", meta.seq_lens, 0, m + 1)
    within("slot_mapping", meta.slot_mapping, -1, NUM_BLOCKS * 4)
    within("block_table", meta.block_table, 0, NUM_BLOCKS)
    within("input_ids", step.input_ids, 0, 2**24)
    features = config.features
    if features.kv_groups:
        group_blocks = (NUM_BLOCKS * 2, GROUP_BLOCKS)  # group 0's kernel blocks are half its manager blocks
        for g, group in enumerate(step.kv_groups):
            within(f"kv_groups[{g}].block_table", group.block_table, 0, group_blocks[g])
            within(f"kv_groups[{g}].slot_mapping", group.slot_mapping, -1, (NUM_BLOCKS * 4, GROUP_BLOCKS * 8)[g])
    if features.mrope:
        within("mrope_positions", step.mrope_positions, 0, 2**24)
    if features.spec_decode:
        spec = step.spec_decode
        num_logits = spec.logits_indices.shape[0]
        within("spec_decode.logits_indices", spec.logits_indices, 0, t_pad)
        within("spec_decode.target_logits_indices", spec.target_logits_indices, 0, num_logits)
        within("spec_decode.bonus_logits_indices", spec.bonus_logits_indices, 0, num_logits)
        within("spec_decode.num_draft_tokens", spec.num_draft_tokens, 0, features.num_speculative_tokens + 1)
    if features.lora is not None:
        within("lora.token_lora_indices", step.lora.token_lora_indices, -1, features.lora.max_loras)
        within("lora.sampler_indices", step.lora.sampler_indices, -1, features.lora.max_loras)
    if features.sampling is not None:
        sampling = step.sampling
        within("sampling.idx_mapping", sampling.idx_mapping, -1, rows)
        within("sampling.top_k", sampling.top_k, 1, features.sampling.vocab_size + 1)
        assert np.isfinite(np.asarray(sampling.temperature)).all() and (np.asarray(sampling.temperature) >= 0).all()
        top_p = np.asarray(sampling.top_p)
        assert ((top_p > 0) & (top_p <= 1)).all(), top_p
    for path, leaf in jax.tree_util.tree_leaves_with_path(step):
        name = jax.tree_util.keystr(path)
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.integer) and not any(s in name for s in NOT_INDICES):
            within(name, array, -1, 2**24)  # nothing near +-2**31
