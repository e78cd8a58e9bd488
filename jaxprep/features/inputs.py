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

from jaxprep.bounds import InvalidBatchError
from jaxprep.features import (
    hybrid,
    kv_groups,
    lora,
    registry,
    sampling,
)
from jaxprep.features.config import MROPE_NUM_DIMS
from jaxprep.features.registry import required_fields


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
    """Value checks of the features that are on (each record's host check, `registry.check_values`);
    ``core`` holds the four core tables."""
    registry.check_values(host, core, config)
