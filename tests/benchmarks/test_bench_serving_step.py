"""benchmarks/bench_serving_step.py's output check runs, at the smallest shapes, and can fail.

The benchmark replays `--steps` updates (counters, one block write and one sampled token per row)
through jaxprep's fused update + prepare and through vLLM V1's host path, and checks every step equal
before it times anything. Here its replayed steps also equal `jaxprep.reference` (the tests' oracle).
Negative controls: make_batch's own table, whose rows advance past their allocated blocks (the
benchmark's former input: jaxprep gives those tokens PAD_SLOT_ID where V1's formula writes into the
null block), is refused by the check's validation; a sampled token only the baseline sees is caught.
"""

from __future__ import annotations

import importlib
import os
import sys
from unittest import mock

import numpy as np
import pytest

from jaxprep import BatchState
from jaxprep.reference import pad_reference, prepare_reference
from jaxprep.validate import InvalidBatchError

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks")

SHAPES = {  # make_batch's arguments, a mixed step and a decode step
    "mixed": dict(num_reqs=4, num_tokens=32, max_model_len=64, block_size=4, decode_only=False),
    "decode": dict(num_reqs=4, num_tokens=4, max_model_len=16, block_size=4, decode_only=True),
}
STEPS = 8  # enough for rows to cross blocks and restart as new requests at both shapes


@pytest.fixture(scope="module")
def bench():
    """The benchmark module, imported as under --default-runtime: its import would otherwise set this
    process's JAX runtime (PJRT_NPROC, synchronous dispatch) for every later test."""
    sys.path.insert(0, BENCHMARKS)
    try:
        with mock.patch.object(sys, "argv", ["bench_serving_step.py", "--default-runtime"]):
            return importlib.import_module("bench_serving_step")
    finally:
        sys.path.remove(BENCHMARKS)


def batch(bench, shape: str):
    config, arrays = bench.make_batch(**SHAPES[shape])
    return config, arrays, config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_replayed_steps_equal_the_baseline_and_the_reference(bench, shape):
    config, arrays, bucket = batch(bench, shape)
    start, updates = bench.replayed_steps(config, arrays, STEPS)
    restarts = sum(int((u["num_computed_tokens"] == 0).sum()) for u in updates)
    assert restarts > 0, "the steps should restart some rows as new requests"
    bench.check_against_baseline(config, start, updates, bucket)  # validates and checks against V1 each step

    state = BatchState.from_numpy(**start)
    tables = {name: value.copy() for name, value in start.items()}
    for update in updates:
        bench.apply_update_numpy(tables, update)
        state, ours = bench.run_update(state, update, config, bucket)
        ref = prepare_reference(block_size=config.block_size, **tables)
        bench.assert_same_step(ours, pad_reference(ref, bucket, config.num_reqs_padded(bucket)))


def test_negative_control_rows_past_their_allocated_blocks_are_refused(bench):
    """make_batch allocates a row's blocks up to its first step's end only: replayed as they are, the
    updates schedule tokens in the null block (the benchmark's former input), which the check refuses
    by name before comparing (the slot mapping would differ: PAD_SLOT_ID against V1's block-0 slot)."""
    config, arrays, bucket = batch(bench, "mixed")
    updates = [bench.with_block_values(u, arrays["block_table"]) for u in bench.make_updates(config, arrays, STEPS)]
    with pytest.raises(InvalidBatchError, match="null block"):
        bench.check_against_baseline(config, arrays, updates, bucket)


def test_negative_control_a_token_only_the_baseline_sees_is_caught(bench, monkeypatch):
    """The baseline's tables get each update's sampled tokens plus one: the next step reads them as
    input ids, and the check fails there."""
    config, arrays, bucket = batch(bench, "mixed")
    start, updates = bench.replayed_steps(config, arrays, STEPS)
    apply = bench.apply_update_numpy

    def apply_changed(tables, update):
        apply(tables, dict(update, token_values=update["token_values"] + np.int32(1)))

    monkeypatch.setattr(bench, "apply_update_numpy", apply_changed)
    with pytest.raises(AssertionError, match="input_ids"):
        bench.check_against_baseline(config, start, updates, bucket)
