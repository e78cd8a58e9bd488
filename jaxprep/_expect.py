"""Type checks at the public entry points: a wrong argument raises one TypeError that says what was
expected and what was given, before anything touches its attributes (an AttributeError from deep
inside says neither).

    prepare_inputs(numpy_arrays, config)
    TypeError: prepare_inputs: state must be a jaxprep.BatchState, got dict (build one with
    jaxprep.BatchState.from_numpy(token_ids=..., block_table=..., ...))
"""

from __future__ import annotations

import numbers

STATE_HINT = "build one with jaxprep.BatchState.from_numpy(token_ids=..., block_table=..., ...)"
CONFIG_HINT = ("make one with jaxprep.PrepConfig(max_num_reqs=..., max_model_len=..., max_num_batched_tokens=..., "
               "block_size=...)")


def type_name(value) -> str:
    """``np.zeros(3)`` -> ``numpy.ndarray``; ``{}`` -> ``dict``."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def expect(function: str, name: str, value, expected, expected_name: str, hint: str = "") -> None:
    """Raises TypeError unless ``isinstance(value, expected)``."""
    if not isinstance(value, expected):
        raise TypeError(f"{function}: {name} must be {expected_name}, got {type_name(value)}"
                        + (f" ({hint})" if hint else ""))


def expect_state_and_config(function: str, state, config) -> None:
    """``state`` a `BatchState` (jit tracers inside one are fine) and ``config`` a `PrepConfig`."""
    from jaxprep.config import PrepConfig
    from jaxprep.state import BatchState

    expect(function, "state", state, BatchState, "a jaxprep.BatchState", STATE_HINT)
    expect(function, "config", config, PrepConfig, "a jaxprep.PrepConfig", CONFIG_HINT)


def expect_bucket(function: str, num_tokens_padded, optional: bool = True) -> None:
    """A static Python (or NumPy) integer: the padded token count is part of the compiled shape."""
    allowed = "an int or None" if optional else "an int"
    if (num_tokens_padded is None and optional) or (
            isinstance(num_tokens_padded, numbers.Integral) and not isinstance(num_tokens_padded, bool)):
        return
    raise TypeError(f"{function}: num_tokens_padded must be {allowed} (a bucket of config.token_buckets, "
                    f"e.g. config.bucket_for(total)), got {type_name(num_tokens_padded)}")
