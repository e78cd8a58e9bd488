"""Batch order (docs/semantics.md#batch-order): decodes first, and tpu-inference's ``request_distribution``
(docs/semantics.md#request-distribution).

Without a batch order (`FeatureConfig.batch_order`: ``reorder``, or "v2" under ``runner="v2"``) the
batch is the rows with work in state-row order (vLLM V1 with FlashAttention). With it, the batch
rows are sorted on the device; ``StepInputs.idx_mapping`` still maps every batch row back to its
state row, so a sampler writes results back through it.

- ``"decode_first"`` (tpu-inference ``_reorder_batch``): decodes, then everything else; a decode
  is a row whose scheduled tokens are its last sampled token and its drafts (``S == 1 + D``).
- ``"v2"`` (vLLM V2 ``sort_batch_req_ids``): sorted by ``(not has_drafts, S != 1 + K, S)``.

Both are stable: ties keep state-row order. V2 itself breaks ties by scheduler order (arrival
order); with ``FeatureConfig(runner="v2")`` state rows are V2's slots, which V2 hands out from the
top (`vllm/v1/worker/gpu/states.py`: the first request gets slot ``max_num_reqs - 1``), so ties
then go by descending state row, arrival order for requests admitted one after another.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxprep._typing import Array, Bool, Int32
from jaxprep.features.config import FeatureConfig
from jaxprep.features.record import Feature

_NOT_IN_BATCH = 3
"""Primary sort key of rows without work: after every real request."""


def reordered_rows(state, num_reqs_padded: int, features: FeatureConfig) -> Int32[Array, " num_reqs_padded"]:
    """State row of each batch row in the ``features.batch_order`` order; padding rows get ``max_num_reqs``.

    ```
    # S [3, 1, 0, 2, 1], decode_first -> [1, 4, 0, 3, 5]
    # S [3, 2, 5] (docs/semantics.md#example-a-step-1), v2 -> [1, 0, 2]
    # S [2, 2] at slots [4, 5], K 1, runner v2 -> ties by descending slot: [5, 4]
    ```
    """
    scheduled = state.num_scheduled_tokens
    drafts = state.num_draft_tokens if features.spec_decode else jnp.zeros_like(scheduled)
    has_work = scheduled > 0
    if features.batch_order == "decode_first":
        primary = jnp.where(scheduled == 1 + drafts, 0, 1)
        keys = (jnp.where(has_work, primary, _NOT_IN_BATCH),)
    else:
        decode_query_len = 1 + features.num_speculative_tokens
        primary = jnp.where(drafts > 0, 0, 1)
        keys = (scheduled, (scheduled != decode_query_len).astype(jnp.int32),
                jnp.where(has_work, primary, _NOT_IN_BATCH))
        if features.runner == "v2":  # least significant key: descending slot
            keys = (-jnp.arange(scheduled.shape[0], dtype=jnp.int32), *keys)
    order = jnp.lexsort(keys)[:num_reqs_padded].astype(jnp.int32)  # lexsort: last key is primary
    sentinel = scheduled.shape[0]
    return jnp.where(has_work[order], order, sentinel)


def request_distribution(scheduled: Int32[Array, " num_reqs_padded"], drafts: Int32[Array, " num_reqs_padded"],
                         is_real_req: Bool[Array, " num_reqs_padded"]) -> Int32[Array, " 3"]:
    """``[decode_end, prefill_end, mixed_end]``: batch rows ``[0, d)`` are decodes, ``[d, n)`` the rest.

    Like tpu-inference, the prefill-only range is empty (``prefill_end == decode_end``); ``d``
    counts the leading decodes, so it is the number of decodes once they are ordered first.

    ```
    # S [1, 1, 5, 1, pad], D 0 -> decode rows [T, T, F, T, F] -> leading 2 -> [2, 2, 4]
    ```
    """
    is_decode = is_real_req & (scheduled == 1 + drafts)
    decode_end = jnp.sum(jnp.cumprod(is_decode.astype(jnp.int32)), dtype=jnp.int32)
    num_reqs = jnp.sum(is_real_req, dtype=jnp.int32)
    return jnp.stack([decode_end, decode_end, num_reqs])


def _metadata(build) -> None:
    """``request_distribution`` when asked for (the batch order itself is the layout's)."""
    if build.config.features.request_distribution:
        layout = build.layout
        build.outputs["request_distribution"] = request_distribution(layout.scheduled, build.drafts,
                                                                     layout.is_real_req)


FEATURE = Feature(name="reorder", metadata=_metadata,
                  is_on=lambda features: features.batch_order is not None or features.request_distribution)
"""This feature's record (`jaxprep.features.registry`): no input of its own and no check; `_metadata` adds
its outputs to the step."""
