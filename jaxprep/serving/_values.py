"""Host checks of plain values at the serving loop's entry points: a count is an integer, never
truncated (2.7 tokens is an error, not 2), never a bool, never wrapped into int32; a request id hashes.

Each check raises ValueError (or the caller's error type) naming the field, the value and the bound,
before anything is queued or stored.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from jaxprep._constants import INT32_MAX, INT32_MIN


def integer(where: str, value, minimum: int | None = None, error: type[Exception] = ValueError) -> int:
    """``value`` as a Python int if it is an integer (Python or NumPy, not a bool) >= ``minimum``.

    ```
    # 3 -> 3; np.int64(3) -> 3; 2.5, True, None, "3" -> error naming ``where``
    ```
    """
    if isinstance(value, (bool, np.bool_)):
        raise error(f"{where} = {value!r} must be an integer, not a bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise error(f"{where} = {value!r} must be an integer, got {type(value).__name__}") from None
    if minimum is not None and number < minimum:
        raise error(f"{where} = {number} must be >= {minimum}")
    return number


def integer_array(where: str, values, error: type[Exception] = ValueError) -> np.ndarray:
    """``values`` as an int64 array if every entry is an integer inside int32; a fraction (2.7), NaN,
    a bool array or a value past int32 raises ``error`` naming ``where``, the entry and the value.

    ```
    # [3, 2.0] -> [3, 2]; [3, 2.7] -> "Schedule.num_scheduled_tokens[1] = 2.7 is not an integer"
    ```
    """
    array = np.asarray([] if values is None else values)
    if array.size == 0 and array.dtype.kind != "b":
        return np.zeros(array.shape, np.int64)
    if array.dtype.kind == "b":
        raise error(f"{where} holds bools ({array.ravel()[:4].tolist()}...): give integer counts")
    if array.dtype.kind not in "iuf":  # Python ints past int64, strings, None, ...: one by one
        array = np.asarray([integer(f"{where}[{i}]", v, error=error) for i, v in enumerate(array.ravel().tolist())],
                           dtype=object).reshape(array.shape)
    flat = array.ravel()
    if array.dtype.kind == "f":
        bad = ~np.isfinite(flat) | (flat != np.round(flat))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise error(f"{where}[{i}] = {float(flat[i])} is not an integer")
    outside = (flat < INT32_MIN) | (flat > INT32_MAX)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise error(f"{where}[{i}] = {flat[i]} is outside int32 [{INT32_MIN}, {INT32_MAX}]")
    return array.astype(np.int64)


def check_payload_leaves(payload, error: type[Exception] = ValueError, where: str | None = None) -> None:
    """Every number of an update payload (dataclasses of arrays, ints and tuples, built by hand or by
    ``build``) is an integer, so no check reads a truncated value: a float array (or a Python float)
    with a fraction, NaN or inf raises ``error`` naming the field. Integer and bool arrays pass as
    they are (the payload checks bound each field); dicts (sampling rows) are checked where they are built."""
    if _all_integral(payload):  # the common case, without building a field path per leaf
        return
    where = type(payload).__name__ if where is None else where
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        for field in dataclasses.fields(payload):
            check_payload_leaves(getattr(payload, field.name), error, f"{where}.{field.name}")
    elif isinstance(payload, (tuple, list)):
        for i, value in enumerate(payload):
            check_payload_leaves(value, error, f"{where}[{i}]")
    elif isinstance(payload, float):
        integer_array(where, [payload], error)
    elif isinstance(payload, np.ndarray) and payload.dtype.kind in "fcO":
        integer_array(where, payload, error)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _all_integral(payload) -> bool:
    """True if no leaf of ``payload`` is a float or a float/complex/object array (what
    `check_payload_leaves` looks into); False sends it down the path that names the bad field."""
    kind = type(payload)
    if kind is np.ndarray:
        return payload.dtype.kind not in "fcO"
    if kind is float:
        return False
    if kind is tuple or kind is list:
        return all(_all_integral(value) for value in payload)
    names = _FIELD_NAMES.get(kind)
    if names is None:
        if not (dataclasses.is_dataclass(payload) and not isinstance(payload, type)):
            return not isinstance(payload, (float, np.ndarray, tuple, list))
        names = _FIELD_NAMES.setdefault(kind, tuple(field.name for field in dataclasses.fields(payload)))
    for name in names:  # ints, None and integer arrays inline: most fields of an entry are those
        value = getattr(payload, name)
        kind = type(value)
        if kind is int or value is None:
            continue
        if kind is np.ndarray:
            if value.dtype.kind in "fcO":
                return False
        elif not _all_integral(value):
            return False
    return True


def check_entry(where: str, entry: dict, names: tuple[str, ...]) -> None:
    """The ``names`` of one payload entry (a dict) are integers: ``row`` 0.5 is an error, not row 0."""
    for name in names:
        if name in entry:
            integer(f"{where}: {name}", entry[name])


def check_request_fields(request, request_class, sampling_class) -> None:
    """The fields of a request submitted to the loop, by type and range: a hashable ``request_id``,
    ``prompt_token_ids`` a list, ``max_tokens`` an integer >= 1, ``sampling_params`` None or a
    ``sampling_class``, and the state of a fresh request (no outputs, nothing computed, no row or blocks).
    Token ids and lengths are checked by the scheduler (`Scheduler.check_request`)."""
    if not isinstance(request, request_class):
        raise ValueError(f"expected a {request_class.__name__}, got {type(request).__name__}")
    try:
        hash(request.request_id)
    except TypeError:
        raise ValueError(f"request_id {request.request_id!r} must be hashable (an int or a str), "
                         f"got {type(request.request_id).__name__}") from None
    where = f"request {request.request_id!r}"
    if not isinstance(request.prompt_token_ids, list):
        raise ValueError(f"{where}: prompt_token_ids must be a list of ints, got "
                         f"{type(request.prompt_token_ids).__name__} (a NumPy array: use .tolist())")
    integer(f"{where}: max_tokens", request.max_tokens, minimum=1)
    if request.sampling_params is not None and not isinstance(request.sampling_params, sampling_class):
        raise ValueError(f"{where}: sampling_params must be None (greedy) or a jaxprep.SamplingParams, got "
                         f"{type(request.sampling_params).__name__}")
    fresh = dict(row=-1, output_token_ids=[], num_computed_tokens=0, block_ids=[], spec_token_ids=[],
                 num_output_placeholders=0)
    for name, value in fresh.items():
        if getattr(request, name) != value:
            raise ValueError(f"{where}: {name}={getattr(request, name)!r} must be {value!r}: submit a new "
                             "request, not one the loop has run")
