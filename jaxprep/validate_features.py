"""Host-side checks of the feature inputs of a `BatchState` (called by `jaxprep.validate`).

Each feature that ``config.features`` turns on needs its `BatchState` fields; every field that
is set must have its shape and dtype. Values are checked against the bounds vLLM asserts or
leaves to its scheduler (SPEC §6): drafts fit the scheduled tokens and the token table, M-RoPE
prompt positions are filled for the tokens read, last-step rows are in range, ...
"""

from __future__ import annotations

import numpy as np

from jaxprep._constants import MROPE_MISSING_POSITION, NO_PREV_ROW
from jaxprep.config import cdiv
from jaxprep.features import MROPE_NUM_DIMS
from jaxprep.state import OPTIONAL_FIELDS
from jaxprep.validate import InvalidBatchError as _error
from jaxprep.validate import _check_blocks
from jaxprep.validate import _check_row_bound as _first_bad


def feature_fields(state) -> dict:
    """Host copies of the optional fields that are set (a tuple field gives a tuple of arrays)."""
    host = {}
    for name in OPTIONAL_FIELDS:
        value = getattr(state, name)
        if isinstance(value, tuple):
            host[name] = tuple(np.asarray(v) for v in value)
        elif value is not None:
            host[name] = np.asarray(value)
    return host


def required_fields(features) -> dict[str, str]:
    """Field -> the switch that needs it, for every feature that is on."""
    needs = {}
    if features.spec_decode:
        needs["num_draft_tokens"] = f"num_speculative_tokens={features.num_speculative_tokens}"
    for switch in ("discard_request_mask", "mrope"):
        if getattr(features, switch):
            needs["num_prompt_tokens"] = switch
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
    return needs


def check_feature_shapes(host: dict, config) -> None:
    """Every required field is set; every set field has its shape and dtype."""
    features = config.features
    for name, switch in required_fields(features).items():
        if name not in host:
            raise _error(f"BatchState.{name} is missing: FeatureConfig.{switch} needs it")
    rows, width = config.max_num_reqs, config.max_model_len
    expected = {name: (rows,) for name in ("num_draft_tokens", "num_prompt_tokens", "mrope_position_delta",
                                           "prompt_embeds_start", "prev_sampled_token_ids", "prev_batch_rows")}
    expected.update(mrope_positions=(rows, MROPE_NUM_DIMS, width), is_token_ids=(rows, width))
    if "prev_draft_token_ids" in host:
        draft_width = features.num_speculative_tokens if features.spec_decode else host["prev_draft_token_ids"].shape[1]
        expected["prev_draft_token_ids"] = (rows, draft_width)
    for name, shape in expected.items():
        if name in host and host[name].shape != shape:
            raise _error(f"BatchState.{name} has shape {host[name].shape}, config expects {shape}")
        dtype = np.bool_ if name == "is_token_ids" else np.int32
        if name in host and host[name].dtype != dtype:
            raise _error(f"BatchState.{name} has dtype {host[name].dtype}, expected {np.dtype(dtype)}")
    if "extra_block_tables" in host:
        _check_extra_table_shapes(host["extra_block_tables"], config)


def _check_extra_table_shapes(tables: tuple, config) -> None:
    groups = config.features.kv_groups
    if groups and len(tables) != len(groups) - 1:
        raise _error(f"BatchState.extra_block_tables has {len(tables)} tables, FeatureConfig.kv_groups "
                     f"needs {len(groups) - 1} (groups 1..{len(groups) - 1})")
    for g, table in enumerate(tables, start=1):
        min_width = cdiv(config.max_model_len, groups[g].block_size) if groups else 1
        if table.ndim != 2 or table.shape[0] != config.max_num_reqs or table.shape[1] < min_width:
            raise _error(f"BatchState.extra_block_tables[{g - 1}] (group {g}) has shape {table.shape}, config "
                         f"expects ({config.max_num_reqs}, W) with W >= {min_width}")
        if table.dtype != np.int32:
            raise _error(f"BatchState.extra_block_tables[{g - 1}] has dtype {table.dtype}, expected int32")


def check_group_blocks(host: dict, computed, scheduled, config) -> None:
    """The block checks of `jaxprep.validate` on the tables of KV groups 1..G-1, with their block sizes."""
    groups = config.features.kv_groups
    for g, table in enumerate(host.get("extra_block_tables", ()) if groups else (), start=1):
        spec = groups[g]
        _check_blocks(table, computed, scheduled, spec.block_size, spec.max_block_id,
                      dcp_world=config.features.dcp_world_size, name=f"extra_block_tables[{g - 1}]")


def check_feature_values(host: dict, core: dict, config) -> None:
    """Value checks of the features that are on; ``core`` holds the four core tables."""
    features = config.features
    computed = core["num_computed_tokens"].astype(np.int64)
    scheduled = core["num_scheduled_tokens"].astype(np.int64)
    in_batch = scheduled > 0
    if features.spec_decode:
        _check_drafts(host["num_draft_tokens"].astype(np.int64), computed, scheduled, config)
    if "num_prompt_tokens" in required_fields(features):
        prompt = host["num_prompt_tokens"].astype(np.int64)
        _first_bad((prompt < 0) | (prompt > config.max_model_len), "num_prompt_tokens", prompt,
                   f"[0, max_model_len={config.max_model_len}]", relation="is outside")
    if features.mrope:
        _check_mrope(host["mrope_positions"], host["num_prompt_tokens"].astype(np.int64), computed, scheduled)
    if features.prompt_embeds:
        start = host["prompt_embeds_start"].astype(np.int64)
        _first_bad(in_batch & ((start < 0) | (start + config.max_model_len > 2**31 - 1)), "prompt_embeds_start",
                   start, "[0, 2**31 - 1 - max_model_len] (int32 pool rows)", relation="is outside")
    if features.async_tokens:
        _check_prev_rows(host["prev_batch_rows"].astype(np.int64), in_batch, config.max_num_reqs)
    if features.attn_mask in ("rows_bool", "rows_additive"):
        columns = features.mask_columns(config)
        seq_lens = np.where(in_batch, computed + scheduled, 0)
        _first_bad(seq_lens > columns, "num_computed_tokens + num_scheduled_tokens", seq_lens,
                   f"the row mask's FeatureConfig.mask_kv_len={columns} columns")


def _check_drafts(drafts, computed, scheduled, config) -> None:
    k = config.features.num_speculative_tokens
    in_batch = scheduled > 0
    _first_bad(drafts < 0, "num_draft_tokens", drafts, "0 (counts are non-negative)", relation="is below")
    _first_bad(in_batch & (drafts > k), "num_draft_tokens", drafts, f"num_speculative_tokens={k}")
    short = in_batch & (scheduled < drafts + 1)
    if short.any():
        row = int(np.flatnonzero(short)[0])
        raise _error(f"num_scheduled_tokens at row {row} is {int(scheduled[row])}, below num_draft_tokens + 1 = "
                     f"{int(drafts[row]) + 1}: a row schedules its drafts and at least one token before them")
    past = in_batch & (drafts > 0) & (computed + scheduled > config.max_model_len)
    if past.any():
        row = int(np.flatnonzero(past)[0])
        raise _error(f"the drafts of row {row} reach position {int(computed[row] + scheduled[row]) - 1}, past the "
                     f"token table (max_model_len={config.max_model_len})")


def _check_mrope(table: np.ndarray, prompt, computed, scheduled) -> None:
    """The prompt columns a step reads (``[C, min(C + S, P))``) must be filled on every row."""
    columns = np.arange(table.shape[2])
    read = ((scheduled > 0)[:, None] & (columns[None, :] >= computed[:, None])
            & (columns[None, :] < np.minimum(computed + scheduled, prompt)[:, None]))
    missing = read & (table == MROPE_MISSING_POSITION).any(axis=1)
    if missing.any():
        row, column = (int(i[0]) for i in np.nonzero(missing))
        raise _error(f"mrope_positions[{row}, :, {column}] is missing ({MROPE_MISSING_POSITION}), but row {row} "
                     f"schedules prompt position {column}: fill its prompt positions (text-only: arange)")


def _check_prev_rows(prev, in_batch, max_num_reqs: int) -> None:
    _first_bad((prev < NO_PREV_ROW) | (prev >= max_num_reqs), "prev_batch_rows", prev,
               f"[{NO_PREV_ROW}, max_num_reqs={max_num_reqs})", relation="is outside")
    used = prev[in_batch & (prev >= 0)]
    if len(np.unique(used)) != len(used):
        raise _error(f"prev_batch_rows maps two scheduled rows to one last-step batch row: {used.tolist()}")

