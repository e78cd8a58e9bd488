"""A wrong argument at a public entry point raises a TypeError naming what was expected and what
was given (it used to be an AttributeError from deep inside). Checked in a fresh process: under the
suite's beartype hook the annotations would answer first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPECTED = {  # case -> (the message starts with, the type it names as given)
    "prepare_inputs(arrays)": ("prepare_inputs: state must be a jaxprep.BatchState, got dict", "from_numpy"),
    "prepare_inputs(config=dict)": ("prepare_inputs: config must be a jaxprep.PrepConfig, got dict", "PrepConfig("),
    "prepare_inputs(bucket=str)": ("prepare_inputs: num_tokens_padded must be an int or None", "got str"),
    "validate(arrays)": ("validate: state must be a jaxprep.BatchState, got dict", ""),
    "warmup(dict)": ("warmup: config must be a jaxprep.PrepConfig, got dict", ""),
    "prepare_to_host(arrays)": ("prepare_to_host: state must be a jaxprep.BatchState, got dict", ""),
    "prepare_data_parallel(mesh=None)": ("prepare_data_parallel: mesh must be a jax.sharding.Mesh, got NoneType",
                                         "data_mesh"),
    "to_torch(state)": ("to_torch: step_inputs must be a jaxprep.StepInputs, got jaxprep.", "BatchState"),
    "to_npu(state)": ("to_npu: step_inputs must be a jaxprep.StepInputs, got jaxprep.", "prepare_inputs"),
    "step_arrays(arrays)": ("step_arrays: step_inputs must be a jaxprep.StepInputs, got dict", ""),
    "from_torch(numpy)": ("from_torch: sampled must be a torch.Tensor, got numpy.ndarray", "torch.from_numpy"),
    "jax_to_torch(torch)": ("jax_to_torch: ids must be a jax.Array, got torch.Tensor", ""),
}


@pytest.fixture(scope="module")
def outcomes() -> dict:
    args = [sys.executable, os.path.join(ROOT, "tests", "support", "entry_point_calls.py")]
    try:
        import torch  # noqa: F401
        args.append("--torch")
    except ImportError:
        pass
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_wrong_argument_is_a_type_error_naming_both_types(outcomes, case):
    if case not in outcomes:
        pytest.skip("torch is not installed")
    kind, message = outcomes[case]
    start, also = EXPECTED[case]
    assert kind == "TypeError", message
    assert message.startswith(start), message
    assert also in message
