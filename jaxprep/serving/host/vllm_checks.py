"""The one pass over vLLM's ``SchedulerOutput`` (and ``GrammarOutput``) that `VllmAdapter.step` runs before
it writes anything: each check names the object and the field it found wrong.

vLLM's runners trust their scheduler (`vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._update_states`
indexes its dicts and zips its lists); the adapter is jaxprep's door, so an output that is not one
vLLM's scheduler could have sent is refused by name instead of being truncated (a count of 1.5 read as
1), half applied or answered with a bare ``KeyError``. Every check is a length, a dict lookup or one
NumPy reduction over a field already turned into an array; the per-request ones run inside loops the
translation has anyway (new requests, appended blocks, drafts).

What is checked here (the bounds of the values, against the batch, are `jaxprep.serving.host.checks`'s):

- ``num_scheduled_tokens``: a dict of request ids to integers >= 1 (never truncated, never a bool),
  summing to ``total_num_scheduled_tokens``; as many entries as new and cached requests;
- ``scheduled_new_reqs``: token ids present, ``block_ids`` one list per KV-cache group,
  ``num_computed_tokens`` an integer;
- ``scheduled_cached_reqs``: ``num_computed_tokens`` and ``new_block_ids`` as long as ``req_ids``,
  integer counts, ``resumed_req_ids`` among ``req_ids``, ``new_block_ids`` entries None or per group;
- ``scheduled_spec_decode_tokens``: keys among the scheduled requests, lists of at most K integers;
- the ``GrammarOutput``: its requests scheduled this step, once each, and its bitmask
  ``[len(ids) * (1 + K), words]`` int32 (vLLM's ``mask_stride``).
"""

from __future__ import annotations

import numpy as np

from jaxprep.serving._values import integer, integer_array


class InvalidSchedulerOutputError(ValueError):
    """A vLLM ``SchedulerOutput`` (or ``GrammarOutput``) the adapter cannot take, naming the object and the
    field; the adapter, its batch and the device state are unchanged."""


def fail(message: str):
    raise InvalidSchedulerOutputError(message)


def scheduled_counts(scheduler_output) -> tuple[dict, np.ndarray, int]:
    """``num_scheduled_tokens`` (the dict), its counts as int64 in its order, and the checked total.

    ```
    # {"a": 3, "b": 1}, total 4 -> ({...}, [3, 1], 4); {"a": 1.5} -> "... ['a'] = 1.5 is not an integer"
    ```
    """
    counts = scheduler_output.num_scheduled_tokens
    if not isinstance(counts, dict):
        fail(f"SchedulerOutput.num_scheduled_tokens must be a dict of request id -> count, got "
             f"{type(counts).__name__}")
    values = np.array(list(counts.values()))
    if values.dtype.kind not in "iu" or values.ndim != 1:  # floats, bools, objects: named one by one
        for req_id, value in counts.items():
            integer(f"SchedulerOutput.num_scheduled_tokens[{req_id!r}]", value, error=InvalidSchedulerOutputError)
        values = integer_array("SchedulerOutput.num_scheduled_tokens", list(counts.values()),
                               InvalidSchedulerOutputError)
    if values.size and values.min() < 1:
        req_id = list(counts)[int(np.argmin(values))]
        fail(f"SchedulerOutput.num_scheduled_tokens[{req_id!r}] = {int(values.min())} must be >= 1 (vLLM lists "
             "only the requests it schedules)")
    total = scheduler_output.total_num_scheduled_tokens
    if type(total) is not int or total < 0:  # vLLM's is a Python int; anything else is read by name
        total = integer("SchedulerOutput.total_num_scheduled_tokens", total, minimum=0,
                        error=InvalidSchedulerOutputError)
    if total != int(values.sum()):
        fail(f"SchedulerOutput.total_num_scheduled_tokens = {total}, but num_scheduled_tokens sums to "
             f"{int(values.sum())}")
    return counts, values, total


def check_request_lists(scheduler_output, num_scheduled: int) -> None:
    """Every scheduled request is a new or a cached one, and the cached lists are parallel."""
    cached, new = scheduler_output.scheduled_cached_reqs, scheduler_output.scheduled_new_reqs
    req_ids = cached.req_ids
    for name in ("num_computed_tokens", "new_block_ids"):
        if len(getattr(cached, name)) != len(req_ids):
            fail(f"CachedRequestData.{name} has {len(getattr(cached, name))} entries, CachedRequestData.req_ids "
                 f"{len(req_ids)}: they are parallel lists")
    if len(new) + len(req_ids) != num_scheduled:
        fail(f"SchedulerOutput.num_scheduled_tokens has {num_scheduled} requests, but scheduled_new_reqs has "
             f"{len(new)} and scheduled_cached_reqs.req_ids {len(req_ids)}: each scheduled request is one of them")
    resumed = cached.resumed_req_ids
    if resumed and not set(resumed) <= set(req_ids):
        fail(f"CachedRequestData.resumed_req_ids names {sorted(set(resumed) - set(req_ids))}, not in "
             "CachedRequestData.req_ids")


def cached_computed(cached) -> np.ndarray:
    """``CachedRequestData.num_computed_tokens`` as int64, each an integer (never truncated)."""
    values = np.asarray(cached.num_computed_tokens)
    if values.dtype.kind not in "iu" or values.ndim != 1:
        values = integer_array("CachedRequestData.num_computed_tokens", list(cached.num_computed_tokens),
                               InvalidSchedulerOutputError)
    return values.astype(np.int64, copy=False)


def block_groups(where: str, block_ids, num_groups: int) -> list:
    """vLLM's ``tuple[list[int], ...]`` (one list per KV-cache group) as `StepUpdates` takes it: the list
    of group 0 alone with one group, else the list of lists; a flat list or a wrong number of groups is
    refused naming ``where`` (each id's type and range are `StepUpdates`' checks, before anything is written).

    ```
    # ([1, 2],) -> [1, 2]; ([1], [7]) -> [[1], [7]]; [1, 2] -> "... block_ids must be one list per group"
    ```
    """
    if type(block_ids) is tuple and len(block_ids) == num_groups and type(block_ids[0]) is list:  # vLLM's
        return block_ids[0] if num_groups == 1 else [list(ids) for ids in block_ids]
    if not isinstance(block_ids, (tuple, list)) or not all(isinstance(g, (list, tuple, range)) for g in block_ids):
        fail(f"{where}.block_ids must be one list of block ids per KV-cache group ({num_groups}), got "
             f"{_short(block_ids)}")
    if len(block_ids) != num_groups:
        fail(f"{where}.block_ids has {len(block_ids)} group lists, the configuration {num_groups} KV-cache groups")
    groups = [list(ids) for ids in block_ids]
    return groups[0] if num_groups == 1 else groups


def draft_ids(req_id: str, ids, scheduled: dict, width: int) -> list:
    """One request's ``scheduled_spec_decode_tokens`` entry: a scheduled request, at most K integer ids
    (bounds, -1 placeholders included, are `checks`' and `Schedule`'s)."""
    where = f"SchedulerOutput.scheduled_spec_decode_tokens[{req_id!r}]"
    if req_id not in scheduled:
        fail(f"{where}: request {req_id!r} is not in num_scheduled_tokens")
    if not isinstance(ids, (list, tuple)):
        fail(f"{where} must be a list of draft token ids, got {type(ids).__name__}")
    if len(ids) > width:
        fail(f"{where} has {len(ids)} drafts, more than num_speculative_tokens={width}")
    if not all(type(i) is int for i in ids):
        for i in ids:
            integer(f"{where} entry", i, error=InvalidSchedulerOutputError)
    return ids


def grammar_rows(grammar_output, scheduled: dict, stride: int) -> tuple[dict, np.ndarray, list | None]:
    """vLLM's ``GrammarOutput``: {request id: g} (its place in ``structured_output_request_ids``, the
    bitmask rows ``[g * stride, (g + 1) * stride)``), the bitmask, and ``num_acceptable_drafts``."""
    ids = list(grammar_output.structured_output_request_ids)
    bitmask = np.asarray(grammar_output.grammar_bitmask)
    acceptable = getattr(grammar_output, "num_acceptable_drafts", None)
    unknown = [r for r in ids if r not in scheduled]
    if unknown:
        fail(f"GrammarOutput.structured_output_request_ids names {unknown[:4]}, not scheduled in this step")
    if len(set(ids)) != len(ids):
        fail(f"GrammarOutput.structured_output_request_ids names a request twice: {ids}")
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != len(ids) * stride:
        fail(f"GrammarOutput.grammar_bitmask has shape {bitmask.shape} and dtype {bitmask.dtype}, expected int32 "
             f"[{len(ids)} requests * (1 + num_speculative_tokens) = {len(ids) * stride}, words]")
    if acceptable is not None and len(acceptable) != len(ids):
        fail(f"GrammarOutput.num_acceptable_drafts has {len(acceptable)} entries, structured_output_request_ids "
             f"{len(ids)}")
    return {r: g for g, r in enumerate(ids)}, bitmask, None if acceptable is None else list(acceptable)


def token_count(where: str, value) -> int:
    return integer(where, value, minimum=0, error=InvalidSchedulerOutputError)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def hashable_id(where: str, req_id) -> None:
    try:
        hash(req_id)
    except TypeError:
        fail(f"{where} = {_short(req_id)} is not a request id (unhashable {type(req_id).__name__})")


def integer_value(where: str, value) -> int:
    return integer(where, value, error=InvalidSchedulerOutputError)
