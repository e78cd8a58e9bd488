"""torch_bridge carries `StepInputs.sampling`: every row parameter and flag, in vLLM's dtypes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_bridge  # noqa: E402
from support.feature_batches import run_step  # noqa: E402
from support.sampling_examples import example_arrays, example_config  # noqa: E402

FLOAT32 = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
INT64 = ("idx_mapping", "pos")  # int64 in vLLM's sampler, like V2's expanded_idx_mapping and positions


@pytest.mark.parametrize("strategy", ["packed", "per_field"])
def test_sampling_fields_match_the_step(strategy):
    step = run_step(example_arrays(), example_config(), "jit")
    inputs = torch_bridge.to_torch(step, strategy=strategy)
    for field in dataclasses.fields(step.sampling):
        got, want = getattr(inputs.sampling, field.name), np.asarray(getattr(step.sampling, field.name))
        if want.dtype == np.bool_:
            dtype = torch.bool
        else:
            dtype = torch.float32 if field.name in FLOAT32 else torch.int64 if field.name in INT64 else torch.int32
        assert got.dtype == dtype, field.name
        np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=field.name)
