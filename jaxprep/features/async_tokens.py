"""Async scheduling (docs/semantics.md#async-scheduling): last step's sampled tokens go into ``input_ids`` on the
device.

Under async scheduling the host has not seen last step's sampled token ids when it schedules the
next step, so its token table holds a placeholder (-1) where each one belongs. The sampled ids
(a device array, one per last-step batch row) are scattered into ``input_ids`` here, with no
host round trip; so are last step's draft tokens when spec decode is on.

For a request sampled last step at batch row ``prev`` and now at batch row ``b`` with ``D`` drafts:
``input_ids[qsl[b+1] - 1 - D] = prev_sampled_token_ids[prev]`` and the ``D`` tokens after it are
``prev_draft_token_ids[prev, :D]``. Placeholders left anywhere else (`PLACEHOLDER_TOKEN_ID`) are
clamped to 0 in the step's ``input_ids`` (`clamp_placeholders`), but the spec-decode drafts are
read before that clamp, as vLLM V1 reads them: a draft no step wrote stays -1 and is never
accepted. vLLM's chain: the async scheduler schedules ``[-1] * K`` as every request's drafts
(`vllm/v1/core/sched/async_scheduler.py::AsyncScheduler._update_after_schedule`),
`vllm/v1/worker/gpu_input_batch.py::InputBatch.update_req_spec_token_ids` writes them into the
token table, `vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._prepare_input_ids` overwrites
only the drafts of requests sampled last step, ``_calc_spec_decode_metadata`` gathers
``draft_token_ids`` from ``input_ids``, and only then ``_preprocess`` clamps ``input_ids`` to >= 0.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxprep._constants import NO_PREV_ROW, PAD_INPUT_ID, PAD_STATE_ROW
from jaxprep._ragged import counts_per_target, take_rows
from jaxprep._typing import Array, Bool, Int32
from jaxprep.bounds import InvalidBatchError, check_row_bound
from jaxprep.features.flags import PREV_BATCH_ROW_OUT_OF_RANGE
from jaxprep.features.record import Feature


def write_prev_tokens(input_ids: Int32[Array, " num_tokens_padded"], rows: Int32[Array, " num_reqs_padded"],
                      query_start_loc: Int32[Array, " num_reqs_padded_plus_1"],
                      is_real_req: Bool[Array, " num_reqs_padded"],
                      drafts: Int32[Array, " num_reqs_padded"], prev_batch_rows: Int32[Array, " max_num_reqs"],
                      prev_sampled_token_ids: Int32[Array, " max_num_reqs"],
                      prev_draft_token_ids: Int32[Array, "max_num_reqs K"] | None,
                      ) -> Int32[Array, " num_tokens_padded"]:
    """``input_ids`` with last step's sampled (and draft) tokens written in; placeholders kept.

    ```
    # last batch [r0, r1, r2], r2 discarded; now [r1, r0, r2] with S [1, 1, 3]:
    #   prev rows [1, 0, -1] -> input_ids[0] = sampled[1], input_ids[1] = sampled[0]; r2 keeps the table's ids
    ```
    """
    num_tokens_padded = input_ids.shape[0]
    prev = jnp.where(is_real_req, take_rows(prev_batch_rows, rows, fill_value=NO_PREV_ROW), NO_PREV_ROW)
    has_prev = prev >= 0
    prev_row = jnp.clip(prev, 0, prev_sampled_token_ids.shape[0] - 1)  # in range on every backend, bad input too
    sampled_dest = query_start_loc[1:] - 1 - drafts
    # rows without a previous token write a spare entry past the end (never -1, which wraps); the clip
    # keeps every write inside [0, T_pad] on every backend, bad input included
    dest = jnp.clip(jnp.where(has_prev, sampled_dest, num_tokens_padded), 0, num_tokens_padded)
    with_spare = jnp.pad(input_ids, (0, 1)).at[dest].set(prev_sampled_token_ids[prev_row], mode="promise_in_bounds")
    if prev_draft_token_ids is not None:
        # D [2], sampled_dest [4] -> draft_dest [[5, 6, 7..]], kept where j < D
        j = jnp.arange(prev_draft_token_ids.shape[1], dtype=jnp.int32)
        keep = has_prev[:, None] & (j[None, :] < drafts[:, None])
        draft_dest = jnp.clip(jnp.where(keep, sampled_dest[:, None] + 1 + j[None, :], num_tokens_padded),
                              0, num_tokens_padded)
        with_spare = with_spare.at[draft_dest].set(prev_draft_token_ids[prev_row], mode="promise_in_bounds")
    input_ids = with_spare[:num_tokens_padded]
    return input_ids


def clamp_placeholders(input_ids: Int32[Array, " num_tokens_padded"]) -> Int32[Array, " num_tokens_padded"]:
    """The model's ``input_ids``: every placeholder left (-1) becomes `PAD_INPUT_ID`.

    ```
    # [502, -1, 34] -> [502, 0, 34]
    ```
    """
    return jnp.maximum(input_ids, PAD_INPUT_ID)


def prev_batch_rows_from_step(idx_mapping: Int32[Array, " num_reqs_padded"],
                              discard_request_mask: Bool[Array, " num_reqs_padded"] | None,
                              max_num_reqs: int) -> Int32[Array, " max_num_reqs"]:
    """`BatchState.prev_batch_rows` for the next step, from this step's outputs, on the device.

    A state row gets the batch row it was sampled at, or `NO_PREV_ROW` if it was not in the batch
    or its token was discarded (a partial prefill).

    ```
    # idx_mapping [2, 0, -1], discard [F, T, T], 4 rows -> [-1, -1, 0, -1]
    ```
    """
    sampled = idx_mapping != PAD_STATE_ROW
    if discard_request_mask is not None:
        sampled = sampled & ~discard_request_mask
    target = jnp.where(sampled, idx_mapping, max_num_reqs)
    batch_rows = jnp.arange(idx_mapping.shape[0], dtype=jnp.int32)
    return jnp.full((max_num_reqs,), NO_PREV_ROW, jnp.int32).at[target].set(batch_rows, mode="drop")


def check_prev_batch_rows(prev, in_batch, max_num_reqs: int) -> None:
    """Host check of `BatchState.prev_batch_rows`: in range, and no last-step row claimed twice."""
    check_row_bound((prev < NO_PREV_ROW) | (prev >= max_num_reqs), "prev_batch_rows", prev,
                    f"[{NO_PREV_ROW}, max_num_reqs={max_num_reqs})", relation="is outside")
    used = prev[in_batch & (prev >= 0)]
    if len(np.unique(used)) != len(used):
        raise InvalidBatchError(f"prev_batch_rows maps two scheduled rows to one last-step batch row: {used.tolist()}")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _bad_prev_batch_rows(prev, in_batch):
    """Rows outside ``[-1, R)``, and scheduled rows that share a last-step row
    (`async_tokens.check_prev_batch_rows`)."""
    rows = prev.shape[0]
    outside = (prev < NO_PREV_ROW) | (prev >= rows)
    claimed = in_batch & (prev >= 0) & ~outside
    return outside | (counts_per_target(prev, claimed, rows) > 1)


def _inputs(features) -> dict[str, str]:
    needs = {"prev_sampled_token_ids": "async_tokens", "prev_batch_rows": "async_tokens"}
    if features.spec_decode:
        needs["prev_draft_token_ids"] = "async_tokens with spec decode"
    return needs


def _empty_inputs(config) -> dict[str, np.ndarray]:
    rows = config.max_num_reqs
    out = {"prev_sampled_token_ids": np.zeros((rows,), np.int32),
           "prev_batch_rows": np.full((rows,), NO_PREV_ROW, np.int32)}
    if config.features.spec_decode:
        out["prev_draft_token_ids"] = np.zeros((rows, config.features.num_speculative_tokens), np.int32)
    return out


def _metadata(build) -> None:
    """Last step's sampled (and draft) tokens written into the ids (before the placeholder clamp)."""
    step, state, layout = build.step, build.state, build.layout
    build.unclamped = write_prev_tokens(build.input_ids, layout.rows, step.attn_metadata.query_start_loc,
                                        layout.is_real_req, build.drafts, state.prev_batch_rows,
                                        state.prev_sampled_token_ids,
                                        state.prev_draft_token_ids if build.config.features.spec_decode else None)


def _clamp(build) -> None:
    # vLLM's -1 placeholder drafts (the async scheduler's, and the sync scheduler's pad_spec_decode):
    # read as drafts before the clamp, so never accepted; clamped to 0 in input_ids, as V1's _preprocess
    build.input_ids = clamp_placeholders(build.unclamped)


PLACEHOLDERS = Feature(name="placeholders",
                       is_on=lambda features: features.async_tokens or features.spec_decode, metadata=_clamp)
"""A step of `jaxprep.features.registry.STEP_ORDER` that no switch owns: the clamp of placeholder drafts
in ``input_ids``, after last step's tokens are written and before anything reads the ids."""


FEATURE = Feature(
    name="async_tokens",
    is_on=lambda features: features.async_tokens,
    inputs=_inputs,
    empty_inputs=_empty_inputs,
    check_values=lambda host, computed, scheduled, config: check_prev_batch_rows(
        host["prev_batch_rows"].astype(np.int64), scheduled > 0, config.max_num_reqs),
    row_flags=lambda state, config, in_batch: [
        (PREV_BATCH_ROW_OUT_OF_RANGE, _bad_prev_batch_rows(state.prev_batch_rows, in_batch))],
    messages=lambda config: {
        PREV_BATCH_ROW_OUT_OF_RANGE: f"prev_batch_rows is outside [{NO_PREV_ROW}, max_num_reqs="
                                     f"{config.max_num_reqs}), or two scheduled rows claim one last-step batch row"},
    metadata=_metadata,
)
