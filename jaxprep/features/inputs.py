"""Host-side checks of the feature inputs of a `BatchState` (called by `jaxprep.validate`).

Each feature that ``config.features`` turns on needs its `BatchState` fields; every field that
is set must have its shape and dtype (checked here). Values are checked against the bounds vLLM
asserts or leaves to its scheduler (docs/semantics.md#invalid-inputs) by each feature's own module: drafts fit the
scheduled
tokens and the token table (`spec_decode`), M-RoPE prompt positions are filled for the tokens read
(`mrope`), last-step rows are in range (`async_tokens`), ...
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep._checks import InvalidBatchError, check_row_bound
from jaxprep.features import (
    async_tokens,
    grammar,
    hybrid,
    kv_groups,
    lora,
    masks,
    mrope,
    prompt_embeds,
    sampling,
    spec_decode,
)
from jaxprep.features.config import MROPE_NUM_DIMS


def required_fields(features) -> dict[str, str]:
    """Field -> the switch that needs it, for every feature that is on."""
    needs = {}
    if features.spec_decode:
        needs["num_draft_tokens"] = f"num_speculative_tokens={features.num_speculative_tokens}"
    for switch in ("discard_request_mask", "mrope", "drafter", "hybrid"):
        if getattr(features, switch):
            needs["prefill_len"] = switch
    if len(features.kv_groups) > 1:
        needs["extra_block_tables"] = f"kv_groups (G={len(features.kv_groups)})"
    if features.mrope:
        needs.update(mrope_positions="mrope", mrope_position_delta="mrope")
    if features.prompt_embeds:
        needs.update(is_token_ids="prompt_embeds", prompt_embeds_start="prompt_embeds")
    if features.async_tokens:
        needs.update(prev_sampled_token_ids="async_tokens", prev_batch_rows="async_tokens")
        if features.spec_decode:
            needs["prev_draft_token_ids"] = "async_tokens with spec decode"
    if features.hybrid is not None:
        needs["mamba_block_table"] = "hybrid"
        if features.spec_decode:
            needs["num_accepted_tokens"] = "hybrid with spec decode"
        if features.hybrid.checkpoints:
            needs["mamba_checkpoint_offsets"] = "hybrid.checkpoints"
    if features.structured_outputs:
        needs["grammar_index"] = "structured_outputs"
    if features.lora is not None:
        needs.update(lora_ids="lora", lora_slots="lora")
    if features.sampling is not None:
        needs.update(dict.fromkeys(sampling.STATE_FIELDS, "sampling"))
    return needs


def check_feature_shapes(host: dict, config) -> None:
    """Every required field is set; every set field has its shape and dtype."""
    features = config.features
    for name, switch in required_fields(features).items():
        if name not in host:
            raise InvalidBatchError(f"BatchState.{name} is missing: FeatureConfig.{switch} needs it")
    rows, width = config.max_num_reqs, config.max_model_len
    per_row = ("num_draft_tokens", "prefill_len", "mrope_position_delta", "prompt_embeds_start",
               "prev_sampled_token_ids", "prev_batch_rows", "num_accepted_tokens", "mamba_checkpoint_offsets",
               "grammar_index")
    expected = dict.fromkeys(per_row, (rows,))
    expected.update(mrope_positions=(rows, MROPE_NUM_DIMS, width), is_token_ids=(rows, width),
                    **lora.expected_shapes(config))
    if "prev_draft_token_ids" in host:
        draft_width = features.num_speculative_tokens if features.spec_decode else host["prev_draft_token_ids"].shape[1]
        expected["prev_draft_token_ids"] = (rows, draft_width)
    for name, shape in expected.items():
        if name in host and host[name].shape != shape:
            raise InvalidBatchError(f"BatchState.{name} has shape {host[name].shape}, config expects {shape}")
        dtype = np.bool_ if name == "is_token_ids" else np.int32
        if name in host and host[name].dtype != dtype:
            raise InvalidBatchError(f"BatchState.{name} has dtype {host[name].dtype}, expected {np.dtype(dtype)}")
    if "extra_block_tables" in host:
        kv_groups.check_extra_table_shapes(host["extra_block_tables"], config)
    if "mamba_block_table" in host:
        hybrid.check_mamba_table_shape(host["mamba_block_table"], config)


CORE_FIELDS = ("token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens")


def check_traced_shapes(state, config) -> None:
    """Trace-time twin of `check_feature_shapes` (free per call): reads only shapes and dtypes, so
    it runs on tracers, and a missing input or a wrong shape raises before anything compiles."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in CORE_FIELDS}
    check_feature_shapes({name: value for name, value in fields.items() if value is not None}, config)
    if config.features.sampling is not None:
        sampling.check_sampling_shapes(fields, config)


def check_group_blocks(host: dict, computed, scheduled, config) -> None:
    """The block checks of `jaxprep.validate` on the tables of KV groups 1..G-1 (`kv_groups`)."""
    kv_groups.check_group_blocks(host, computed, scheduled, config)


def check_feature_values(host: dict, core: dict, config) -> None:
    """Value checks of the features that are on; ``core`` holds the four core tables."""
    features = config.features
    computed = core["num_computed_tokens"].astype(np.int64)
    scheduled = core["num_scheduled_tokens"].astype(np.int64)
    in_batch = scheduled > 0
    if features.spec_decode:
        spec_decode.check_drafts(host["num_draft_tokens"].astype(np.int64), computed, scheduled, config)
    if "prefill_len" in required_fields(features):
        prompt = host["prefill_len"].astype(np.int64)
        check_row_bound((prompt < 0) | (prompt > config.max_model_len), "prefill_len", prompt,
                        f"[0, max_model_len={config.max_model_len}]", relation="is outside")
    if features.mrope:
        mrope.check_prompt_positions(host["mrope_positions"], host["prefill_len"].astype(np.int64), computed,
                                     scheduled, host["mrope_position_delta"].astype(np.int64))
    if features.prompt_embeds:
        prompt_embeds.check_pool_start(host["prompt_embeds_start"].astype(np.int64), in_batch, config.max_model_len)
    if features.async_tokens:
        async_tokens.check_prev_batch_rows(host["prev_batch_rows"].astype(np.int64), in_batch, config.max_num_reqs)
    if features.hybrid is not None:
        hybrid.check_hybrid_values(host, computed, scheduled, config)
    if features.structured_outputs:
        grammar.check_grammar_index(host["grammar_index"].astype(np.int64), scheduled)
    if features.lora is not None:
        lora.check_lora_inputs(host["lora_ids"].astype(np.int64), host["lora_slots"].astype(np.int64), in_batch)
    if features.sampling is not None:
        sampling.check_sampling_inputs(host, config)
    if features.attn_mask in ("rows_bool", "rows_additive"):
        masks.check_row_mask_columns(computed, scheduled, features.mask_columns(config))
