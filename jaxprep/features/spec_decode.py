"""Speculative-decoding metadata (docs/semantics.md#spec-decode), vLLM's ``SpecDecodeMetadata`` on static shapes.

A row with ``D`` drafts schedules ``S >= D + 1`` tokens whose last ``D`` are the drafts (they
already sit in the token table after the accepted tokens). Its last ``D + 1`` tokens are sampled:
logit ``j`` of the row verifies the draft at ``j + 1``, the last one gives the bonus token.

Static sizes: ``num_logits_padded = min(T_pad, R_pad * (K + 1))`` and
``num_drafts_padded = min(T_pad, R_pad * K)`` with ``K = num_speculative_tokens``.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import PAD_INPUT_ID, PAD_LOGITS_INDEX
from jaxprep._ragged import token_request_index
from jaxprep._typing import Array, Bool, Int32, StepArray
from jaxprep.bounds import InvalidBatchError, check_row_bound
from jaxprep.features.flags import DRAFTS_OUT_OF_RANGE, DRAFTS_PAST_SCHEDULED
from jaxprep.features.record import Feature


def draft_row_flags(drafts: Int32[Array, " rows"], scheduled: Int32[Array, " rows"],
                    num_speculative_tokens: int) -> list[tuple[int, Bool[Array, " rows"]]]:
    """``(bit, rows that break its bound)`` for the draft counts (`check_drafts`' bounds on the device):
    the spec-decode record's row flags on the XLA path and `jaxprep.kernels.rows` in the kernels.

    ```
    # drafts [1, 3, 2], scheduled [2, 4, 2], K 2 -> DRAFTS_OUT_OF_RANGE [0,1,0], DRAFTS_PAST_SCHEDULED [0,0,1]
    ```
    """
    in_batch = scheduled > 0
    # S < D + 1 written as S - 1 < D: no int32 wrap for D near 2**31 (S >= 1 on a scheduled row)
    return [(DRAFTS_OUT_OF_RANGE, (drafts < 0) | (in_batch & (drafts > num_speculative_tokens))),
            (DRAFTS_PAST_SCHEDULED, in_batch & (scheduled - 1 < drafts))]


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class SpecDecodeMetadata:
    """vLLM ``SpecDecodeMetadata``, padded; ``*_indices`` pads are the safe index 0.

    Every field is an output buffer of the step, each with a cost per call (BENCHMARKS.md), so the counts are
    properties read from the cumsums rather than fields of their own.
    """

    num_draft_tokens: Int32[StepArray, " num_reqs_padded"]  # D per batch row; pad: 0
    cu_num_draft_tokens: Int32[StepArray, " num_reqs_padded"]  # inclusive cumsum of D; pad repeats the total
    cu_num_sampled_tokens: Int32[StepArray, " num_reqs_padded"]  # inclusive cumsum of D + 1; pad repeats the total
    logits_indices: Int32[StepArray, " num_logits_padded"]  # token row of each sampled logit
    target_logits_indices: Int32[StepArray, " num_drafts_padded"]  # logit row that verifies each draft
    bonus_logits_indices: Int32[StepArray, " num_reqs_padded"]  # logit row of each bonus token
    draft_token_ids: Int32[StepArray, " num_drafts_padded"]  # the drafts, flattened; pad: 0
    max_spec_len: Int32[StepArray, ""]  # max D

    @property
    def num_logits(self) -> Int32[Array, ""]:
        """Real entries of ``logits_indices``: ``sum(D + 1)`` (the last cumsum; pads repeat it)."""
        return self.cu_num_sampled_tokens[-1]

    @property
    def total_num_draft_tokens(self) -> Int32[Array, ""]:
        """Real entries of ``target_logits_indices`` and ``draft_token_ids``: ``sum(D)``."""
        return self.cu_num_draft_tokens[-1]


def padded_sizes(num_tokens_padded: int, num_reqs_padded: int, num_speculative_tokens: int) -> tuple[int, int]:
    """``(num_logits_padded, num_drafts_padded)``: the static lengths of the logit and draft arrays."""
    k = num_speculative_tokens
    return min(num_tokens_padded, num_reqs_padded * (k + 1)), min(num_tokens_padded, num_reqs_padded * k)


def spec_decode_metadata(num_draft_tokens: Int32[Array, " num_reqs_padded"],
                         query_start_loc: Int32[Array, " num_reqs_padded_plus_1"],
                         is_real_req: Bool[Array, " num_reqs_padded"],
                         input_ids: Int32[Array, " num_tokens_padded"],
                         num_speculative_tokens: int) -> SpecDecodeMetadata:
    """Builds the metadata from each batch row's draft count (docs/semantics.md#spec-decode).

    ```
    # qsl [0, 4, 104, 107], D [3, 0, 2] -> n = D + 1 = [4, 1, 3], cu_num_sampled [4, 5, 8]
    # logits_indices [0,1,2,3, 103, 104,105,106]; target [0,1,2, 5,6]; bonus [3, 4, 7]
    ```
    """
    num_logits_padded, num_drafts_padded = padded_sizes(input_ids.shape[0], is_real_req.shape[0],
                                                        num_speculative_tokens)
    drafts = jnp.where(is_real_req, num_draft_tokens, 0)
    num_sampled = jnp.where(is_real_req, drafts + 1, 0)
    zero = jnp.zeros((1,), jnp.int32)
    # starts_sampled [0, 4, 5, 8]: first logit row of each request
    starts_sampled = jnp.concatenate([zero, jnp.cumsum(num_sampled, dtype=jnp.int32)])
    starts_draft = jnp.concatenate([zero, jnp.cumsum(drafts, dtype=jnp.int32)])
    num_logits, total_drafts = starts_sampled[-1], starts_draft[-1]

    # logit row j of request b picks token qsl[b+1] - n[b] + (j - starts_sampled[b])
    logit_req = token_request_index(starts_sampled[1:], num_logits_padded)
    logit_row = jnp.arange(num_logits_padded, dtype=jnp.int32)
    local = logit_row - starts_sampled[logit_req]
    logits_indices = jnp.where(logit_row < num_logits,
                               query_start_loc[logit_req + 1] - num_sampled[logit_req] + local, PAD_LOGITS_INDEX)

    # draft k of request b is verified by logit row starts_sampled[b] + (k - starts_draft[b])
    draft_req = token_request_index(starts_draft[1:], num_drafts_padded)
    draft_row = jnp.arange(num_drafts_padded, dtype=jnp.int32)
    is_real_draft = draft_row < total_drafts
    target = jnp.where(is_real_draft, starts_sampled[draft_req] + draft_row - starts_draft[draft_req],
                       PAD_LOGITS_INDEX)
    # the draft checked by logit row j sits at the token of logit row j + 1
    draft_token_ids = jnp.where(is_real_draft, input_ids[logits_indices[target + 1]], PAD_INPUT_ID)
    return SpecDecodeMetadata(
        num_draft_tokens=drafts,
        cu_num_draft_tokens=starts_draft[1:],
        cu_num_sampled_tokens=starts_sampled[1:],
        logits_indices=logits_indices,
        target_logits_indices=target,
        bonus_logits_indices=jnp.where(is_real_req, starts_sampled[1:] - 1, PAD_LOGITS_INDEX),
        draft_token_ids=draft_token_ids,
        max_spec_len=jnp.max(drafts),
    )


def check_drafts(drafts, computed, scheduled, config) -> None:
    """Host check of `BatchState.num_draft_tokens`: ``0 <= D <= K``, ``S >= D + 1`` and the drafts
    inside the token table, on every row with work."""
    k = config.features.num_speculative_tokens
    in_batch = scheduled > 0
    check_row_bound(drafts < 0, "num_draft_tokens", drafts, "0 (counts are non-negative)", relation="is below")
    check_row_bound(in_batch & (drafts > k), "num_draft_tokens", drafts, f"num_speculative_tokens={k}")
    short = in_batch & (scheduled < drafts + 1)
    if short.any():
        row = int(np.flatnonzero(short)[0])
        raise InvalidBatchError(f"num_scheduled_tokens at row {row} is {int(scheduled[row])}, below num_draft_tokens "
                                f"+ 1 = {int(drafts[row]) + 1}: a row schedules its drafts and at least one token "
                                f"before them")
    past = in_batch & (drafts > 0) & (computed + scheduled > config.max_model_len)
    if past.any():
        row = int(np.flatnonzero(past)[0])
        raise InvalidBatchError(f"the drafts of row {row} reach position {int(computed[row] + scheduled[row]) - 1}, "
                                f"past the token table (max_model_len={config.max_model_len})")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _check_values(host, computed, scheduled, config) -> None:
    check_drafts(host["num_draft_tokens"].astype(np.int64), computed, scheduled, config)


def _messages(config) -> dict[int, str]:
    return {DRAFTS_OUT_OF_RANGE: f"num_draft_tokens is outside [0, num_speculative_tokens="
                                 f"{config.features.num_speculative_tokens}]",
            DRAFTS_PAST_SCHEDULED: "num_scheduled_tokens is below num_draft_tokens + 1 on a scheduled row"}


def _metadata(build) -> None:
    build.outputs["spec_decode"] = spec_decode_metadata(build.drafts, build.step.attn_metadata.query_start_loc,
                                                        build.layout.is_real_req, build.unclamped,
                                                        build.config.features.num_speculative_tokens)


FEATURE = Feature(
    name="spec_decode",
    is_on=lambda features: features.spec_decode,
    inputs=lambda features: {"num_draft_tokens": f"num_speculative_tokens={features.num_speculative_tokens}"},
    empty_inputs=lambda config: {"num_draft_tokens": np.zeros((config.max_num_reqs,), np.int32)},
    check_values=_check_values,
    row_flags=lambda state, config, in_batch: draft_row_flags(state.num_draft_tokens, state.num_scheduled_tokens,
                                                              config.features.num_speculative_tokens),
    messages=_messages,
    metadata=_metadata,
)
