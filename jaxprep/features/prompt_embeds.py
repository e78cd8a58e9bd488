"""Prompt embeddings (docs/semantics.md#prompt-embeddings): which scheduled positions are embeddings, and where they
are.

`BatchState.is_token_ids` is False where a prompt position was given as an embedding; that
embedding is row ``prompt_embeds_start[r] + position`` of the caller's embedding pool. The model
embeds ``input_ids`` where ``is_token_ids`` is True and gathers the pool elsewhere (vLLM V2
``_apply_prompt_embeds_kernel``); ``input_ids`` at embedding positions become 0, as vLLM does
before its lookup.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import INT32_MAX, PAD_EMBEDS_INDEX, PAD_INPUT_ID
from jaxprep._typing import Array, Bool, Int32, StepArray
from jaxprep.bounds import check_row_bound
from jaxprep.features.flags import PROMPT_EMBEDS_START_OUT_OF_RANGE
from jaxprep.features.record import Feature


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class PromptEmbedsMetadata:
    """Per-token choice between the token embedding and a prompt embedding."""

    is_token_ids: Bool[StepArray, " num_tokens_padded"]  # False: take embeds_indices; pad: True
    embeds_indices: Int32[StepArray, " num_tokens_padded"]  # pool row of a prompt embedding; else 0


def prompt_embeds_metadata(is_token_ids: Bool[Array, "max_num_reqs max_model_len"],
                           prompt_embeds_start: Int32[Array, " max_num_reqs"],
                           token_rows: Int32[Array, " num_tokens_padded"],
                           positions: Int32[Array, " num_tokens_padded"],
                           is_real_token: Bool[Array, " num_tokens_padded"],
                           input_ids: Int32[Array, " num_tokens_padded"]):
    """Returns the metadata and ``input_ids`` with 0 at the embedding positions.

    ```
    # start [100], is_token_ids row [F, F, F, T, ...], positions [1, 2, 3] -> is_token_ids [F, F, T],
    #   embeds_indices [101, 102, 0]
    ```
    """
    is_token = jnp.where(is_real_token, is_token_ids[token_rows, positions], True)
    indices = jnp.where(is_token, PAD_EMBEDS_INDEX, prompt_embeds_start[token_rows] + positions)
    return PromptEmbedsMetadata(is_token_ids=is_token, embeds_indices=indices), jnp.where(is_token, input_ids,
                                                                                          PAD_INPUT_ID)


def check_pool_start(start, in_batch, max_model_len: int) -> None:
    """Host check: every pool row ``start + position`` of a row with work fits int32."""
    check_row_bound(in_batch & ((start < 0) | (start + max_model_len > INT32_MAX)), "prompt_embeds_start", start,
                    f"[0, {INT32_MAX - max_model_len}] (INT32_MAX - max_model_len: int32 pool rows)",
                    relation="is outside")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _row_flags(state, config, in_batch) -> list:
    start = state.prompt_embeds_start
    return [(PROMPT_EMBEDS_START_OUT_OF_RANGE, in_batch & ((start < 0) | (start > INT32_MAX - config.max_model_len)))]


def _metadata(build) -> None:
    step, state, layout = build.step, build.state, build.layout
    build.outputs["prompt_embeds"], build.input_ids = prompt_embeds_metadata(
        state.is_token_ids, state.prompt_embeds_start, layout.token_rows, step.positions, layout.is_real_token,
        build.input_ids)


FEATURE = Feature(
    name="prompt_embeds",
    is_on=lambda features: features.prompt_embeds,
    inputs=lambda features: {"is_token_ids": "prompt_embeds", "prompt_embeds_start": "prompt_embeds"},
    empty_inputs=lambda config: {"is_token_ids": np.ones((config.max_num_reqs, config.max_model_len), bool),
                                 "prompt_embeds_start": np.zeros((config.max_num_reqs,), np.int32)},
    check_values=lambda host, computed, scheduled, config: check_pool_start(
        host["prompt_embeds_start"].astype(np.int64), scheduled > 0, config.max_model_len),
    row_flags=_row_flags,
    messages=lambda config: {
        PROMPT_EMBEDS_START_OUT_OF_RANGE: f"prompt_embeds_start of a scheduled row is outside "
                                          f"[0, {INT32_MAX - config.max_model_len}] (INT32_MAX - max_model_len: "
                                          f"int32 pool rows)"},
    metadata=_metadata,
)
