"""Several KV-cache groups (docs/semantics.md#kv-groups, #sliding-window): per-group slot mappings, kernel block tables,
sliding windows."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, InvalidBatchError, KVCacheGroupSpec, PrepConfig, validate
from jaxprep.config import block_table_width
from jaxprep.reference import prepare_reference
from jaxprep.reference.kv_cache import kernel_block_table_reference, sliding_window_reference
from jaxprep.walkthrough.examples import example_a_config, example_a_step2
from support.feature_batches import RUN_MODES, batch_rows, block_table, feature_batches, pad, run_step

GROUPS = (KVCacheGroupSpec(block_size=4),
          KVCacheGroupSpec(block_size=8, kernel_block_size=2),
          KVCacheGroupSpec(block_size=2, sliding_window=5))
CONFIG = PrepConfig(max_num_reqs=6, max_model_len=48, max_num_batched_tokens=40, block_size=4,
                    features=FeatureConfig(kv_groups=GROUPS))


def with_extra_tables(arrays: dict, config, seed: int) -> dict:
    seq_lens = arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"]
    tables = [block_table(config.max_num_reqs, block_table_width(config.max_model_len, g.block_size), seq_lens,
                          g.block_size, seed + i) for i, g in enumerate(config.features.kv_groups[1:])]
    return dict(arrays, extra_block_tables=tables)


@pytest.mark.parametrize("mode", RUN_MODES)
def test_kernel_block_size_worked_example(mode):
    """docs/semantics.md#kv-groups: B=32, b=16, row [3, 7] -> [6, 7, 14, 15]; position 40 has slot 232 either way."""
    config = PrepConfig(max_num_reqs=1, max_model_len=64, max_num_batched_tokens=64, block_size=32,
                        features=FeatureConfig(kv_groups=(KVCacheGroupSpec(block_size=32, kernel_block_size=16),)))
    table = np.zeros((1, 4), np.int32)
    table[0, :2] = [3, 7]
    arrays = dict(token_ids=np.ones((1, 64), np.int32), block_table=table,
                  num_computed_tokens=np.array([40], np.int32), num_scheduled_tokens=np.array([1], np.int32))
    group = run_step(arrays, config, mode).kv_groups[0]
    assert (group.block_size, group.kernel_block_size) == (32, 16)
    assert np.asarray(group.block_table)[0, :4].tolist() == [6, 7, 14, 15]
    assert int(group.slot_mapping[0]) == 232 == int(group.block_table[0, 40 // 16]) * 16 + 40 % 16


@pytest.mark.parametrize("mode", RUN_MODES)
def test_sliding_window_worked_example(mode):
    """docs/semantics.md#sliding-window: window 4, B=2, C=9 -> columns 0..2 of the kernel's table are null; slots
    unchanged."""
    config = PrepConfig(max_num_reqs=1, max_model_len=16, max_num_batched_tokens=8, block_size=2,
                        features=FeatureConfig(kv_groups=(KVCacheGroupSpec(block_size=2, sliding_window=4),)))
    table = np.zeros((1, 64), np.int32)
    table[0, :6] = [11, 12, 13, 14, 15, 16]
    arrays = dict(token_ids=np.ones((1, 16), np.int32), block_table=table,
                  num_computed_tokens=np.array([9], np.int32), num_scheduled_tokens=np.array([2], np.int32))
    step = run_step(arrays, config, mode)
    group = step.kv_groups[0]
    assert np.asarray(group.block_table)[0, :6].tolist() == [0, 0, 0, 14, 15, 16]
    assert np.asarray(group.slot_mapping)[:2].tolist() == [15 * 2 + 1, 16 * 2]  # positions 9, 10
    np.testing.assert_array_equal(group.slot_mapping, step.attn_metadata.slot_mapping)


@pytest.mark.parametrize("mode", RUN_MODES)
def test_group_zero_of_example_a_is_the_core_step(mode):
    config = dataclasses.replace(example_a_config(), features=FeatureConfig(kv_groups=(KVCacheGroupSpec(2),)))
    step = run_step(example_a_step2(), config, mode)
    np.testing.assert_array_equal(step.kv_groups[0].slot_mapping, step.attn_metadata.slot_mapping)
    np.testing.assert_array_equal(step.kv_groups[0].block_table, step.attn_metadata.block_table)


def expected_group(arrays: dict, table, spec: KVCacheGroupSpec, step) -> dict:
    rows = batch_rows(arrays)
    core = prepare_reference(arrays["token_ids"], table, arrays["num_computed_tokens"],
                             arrays["num_scheduled_tokens"], spec.block_size)
    gathered = np.asarray(table)[rows]
    if spec.sliding_window:
        gathered = sliding_window_reference(gathered, arrays["num_computed_tokens"][rows], spec.sliding_window,
                                            spec.block_size)
    kernel = kernel_block_table_reference(gathered, spec.blocks_per_kernel_block)
    return {"slot_mapping": pad(core["slot_mapping"], step.num_tokens_padded, -1),
            "block_table": pad(kernel, step.num_reqs_padded, 0)}


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_kv_groups_match_reference(mode, data):
    arrays = with_extra_tables(data.draw(feature_batches(CONFIG)), CONFIG, data.draw(st.integers(0, 2**20)))
    step = run_step(arrays, CONFIG, mode)
    tables = [arrays["block_table"], *arrays["extra_block_tables"]]
    assert len(step.kv_groups) == len(GROUPS)
    for g, (spec, table, group) in enumerate(zip(GROUPS, tables, step.kv_groups)):
        for name, want in expected_group(arrays, table, spec, step).items():
            got = np.asarray(getattr(group, name))
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, want, err_msg=f"group {g} {name}")


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_kernel_table_gives_the_manager_slot(data):
    """Invariant: blk * B + off == (blk * k + off // b) * b + off % b for every scheduled token."""
    arrays = with_extra_tables(data.draw(feature_batches(CONFIG)), CONFIG, data.draw(st.integers(0, 2**20)))
    step = run_step(arrays, CONFIG, "jit")
    group = step.kv_groups[1]
    num_tokens = int(step.attn_metadata.num_actual_tokens)
    qsl = np.asarray(step.attn_metadata.query_start_loc)
    token_req = np.searchsorted(qsl[1:], np.arange(num_tokens), side="right")
    positions = np.asarray(step.positions)[:num_tokens]
    kernel_blocks = np.asarray(group.block_table)[token_req, positions // group.kernel_block_size]
    kernel_slots = kernel_blocks * group.kernel_block_size + positions % group.kernel_block_size
    np.testing.assert_array_equal(kernel_slots, np.asarray(group.slot_mapping)[:num_tokens])


def two_group_batch(**overrides) -> dict:
    config = CONFIG
    arrays = dict(token_ids=np.ones((6, 48), np.int32), block_table=np.ones((6, 12), np.int32),
                  num_computed_tokens=np.zeros(6, np.int32),
                  num_scheduled_tokens=np.array([9, 0, 0, 0, 0, 0], np.int32),
                  extra_block_tables=[np.ones((6, block_table_width(48, g.block_size)), np.int32)
                                      for g in config.features.kv_groups[1:]])
    arrays.update(overrides)
    return arrays


def test_bad_group_tables_are_rejected():
    validate(BatchState.from_numpy(**two_group_batch()), CONFIG)
    cases = {
        "extra_block_tables is missing": dict(extra_block_tables=None),
        "has 1 tables, FeatureConfig.kv_groups needs 2": dict(extra_block_tables=[np.ones((6, 16), np.int32)]),
        "extra_block_tables\\[1\\] \\(group 2\\) has shape \\(6, 8\\)": dict(
            extra_block_tables=[np.ones((6, 16), np.int32), np.ones((6, 8), np.int32)]),
    }
    for message, overrides in cases.items():
        with pytest.raises(InvalidBatchError, match=message):
            validate(BatchState.from_numpy(**two_group_batch(**overrides)), CONFIG)
    null_in_group_2 = two_group_batch()
    null_in_group_2["extra_block_tables"][1][0, 4] = 0  # B=2: position 8 of row 0 is in column 4
    with pytest.raises(InvalidBatchError, match="extra_block_tables\\[1\\]\\[0, 4\\] is the null block"):
        validate(BatchState.from_numpy(**null_in_group_2), CONFIG)


def test_group_block_ids_are_bounded_by_the_groups_pool():
    groups = (GROUPS[0], KVCacheGroupSpec(8, num_blocks=5))
    config = dataclasses.replace(CONFIG, features=FeatureConfig(kv_groups=groups))
    arrays = two_group_batch(extra_block_tables=[np.full((6, 16), 5, np.int32)])
    with pytest.raises(InvalidBatchError, match="extra_block_tables\\[0\\]\\[0, 0\\] = 5 is outside .*max_block_id=4"):
        validate(BatchState.from_numpy(**arrays), config)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_groups=(KVCacheGroupSpec(block_size=8),)),
     "kv_groups\\[0\\].block_size=8 must equal PrepConfig.block_size=4"),
])
def test_bad_group_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, features=FeatureConfig(**kwargs))
    with pytest.raises(ValueError, match="kernel_block_size=3 must divide block_size=8"):
        KVCacheGroupSpec(block_size=8, kernel_block_size=3)
