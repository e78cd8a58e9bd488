"""The benchmarks' baselines (vLLM V1's host path, MRV2's device path in torch) equal the NumPy reference.

Both must compute exactly what `jaxprep.reference` computes, padding included, or the benchmarks
would compare jaxprep with something else. Expected values come from `jaxprep.reference` (and, for
the worked examples, from the values written in tests/core/test_worked_examples.py).
"""

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep.config import PrepConfig
from jaxprep.reference import pad_reference, prepare_reference
from jaxprep.walkthrough.examples import (
    example_a_config,
    example_a_step1,
    example_a_step2,
    example_b,
    example_b_config,
)
from support.batches import batches, numpy_batches

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))

from vllm_v1_baseline import VllmV1HostPrep

torch = pytest.importorskip("torch")
from mrv2_torch_baseline import Mrv2TorchPrep  # noqa: E402

CONFIGS = {
    "block_size_1": PrepConfig(max_num_reqs=5, max_model_len=33, max_num_batched_tokens=40, block_size=1),
    "block_size_16": PrepConfig(max_num_reqs=16, max_model_len=128, max_num_batched_tokens=300, block_size=16),
    "small_blocks": PrepConfig(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=96, block_size=4),
    "one_request": PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=16, block_size=16),
    "more_rows_than_budget": PrepConfig(max_num_reqs=32, max_model_len=40, max_num_batched_tokens=24,
                                        block_size=8),
}
FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table", "logits_indices",
          "num_actual_tokens", "num_reqs", "max_query_len", "max_seq_len")


def expected(arrays: dict, config: PrepConfig, num_tokens_padded: int) -> dict:
    ref = prepare_reference(block_size=config.block_size, **arrays)
    return pad_reference(ref, num_tokens_padded, config.num_reqs_padded(num_tokens_padded))


def assert_matches(got: dict, want: dict) -> None:
    for name in FIELDS:
        value = got[name]
        value = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        np.testing.assert_array_equal(value, want[name], err_msg=f"field {name}")


def condensed(arrays: dict) -> tuple[dict, np.ndarray]:
    """The rows with work first, in row order (V1's InputBatch holds only scheduled requests, condensed),
    then the rest; and the scheduled counts of the batch rows.

    # scheduled [0, 3, 0, 2] -> rows [1, 3, 0, 2], batch counts [3, 2]
    """
    scheduled = arrays["num_scheduled_tokens"]
    order = np.concatenate([np.flatnonzero(scheduled > 0), np.flatnonzero(scheduled == 0)])
    tables = {name: np.ascontiguousarray(arrays[name][order])
              for name in ("token_ids", "block_table", "num_computed_tokens")}
    return tables, scheduled[scheduled > 0]


class V1Runner:
    """One `VllmV1HostPrep` over tables that every batch is copied into, in place (so its
    persistent buffers carry stale values from earlier, larger steps, as vLLM's do)."""

    def __init__(self, config: PrepConfig, use_torch_gather: bool):
        rows, width = config.max_num_reqs, config.max_blocks_per_req
        self.tables = {"token_ids": np.zeros((rows, config.max_model_len), np.int32),
                       "block_table": np.zeros((rows, width), np.int32),
                       "num_computed_tokens": np.zeros(rows, np.int32)}
        self.prep = VllmV1HostPrep(**self.tables, block_size=config.block_size,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   use_torch_gather=use_torch_gather)
        self.config = config

    def __call__(self, arrays: dict, num_tokens_padded: int) -> dict:
        tables, scheduled = condensed(arrays)
        for name, value in tables.items():
            np.copyto(self.tables[name], value)
        return self.prep.prepare(scheduled, num_tokens_padded, self.config.num_reqs_padded(num_tokens_padded))


class Mrv2Runner:
    """One `Mrv2TorchPrep` whose device state every batch is loaded into (holes stay in place)."""

    def __init__(self, config: PrepConfig):
        rows = config.max_num_reqs
        self.prep = Mrv2TorchPrep(np.zeros((rows, config.max_model_len), np.int32),
                                  np.zeros((rows, config.max_blocks_per_req), np.int32), np.zeros(rows, np.int32),
                                  config.block_size, config.max_num_batched_tokens)
        self.config = config

    def __call__(self, arrays: dict, num_tokens_padded: int) -> dict:
        self.prep.load(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"])
        scheduled = arrays["num_scheduled_tokens"]
        idx_mapping = np.flatnonzero(scheduled > 0).astype(np.int64)
        return self.prep.prepare(idx_mapping, scheduled[idx_mapping], num_tokens_padded,
                                 self.config.num_reqs_padded(num_tokens_padded))


def runners(config: PrepConfig) -> dict:
    return {"v1_torch_gather": V1Runner(config, True), "v1_numpy_gather": V1Runner(config, False),
            "mrv2_torch": Mrv2Runner(config)}


@pytest.mark.parametrize("name", CONFIGS)
def test_baselines_match_reference_fuzz(name):
    """300 seeded batches per config (holes, one request, full budget, sequences ending at
    max_model_len), at their own bucket and at the top bucket, through one object per baseline."""
    config = CONFIGS[name]
    stream = numpy_batches(config, seed=100 + len(name))
    run = runners(config)
    for _ in range(300):
        arrays = next(stream)
        num_tokens = int(arrays["num_scheduled_tokens"].sum())
        for bucket in (config.bucket_for(num_tokens), config.max_num_batched_tokens):
            want = expected(arrays, config, bucket)
            for baseline, prepare in run.items():
                try:
                    assert_matches(prepare(arrays, bucket), want)
                except AssertionError as error:
                    raise AssertionError(f"{baseline}, bucket {bucket}: {error}") from None


@settings(max_examples=60, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(CONFIGS)))
def test_baselines_match_reference_property(data, name):
    config = CONFIGS[name]
    arrays = data.draw(batches(config))
    bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
    want = expected(arrays, config, bucket)
    for prepare in runners(config).values():
        assert_matches(prepare(arrays, bucket), want)


WORKED = {
    "a_step1": (example_a_config, example_a_step1, 10),
    "a_step2_padded_to_8": (example_a_config, example_a_step2, 8),
    "b": (example_b_config, example_b, 200),
}


@pytest.mark.parametrize("example", WORKED)
def test_baselines_match_reference_on_worked_examples(example):
    make_config, make_arrays, bucket = WORKED[example]
    config, arrays = make_config(), make_arrays()
    want = expected(arrays, config, bucket)
    for prepare in runners(config).values():
        assert_matches(prepare(arrays, bucket), want)


def test_baselines_pad_as_the_worked_example():
    """Example A step 2 padded to 8 tokens: positions [3,2,5,6,7,0,0,0], slots [5,14,13,16,17,-1,-1,-1]."""
    config, arrays = example_a_config(), example_a_step2()
    for prepare in runners(config).values():
        got = {k: np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in prepare(arrays, 8).items()}
        np.testing.assert_array_equal(got["positions"], [3, 2, 5, 6, 7, 0, 0, 0])
        np.testing.assert_array_equal(got["slot_mapping"], [5, 14, 13, 16, 17, -1, -1, -1])
        np.testing.assert_array_equal(got["query_start_loc"], [0, 1, 2, 5])
        np.testing.assert_array_equal(got["seq_lens"], [4, 3, 8])


def test_v1_baseline_sees_in_place_table_updates():
    """The tables are adopted, not copied: a scheduler's in-place write shows in the next step."""
    config, arrays = example_a_config(), example_a_step2()
    prep = VllmV1HostPrep(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                          config.block_size, config.max_num_batched_tokens)
    prep.prepare(arrays["num_scheduled_tokens"], 8, 3)
    arrays["token_ids"][0, 3] = 999
    arrays["block_table"][0, 1] = 11
    step = prep.prepare(arrays["num_scheduled_tokens"], 8, 3)
    want = expected(arrays, config, 8)
    assert step["input_ids"][0] == 999 == want["input_ids"][0]
    assert step["slot_mapping"][0] == want["slot_mapping"][0] == 11 * 2 + 1


def test_v1_with_copies_lands_the_reference_on_the_device():
    """The GPU benchmarks' V1 path (`vllm_v1_copies.VllmV1WithCopies`, here with CPU tensors as the device
    twins): every field as copied to the device equals the reference, the null block on the padded rows
    included. Control: the host step's block table is V1's staging buffer, never filled on this path
    (vLLM copies ``block_table.cpu`` rows to the device directly), so it does not."""
    from vllm_v1_copies import VllmV1WithCopies

    config = CONFIGS["small_blocks"]
    arrays = next(numpy_batches(config, seed=7))
    tables, scheduled = condensed(arrays)
    bucket = config.bucket_for(int(scheduled.sum()))
    want = expected(arrays, config, bucket)
    v1 = VllmV1WithCopies(config, tables, torch.device("cpu"))
    step = v1.prepare_on_device(scheduled, bucket, config.num_reqs_padded(bucket))
    assert_matches(v1.landed(step), want)
    assert want["block_table"].any() and not step["block_table"].any()
