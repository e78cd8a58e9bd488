"""`Feature`: what the rest of jaxprep needs to know of one optional feature, as one record.

Each feature module exports one (``FEATURE``) and `jaxprep.features.registry.FEATURES` lists them in
order; the central code (`jaxprep.validate`, `jaxprep.state`, `jaxprep.features.inputs`) loops over
that list instead of an ``if features.x:`` chain per file, as JAX registers a lowering rule per
primitive. Adding a feature touches its module, its tests and one line of the registry (and its bit
in `jaxprep.features.flags`, the one table that keeps the error word's bits apart).

Every part but ``name`` and ``is_on`` is optional: a feature that reads no `BatchState` input has
no inputs, no host check and no row flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def _nothing(*args) -> dict:
    return {}


def _no_flags(*args) -> list:
    return []


def _no_check(*args) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Feature:
    """One optional feature, as the core sees it.

    Attributes:
      name: the feature's module under `jaxprep.features`.
      is_on: ``FeatureConfig -> bool``.
      inputs: ``FeatureConfig -> {BatchState field: the switch that needs it}`` (read only when on).
      empty_inputs: ``PrepConfig -> {BatchState field: its empty host value}`` (`BatchState.empty`).
      check_values: ``(host fields, computed, scheduled, PrepConfig) -> None``: the host check of its
        inputs' values (int64 counts), raising `jaxprep.validate.InvalidBatchError` naming the bound.
      row_flags: ``(state, PrepConfig, in_batch) -> [(bit, bad rows)]``: the same bounds on the device,
        per state row (`jaxprep.validate.flag_rows` drops a flagged row from the batch).
      state_flags: ``(state, PrepConfig) -> [(bit, flag)]``: device bounds that belong to no row.
      messages: ``PrepConfig -> {bit: what it means}``: its bits of the error word, named for the user.
      metadata: ``StepBuild -> None``: adds its outputs to the step being built (inside the jit), reading
        what the features before it in `jaxprep.features.registry.STEP_ORDER` wrote.
    """

    name: str
    is_on: Callable
    inputs: Callable = _nothing
    empty_inputs: Callable = _nothing
    check_values: Callable = _no_check
    row_flags: Callable = _no_flags
    state_flags: Callable = _no_flags
    messages: Callable = _nothing
    metadata: Callable = _no_check


@dataclasses.dataclass
class StepBuild:
    """A prepared step while the features that are on add their outputs (`jaxprep.features.dispatch`).

    What they read: the plain ``step``, the ``state``, the ``config``, the batch ``layout``
    (`jaxprep._ragged.Layout`) and each batch row's ``drafts``. What they write, in
    `registry.STEP_ORDER`: ``attn_metadata`` (DCP's slots and local lengths), ``input_ids`` (last
    step's tokens, the clamp of placeholder drafts, prompt embeddings), ``unclamped`` (the ids before
    that clamp, which spec decode reads), ``errors`` (the bits of tokens flagged where they are known),
    ``logits`` (V2's logits rows, which structured outputs and sampling read) and ``outputs`` (each
    feature's `StepInputs` field). A builder local to one trace: `finish` returns the new step.
    """

    step: Any
    state: Any
    config: Any
    layout: Any
    drafts: Any
    attn_metadata: Any = None
    input_ids: Any = None
    unclamped: Any = None
    errors: Any = None
    logits: Any = None
    outputs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.attn_metadata = self.step.attn_metadata
        self.input_ids = self.unclamped = self.step.input_ids
        self.errors = self.step.errors

    def finish(self):
        """The step with every output written so far."""
        return dataclasses.replace(self.step, input_ids=self.input_ids, errors=self.errors,
                                   attn_metadata=self.attn_metadata, **self.outputs)
