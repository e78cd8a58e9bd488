"""Adds the outputs of the optional features to a prepared step (inside `prepare_padded`'s jit).

`prepare_padded` builds the plain step and, only if some feature of ``config.features`` is on,
hands it here with the batch layout it computed (`jaxprep._ragged.Layout`). Each feature that is on
adds its outputs through its record's ``metadata`` (`jaxprep.features.record.Feature`), in
`jaxprep.features.registry.STEP_ORDER`; a feature that is off adds nothing to the traced computation.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxprep._ragged import Layout, take_rows
from jaxprep.features import registry
from jaxprep.features.record import StepBuild


def with_features(step, state, config, layout: Layout):
    """``step`` with the outputs of every feature that ``config.features`` turns on."""
    features = config.features
    if features.spec_decode:
        drafts = jnp.where(layout.is_real_req, take_rows(state.num_draft_tokens, layout.rows, fill_value=0), 0)
    else:
        drafts = jnp.zeros_like(layout.scheduled)
    build = StepBuild(step, state, config, layout, drafts)
    for feature in registry.STEP_ORDER:
        if feature.is_on(features):
            feature.metadata(build)
    return build.finish()
