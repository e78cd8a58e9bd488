"""vLLM V2's logits indirection (`FeatureConfig.logits_indirection`): which logits row is whose.

V2 (`vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.prepare_inputs`) samples ``n_b = D_b + 1``
logits rows per batch row b (its drafts and one bonus token), the last ``n_b`` scheduled tokens:
``cu_num_logits = [0, cumsum(n)]``, ``logits_indices[cu[b] + j] = qsl[b+1] - n_b + j``
(`vllm/v1/worker/gpu/input_batch.py::_combine_sampled_and_draft_tokens_kernel`), and every logits
row knows its request's state slot and its place in the request
(`vllm/v1/worker/gpu/input_batch.py::_expand_idx_mapping_kernel`). The sampler reads each row's
position and input id (`vllm/v1/worker/gpu/sample/sampler.py::Sampler.__call__`).

Without drafts in a step (also with ``K > 0``) V2 takes its no-draft branch: ``n_b = 1``,
``cu_num_logits = arange(R + 1)``, ``expanded_idx_mapping = idx_mapping``, local positions 0; the
formulas above give exactly that, so one code path serves both.

Sizes: V2 pads none of these; here they have ``L_pad = min(T_pad, R_pad * (K + 1))`` logits rows
and ``R_pad`` requests, padded with the constants of `jaxprep._constants`.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

from jaxprep._constants import (
    PAD_INPUT_ID,
    PAD_LOCAL_POS,
    PAD_LOGITS_INDEX,
    PAD_NUM_DRAFT_TOKENS,
    PAD_POSITION,
    PAD_STATE_ROW,
)
from jaxprep._ragged import prefix_sum, token_request_index
from jaxprep._typing import Array, Bool, Int32, StepArray
from jaxprep.features.record import Feature
from jaxprep.features.spec_decode import padded_sizes


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class LogitsIndirection:
    """V2 ``InputBatch`` fields of the logits rows, padded; L = ``cu_num_logits[-1]`` real rows."""

    cu_num_logits: Int32[StepArray, " num_reqs_padded_plus_1"]  # [0, cumsum(D + 1)]; pad repeats L
    logits_indices: Int32[StepArray, " num_logits_padded"]  # token of each logits row; pad 0
    expanded_idx_mapping: Int32[StepArray, " num_logits_padded"]  # state slot of each logits row; pad -1
    expanded_local_pos: Int32[StepArray, " num_logits_padded"]  # row's index inside its request; pad 0
    logits_pos: Int32[StepArray, " num_logits_padded"]  # positions[logits_indices]; pad 0
    logits_input_ids: Int32[StepArray, " num_logits_padded"]  # input_ids[logits_indices]; pad 0
    is_padding: Bool[StepArray, " num_tokens_padded"]  # True for the padded tokens [N, T_pad)
    num_draft_tokens_per_req: Int32[StepArray, " num_reqs_padded"]  # D per batch row; pad 0

    @property
    def num_logits(self) -> Int32[Array, ""]:
        """Real logits rows ``L = R + sum(D)``."""
        return self.cu_num_logits[-1]


def logits_indirection(idx_mapping: Int32[Array, " num_reqs_padded"], drafts: Int32[Array, " num_reqs_padded"],
                       is_real_req: Bool[Array, " num_reqs_padded"],
                       query_start_loc: Int32[Array, " num_reqs_padded_plus_1"],
                       positions: Int32[Array, " num_tokens_padded"], input_ids: Int32[Array, " num_tokens_padded"],
                       is_real_token: Bool[Array, " num_tokens_padded"],
                       num_speculative_tokens: int) -> LogitsIndirection:
    """The step's `LogitsIndirection` from its batch rows (``idx_mapping``: slots, pad -1).

    ```
    # idx_mapping [5, 1, 2, 3], D [2, 1, 0, 0], qsl [0, 3, 5, 6, 12] -> n [3, 2, 1, 1], cu [0, 3, 5, 6, 7]
    #   logits row -> request [0,0,0, 1,1, 2, 3], local [0,1,2, 0,1, 0, 0]
    #   logits_indices = qsl[b+1] - n[b] + local = [0,1,2, 3,4, 5, 11]; expanded [5,5,5, 1,1, 2, 3]
    ```
    """
    num_tokens_padded, num_reqs_padded = positions.shape[0], drafts.shape[0]
    num_logits_padded, _ = padded_sizes(num_tokens_padded, num_reqs_padded, num_speculative_tokens)
    drafts = jnp.where(is_real_req, drafts, PAD_NUM_DRAFT_TOKENS)
    num_logits = jnp.where(is_real_req, drafts + 1, 0)
    cu_num_logits = jnp.pad(prefix_sum(num_logits, num_tokens_padded), (1, 0))
    row = jnp.arange(num_logits_padded, dtype=jnp.int32)
    is_real_row = row < cu_num_logits[-1]
    owner = token_request_index(cu_num_logits[1:], num_logits_padded)
    local = row - cu_num_logits[owner]
    token = jnp.where(is_real_row, query_start_loc[owner + 1] - num_logits[owner] + local, PAD_LOGITS_INDEX)
    return LogitsIndirection(
        cu_num_logits=cu_num_logits,
        logits_indices=token,
        expanded_idx_mapping=jnp.where(is_real_row, idx_mapping[owner], PAD_STATE_ROW),
        expanded_local_pos=jnp.where(is_real_row, local, PAD_LOCAL_POS),
        logits_pos=jnp.where(is_real_row, positions[token], PAD_POSITION),
        logits_input_ids=jnp.where(is_real_row, input_ids[token], PAD_INPUT_ID),
        is_padding=~is_real_token,
        num_draft_tokens_per_req=drafts,
    )


def _rows(build) -> None:
    step, layout = build.step, build.layout
    build.logits = logits_indirection(step.idx_mapping, build.drafts, layout.is_real_req,
                                      step.attn_metadata.query_start_loc, step.positions, build.input_ids,
                                      layout.is_real_token, build.config.features.num_speculative_tokens)


ROWS = Feature(name="logits_rows", metadata=_rows,
               is_on=lambda features: (features.logits_indirection_on or features.structured_outputs
                                       or features.sampling is not None))
"""A step of `jaxprep.features.registry.STEP_ORDER` that no switch owns: V2's logits rows, an output of
their own and what structured outputs and the sampling rows read (built from the final ``input_ids``)."""


def _metadata(build) -> None:
    build.outputs["logits_indirection"] = build.logits


FEATURE = Feature(name="logits_indirection", is_on=lambda features: features.logits_indirection_on,
                  metadata=_metadata)
"""This feature's record (`jaxprep.features.registry`): no input of its own and no check; `_metadata` adds
its outputs to the step."""
