"""Calls every public entry point with a wrong argument and prints, as one JSON object, what each
raised: {case: [exception type, message]}. Run as a script by `test_entry_point_types.py`, in a
process without the test suite's jaxtyping/beartype import hook (which would answer first)."""

from __future__ import annotations

import json
import sys

import numpy as np

import jaxprep
from jaxprep.prepare import prepare_to_host
from jaxprep.sharding import data_mesh, prepare_data_parallel

ARRAYS = dict(token_ids=np.arange(36, dtype=np.int32).reshape(3, 12),
              block_table=np.pad(np.array([[1, 2], [3, 0], [4, 5]], np.int32), ((0, 0), (0, 62))),
              num_computed_tokens=np.zeros(3, np.int32), num_scheduled_tokens=np.array([3, 2, 4], np.int32))
CONFIG = jaxprep.PrepConfig(max_num_reqs=3, max_model_len=12, max_num_batched_tokens=10, block_size=2)
STATE = jaxprep.BatchState.from_numpy(**ARRAYS)


def cases() -> dict:
    calls = {
        "prepare_inputs(arrays)": lambda: jaxprep.prepare_inputs(ARRAYS, CONFIG),
        "prepare_inputs(config=dict)": lambda: jaxprep.prepare_inputs(STATE, {"max_num_reqs": 3}),
        "prepare_inputs(bucket=str)": lambda: jaxprep.prepare_inputs(STATE, CONFIG, "10"),
        "validate(arrays)": lambda: jaxprep.validate(ARRAYS, CONFIG),
        "warmup(dict)": lambda: jaxprep.warmup({"max_num_reqs": 3}),
        "prepare_to_host(arrays)": lambda: prepare_to_host(ARRAYS, CONFIG, 10),
        "prepare_data_parallel(mesh=None)": lambda: prepare_data_parallel(STATE, CONFIG, None),
    }
    if "--torch" in sys.argv:
        import torch

        import torch_bridge

        calls.update({
            "to_torch(state)": lambda: torch_bridge.to_torch(STATE),
            "to_npu(state)": lambda: torch_bridge.to_npu(STATE),
            "step_arrays(arrays)": lambda: torch_bridge.step_arrays(ARRAYS),
            "from_torch(numpy)": lambda: torch_bridge.from_torch(np.arange(3, dtype=np.int32), name="sampled"),
            "jax_to_torch(torch)": lambda: torch_bridge.jax_to_torch(torch.zeros(3), name="ids"),
        })
    return calls


def main() -> None:
    data_mesh(1)  # the mesh case needs a working mesh type
    results = {}
    for name, call in cases().items():
        try:
            call()
            results[name] = [None, ""]
        except Exception as error:
            results[name] = [type(error).__name__, str(error)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
