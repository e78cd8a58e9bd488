"""Compares a prepared step with the NumPy reference, field by field, padding included."""

from __future__ import annotations

import numpy as np

from jaxprep.metadata import step_fields
from jaxprep.reference import pad_reference, prepare_reference


def reference_step(arrays: dict, config, num_tokens_padded: int) -> dict:
    ref = prepare_reference(block_size=config.block_size, **arrays)
    return pad_reference(ref, num_tokens_padded, config.num_reqs_padded(num_tokens_padded))


def assert_step_matches_reference(step, arrays: dict, config) -> None:
    expected = reference_step(arrays, config, step.num_tokens_padded)
    actual = step_fields(step)
    for name, want in expected.items():
        got = np.asarray(actual[name])
        assert got.dtype == np.int32, f"{name} has dtype {got.dtype}"
        np.testing.assert_array_equal(got, want, err_msg=f"field {name}")
