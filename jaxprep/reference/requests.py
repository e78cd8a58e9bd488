"""NumPy reference of the per-request features, for reading (docs/semantics.md#logits-indices,
docs/semantics.md#features, docs/semantics.md#request-distribution, docs/semantics.md#ascend-state).

Written the way vLLM writes them (``np.repeat``, loops over requests), independently of the jitted
code, on unpadded host arrays in batch order; the oracle of the feature tests.
"""

from __future__ import annotations

import numpy as np

from jaxprep.features import AttnState
from jaxprep.reference.core import prepare_reference


def batched_arange(counts) -> np.ndarray:
    """One ``arange(c)`` per count, concatenated.

    ```
    # counts [3, 0, 2] -> [0, 1, 2, 0, 1]
    ```
    """
    return np.concatenate([np.arange(int(c)) for c in counts] + [np.zeros(0, np.int64)]).astype(np.int64)


def batch_order_reference(num_scheduled, num_draft, mode: str | None, num_speculative_tokens: int = 0,
                          runner: str = "v1") -> np.ndarray:
    """State rows of the batch in order: row order, decode-first, or vLLM V2's sort key (ties: row
    order, or descending slot, V2's arrival order, under ``runner="v2"``)."""
    rows = [int(r) for r in np.flatnonzero(np.asarray(num_scheduled) > 0)]
    if runner == "v2":
        rows.reverse()
    scheduled = {r: int(num_scheduled[r]) for r in rows}
    drafts = {r: int(num_draft[r]) for r in rows}
    if mode == "decode_first":
        rows.sort(key=lambda r: scheduled[r] != 1 + drafts[r])
    elif mode == "v2":
        decode_query_len = 1 + num_speculative_tokens
        rows.sort(key=lambda r: (drafts[r] == 0, scheduled[r] != decode_query_len, scheduled[r]))
    return np.array(rows, np.int64)


def prepare_reference_ordered(token_ids, block_table, num_computed_tokens, num_scheduled_tokens, block_size,
                              idx_mapping) -> dict:
    """`prepare_reference` with the batch in the order ``idx_mapping`` (state rows) instead of row order."""
    order = np.asarray(idx_mapping, np.int64)
    ref = prepare_reference(np.asarray(token_ids)[order], np.asarray(block_table)[order],
                            np.asarray(num_computed_tokens)[order], np.asarray(num_scheduled_tokens)[order],
                            block_size)
    ref["idx_mapping"] = order
    return ref


def request_distribution_reference(num_scheduled, num_draft) -> np.ndarray:
    """``[d, d, n]``: ``d`` leading decodes (``S == 1 + D``) of the batch, ``n`` requests."""
    decode_end = 0
    for s, d in zip(num_scheduled, num_draft):
        if s != 1 + d:
            break
        decode_end += 1
    return np.array([decode_end, decode_end, len(num_scheduled)], np.int64)


def spec_decode_reference(num_scheduled, num_draft, input_ids) -> dict:
    """vLLM V1 ``_calc_spec_decode_metadata`` over the batch rows (docs/semantics.md#spec-decode)."""
    num_scheduled = np.asarray(num_scheduled, np.int64)
    num_draft = np.asarray(num_draft, np.int64)
    cu_num_tokens = np.cumsum(num_scheduled)
    num_sampled = num_draft + 1
    cu_num_sampled = np.cumsum(num_sampled)
    logits_indices = np.repeat(cu_num_tokens - num_sampled, num_sampled) + batched_arange(num_sampled)
    target = np.repeat(cu_num_sampled - num_sampled, num_draft) + batched_arange(num_draft)
    return {
        "num_draft_tokens": num_draft,
        "cu_num_draft_tokens": np.cumsum(num_draft),
        "cu_num_sampled_tokens": cu_num_sampled,
        "logits_indices": logits_indices,
        "target_logits_indices": target,
        "bonus_logits_indices": cu_num_sampled - 1,
        "draft_token_ids": np.asarray(input_ids)[logits_indices][target + 1],
        "max_spec_len": int(num_draft.max()) if len(num_draft) else 0,
    }


def discard_request_mask_reference(num_computed, num_scheduled, prefill_len) -> np.ndarray:
    """docs/semantics.md#logits-indices: a request still inside its prompt after this step discards its sampled
    token."""
    return np.array([c + s < p for c, s, p in zip(num_computed, num_scheduled, prefill_len)], bool)


def async_input_ids_reference(input_ids, num_scheduled, num_draft, prev_positions, prev_sampled,
                              prev_drafts=None, clamp: bool = True) -> np.ndarray:
    """vLLM V1 ``_prepare_input_ids`` (docs/semantics.md#async-scheduling), one request at a time, then
    (``clamp``) the clamp of ``_preprocess``; ``clamp=False`` gives the ids ``_calc_spec_decode_metadata``
    reads.

    ``prev_positions[r]``: last step's batch row of batch row r's request, or -1.
    """
    ids = np.array(input_ids, np.int64)
    cu_num_tokens = np.cumsum(num_scheduled)
    for r, prev in enumerate(prev_positions):
        if prev < 0:
            continue
        flat = int(cu_num_tokens[r]) - 1
        drafts = int(num_draft[r])
        ids[flat - drafts] = prev_sampled[prev]
        for i in range(drafts):
            ids[flat - drafts + 1 + i] = prev_drafts[prev][i]
    return np.maximum(ids, 0) if clamp else ids


def attn_state_reference(num_computed, num_scheduled, num_draft, *, spec_decode: bool, method: str | None,
                         enable_chunked_prefill: bool) -> AttnState:
    """vllm-ascend ``_build_attn_state`` plus its non-MTP override, as the attention backend sees it."""
    if all(c == 0 for c in num_computed):
        state = AttnState.PrefillNoCache
    elif all(s == 1 for s in num_scheduled):
        state = AttnState.SpecDecoding if method == "mtp" else AttnState.DecodeOnly
    elif all(s - d == 1 for s, d in zip(num_scheduled, num_draft)):
        state = AttnState.SpecDecoding if spec_decode else AttnState.ChunkedPrefill
    elif enable_chunked_prefill:
        state = AttnState.ChunkedPrefill
    else:
        state = AttnState.PrefillCacheHit
    if state == AttnState.SpecDecoding and method != "mtp":
        state = AttnState.ChunkedPrefill
    return state
