"""`FEATURES`: one record per optional feature (`jaxprep.features.record.Feature`), in order, and the
loops the central code runs over them.

The order is the order of the host checks (the first broken bound raises) and of the inputs a
missing-field error names first. Adding a feature: its module exports ``FEATURE``, its tests, one line
here and, if it adds outputs to the step, one in `STEP_ORDER` (and its bits in `jaxprep.features.flags`).
"""

from __future__ import annotations

import numpy as np

from jaxprep._typing import Array, Bool
from jaxprep.bounds import check_row_bound
from jaxprep.features import (
    async_tokens,
    attn_state,
    dcp,
    discard,
    drafter,
    grammar,
    hybrid,
    kv_groups,
    logits_indirection,
    lora,
    masks,
    mrope,
    prompt_embeds,
    reorder,
    sampling,
    spec_decode,
    ubatch,
)
from jaxprep.features.flags import PREFILL_LEN_OUT_OF_RANGE
from jaxprep.features.record import Feature

PREFILL_LEN_READERS = ("discard_request_mask", "mrope", "drafter", "hybrid")
"""The `FeatureConfig` switches whose features read `BatchState.prefill_len` (each row's prompt length)."""


def _prefill_len_check(host, computed, scheduled, config) -> None:
    prompt = host["prefill_len"].astype(np.int64)
    check_row_bound((prompt < 0) | (prompt > config.max_model_len), "prefill_len", prompt,
                    f"[0, max_model_len={config.max_model_len}]", relation="is outside")


PREFILL_LEN = Feature(
    name="prefill_len",
    is_on=lambda features: any(getattr(features, switch) for switch in PREFILL_LEN_READERS),
    # the field names the last switch on that reads it
    inputs=lambda features: {"prefill_len": [s for s in PREFILL_LEN_READERS if getattr(features, s)][-1]},
    empty_inputs=lambda config: {"prefill_len": np.zeros((config.max_num_reqs,), np.int32)},
    check_values=_prefill_len_check,
    row_flags=lambda state, config, in_batch: [
        (PREFILL_LEN_OUT_OF_RANGE, (state.prefill_len < 0) | (state.prefill_len > config.max_model_len))],
    messages=lambda config: {PREFILL_LEN_OUT_OF_RANGE: f"prefill_len is outside [0, max_model_len="
                                                       f"{config.max_model_len}]"},
)
"""The one input four features share (`PREFILL_LEN_READERS`): checked once, whichever of them is on."""

FEATURES: tuple[Feature, ...] = (
    spec_decode.FEATURE,
    PREFILL_LEN,
    kv_groups.FEATURE,
    mrope.FEATURE,
    prompt_embeds.FEATURE,
    async_tokens.FEATURE,
    hybrid.FEATURE,
    grammar.FEATURE,
    lora.FEATURE,
    sampling.FEATURE,
    masks.FEATURE,
    discard.FEATURE,
    dcp.FEATURE,
    attn_state.FEATURE,
    reorder.FEATURE,
    drafter.FEATURE,
    logits_indirection.FEATURE,
    ubatch.FEATURE,
)


STEP_ORDER: tuple[Feature, ...] = (
    dcp.FEATURE,
    kv_groups.FEATURE,
    attn_state.FEATURE,
    masks.FEATURE,
    reorder.FEATURE,
    async_tokens.FEATURE,
    async_tokens.PLACEHOLDERS,
    prompt_embeds.FEATURE,
    spec_decode.FEATURE,
    discard.FEATURE,
    mrope.FEATURE,
    logits_indirection.ROWS,
    lora.FEATURE,
    logits_indirection.FEATURE,
    sampling.FEATURE,
    drafter.FEATURE,
    hybrid.FEATURE,
    grammar.FEATURE,
    ubatch.FEATURE,
)
"""The order the step's feature outputs are built in (`jaxprep.features.dispatch.with_features`): each
reads what those before it wrote (`record.StepBuild`): the attention side first, then the token ids
(last step's tokens, the placeholder clamp, prompt embeddings), the outputs read from them, V2's logits
rows and what reads those, and the micro-batches of the finished step last. Two steps belong to no
switch: `async_tokens.PLACEHOLDERS` and `logits_indirection.ROWS`."""


def features_on(features) -> tuple[Feature, ...]:
    """The records of the features ``features`` (a `FeatureConfig`) turns on, in registry order."""
    return tuple(feature for feature in FEATURES if feature.is_on(features))


def required_fields(features) -> dict[str, str]:
    """`BatchState` field -> the switch that needs it, for every feature that is on."""
    needs = {}
    for feature in features_on(features):
        needs.update(feature.inputs(features))
    return needs


def empty_inputs(config) -> dict[str, np.ndarray | tuple]:
    """Host arrays of the feature inputs ``config.features`` needs, in their empty state."""
    out = {}
    for feature in features_on(config.features):
        out.update(feature.empty_inputs(config))
    return out


def check_values(host: dict, core: dict, config) -> None:
    """The host value checks of the features that are on; ``core`` holds the four core tables."""
    computed = core["num_computed_tokens"].astype(np.int64)
    scheduled = core["num_scheduled_tokens"].astype(np.int64)
    for feature in features_on(config.features):
        feature.check_values(host, computed, scheduled, config)


def row_flags(state, config) -> list[tuple[int, Bool[Array, " max_num_reqs"]]]:
    """``(bit, rows that break its bound)`` for every row-level bound of the features that are on."""
    in_batch = state.num_scheduled_tokens > 0
    return [flag for feature in features_on(config.features) for flag in feature.row_flags(state, config, in_batch)]


def state_flags(state, config) -> list[tuple[int, Bool[Array, ""]]]:
    """``(bit, flag)`` for the bounds of the features that are on that belong to no state row."""
    return [flag for feature in features_on(config.features) for flag in feature.state_flags(state, config)]


def messages(config) -> dict[int, str]:
    """What each feature bit means (every feature's, on or off), lowest bit first."""
    merged = {}
    for feature in FEATURES:
        merged.update(feature.messages(config))
    return dict(sorted(merged.items()))
