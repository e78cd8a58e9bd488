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
    """

    name: str
    is_on: Callable
    inputs: Callable = _nothing
    empty_inputs: Callable = _nothing
    check_values: Callable = _no_check
    row_flags: Callable = _no_flags
    state_flags: Callable = _no_flags
    messages: Callable = _nothing
