"""`VllmAdapter`'s two ways of reading a step side by side, on the adapter's current state, nothing changed.

The common path reads vLLM's output straight into the buffer's columns (`vllm_columns.ColumnReader`), checks
them at once (`column_checks.check_columns`) and packs them (`update_packing.pack_columns`); the general path
reads it into a `StepUpdates` (`vllm_checks`), checks it (`checks.check_updates`, `batch.check_bucket`) and
packs it (`update_packing.pack_step`). `compare_paths` runs both: a step the general path refuses must be one
the common path does not take; a step both take must give the same buffers (bit for bit), the same host mirror
and the same request map.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from jaxprep.serving.host import checks
from jaxprep.serving.host.batch import check_bucket
from jaxprep.serving.host.vllm import GRAMMAR_NOT_GIVEN, VllmAdapter
from jaxprep.serving.update_packing import pack_step


@dataclasses.dataclass(frozen=True)
class Paths:
    """What each path made of one step: ``kind`` "common" (both took it), "general" (only the general path
    reads it: another shape, or a bound the common check leaves to it) or "refused"; the common path's
    plan and the general path's (mirror, buffers, plan); ``error`` the general path's refusal."""

    kind: str
    common: object | None
    general: tuple | None
    error: str | None = None


def both_paths(adapter: VllmAdapter, scheduler_output, grammar_output=GRAMMAR_NOT_GIVEN) -> Paths:
    common = adapter._common_plan(scheduler_output, grammar_output) if adapter._columns is not None else None
    try:
        plan = adapter._general_plan(scheduler_output, grammar_output)
        rows = checks.check_updates(adapter.batch.rows, plan.updates, adapter.config)
        if plan.total:
            check_bucket(rows, plan.num_tokens_padded, adapter.config)
        packed = pack_step(adapter.config, plan.updates, adapter.batch.rows.table_blocks)
    except ValueError as error:
        return Paths("refused", common, None, f"{type(error).__name__}: {error}")
    return Paths("general" if common is None else "common", common, (rows, packed, plan))


def differences(paths: Paths) -> list[str]:
    """Where the two paths disagree: the common path took a refused step, or made other buffers, another
    mirror or another request map than the general path."""
    if paths.kind == "refused":
        return [] if paths.common is None else [f"the common path took a step the general path refuses: {paths.error}"]
    if paths.kind == "general":
        return []
    rows, packed, plan = paths.general
    common, out = paths.common, []
    mine, buffers = common.checked.packed.buffers, packed.buffers
    if len(mine) != len(buffers):
        out.append(f"{len(mine)} buffers, the general path {len(buffers)}")
    for i, (a, b) in enumerate(zip(mine, buffers)):
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            unequal = np.flatnonzero(a[: len(b)] != b[: len(a)])
            out.append(f"buffer {i}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}, first word that differs "
                       f"{int(unequal[0]) if len(unequal) else None}")
    for field in dataclasses.fields(rows):
        a, b = getattr(common.checked.rows, field.name), getattr(rows, field.name)
        if a.dtype != b.dtype or not np.array_equal(a, b):
            out.append(f"mirror.{field.name}")
    requests, theirs = common.requests, plan.requests
    for name in ("rows", "admitted", "free"):
        if getattr(requests, name) != getattr(theirs, name):
            out.append(f"request map: {name}")
    for name in ("total", "num_tokens_padded", "verifying", "lora_slots", "grammar"):
        if getattr(common, name) != getattr(plan, name):
            out.append(f"plan.{name}: {getattr(common, name)!r} vs {getattr(plan, name)!r}")
    for name in ("content_words", "changed_words"):
        if getattr(common.checked.packed, name) != getattr(packed, name):
            out.append(f"packed.{name}")
    return out


def try_corruptions(adapter: VllmAdapter, scheduler_output, corruptions: dict, rng, seen: dict,
                    label: str) -> list[str]:
    """Each of ``corruptions`` (name -> fn(output, rng), False where it does not apply) on a deep copy of
    ``scheduler_output``, read both ways: counts in ``seen`` the corruptions the general path refused
    (``corrupt_refused``) and those the common path took (``corrupt_common``); returns the differences."""
    problems = []
    for name, corrupt in corruptions.items():
        broken = copy.deepcopy(scheduler_output)
        if corrupt(broken, rng) is False:
            continue
        paths = both_paths(adapter, broken)
        seen["corrupt_refused"] += paths.kind == "refused"
        seen["corrupt_common"] += paths.kind == "common"
        problems += [f"{label} {name}: {d}" for d in differences(paths)]
    return problems
