"""Decode context parallelism (docs/semantics.md#dcp): per-rank slot mappings and local sequence lengths."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, DCPConfig, FeatureConfig, InvalidBatchError, KVCacheGroupSpec, PrepConfig, validate
from jaxprep.reference.kv_cache import dcp_local_seq_lens_reference, dcp_slot_mapping_reference
from support.feature_batches import RUN_MODES, batch_rows, block_table, feature_batches, pad, run_step


def dcp_config(world: int, rank: int, interleave: int, **kwargs) -> PrepConfig:
    base = dict(max_num_reqs=1, max_model_len=8, max_num_batched_tokens=8, block_size=2)
    base.update(kwargs)
    return PrepConfig(**base, features=FeatureConfig(dcp=DCPConfig(world, rank, interleave)))


def one_request(seq_len: int) -> dict:
    table = np.zeros((1, 64), np.int32)
    table[0, :2] = [10, 11]
    return dict(token_ids=np.ones((1, 8), np.int32), block_table=table, num_computed_tokens=np.array([0], np.int32),
                num_scheduled_tokens=np.array([seq_len], np.int32))


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("rank, interleave, expected", [
    (0, 1, [20, -1, 21, -1, 22, -1, 23, -1]),
    (1, 1, [-1, 20, -1, 21, -1, 22, -1, 23]),
    (0, 2, [20, 21, -1, -1, 22, 23, -1, -1]),
])
def test_worked_example_slots(mode, rank, interleave, expected):
    """docs/semantics.md#dcp: B=2, W=2, one request at positions 0..7 with blocks [10, 11]."""
    step = run_step(one_request(8), dcp_config(2, rank, interleave), mode)
    assert np.asarray(step.attn_metadata.slot_mapping).tolist() == expected


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("rank, expected", [(0, 4), (1, 3)])
def test_worked_example_local_seq_lens(mode, rank, expected):
    """docs/semantics.md#dcp: seq_len 7 with I=1 -> 4 tokens on rank 0, 3 on rank 1."""
    step = run_step(one_request(7), dcp_config(2, rank, 1), mode)
    assert np.asarray(step.attn_metadata.dcp_local_seq_lens).tolist() == [expected]


LAYOUTS = [(2, 1), (2, 2), (4, 1), (4, 4), (3, 2)]  # (world, interleave)


def random_dcp_batch(data, world: int, rank: int, interleave: int):
    config = PrepConfig(max_num_reqs=5, max_model_len=48, max_num_batched_tokens=32, block_size=4,
                        features=FeatureConfig(dcp=DCPConfig(world, rank, interleave),
                                               kv_groups=(KVCacheGroupSpec(4), KVCacheGroupSpec(8))))
    arrays = data.draw(feature_batches(config))
    seq_lens = arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"]
    seed = data.draw(st.integers(0, 2**20))
    arrays["block_table"] = block_table(5, 16, seq_lens, 4, seed, tokens_per_column=4 * world)
    arrays["extra_block_tables"] = [block_table(5, 16, seq_lens, 8, seed + 1, tokens_per_column=8 * world)]
    return arrays, config


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("world, interleave", LAYOUTS)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_dcp_matches_reference(mode, world, interleave, data):
    rank = data.draw(st.integers(0, world - 1))
    arrays, config = random_dcp_batch(data, world, rank, interleave)
    step = run_step(arrays, config, mode)
    rows = batch_rows(arrays)
    token_rows = np.repeat(rows, arrays["num_scheduled_tokens"][rows])
    positions = np.asarray(step.positions)[: len(token_rows)]
    for table, block_size, got in ((arrays["block_table"], 4, step.attn_metadata.slot_mapping),
                                   (arrays["block_table"], 4, step.kv_groups[0].slot_mapping),
                                   (arrays["extra_block_tables"][0], 8, step.kv_groups[1].slot_mapping)):
        want = dcp_slot_mapping_reference(positions, token_rows, table, block_size, world, rank, interleave)
        np.testing.assert_array_equal(got, pad(want, step.num_tokens_padded, -1))
    seq_lens = (arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"])[rows]
    want = dcp_local_seq_lens_reference(seq_lens, 4, world, rank, interleave)
    np.testing.assert_array_equal(step.attn_metadata.dcp_local_seq_lens, pad(want, step.num_reqs_padded, 0))


@pytest.mark.parametrize("world, interleave", LAYOUTS)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_every_token_is_stored_on_exactly_one_rank(world, interleave, data):
    """Invariants over all ranks: one slot per token, local lengths add up to seq_lens, no slot used twice."""
    arrays, config = random_dcp_batch(data, world, 0, interleave)
    steps = [run_step(arrays, dataclasses.replace(config, features=dataclasses.replace(
        config.features, dcp=DCPConfig(world, rank, interleave))), "jit") for rank in range(world)]
    num_tokens = int(steps[0].attn_metadata.num_actual_tokens)
    slots = np.stack([np.asarray(s.attn_metadata.slot_mapping)[:num_tokens] for s in steps])
    np.testing.assert_array_equal((slots >= 0).sum(axis=0), 1)
    for rank_slots in slots:
        owned = rank_slots[rank_slots >= 0]
        assert len(np.unique(owned)) == len(owned)
    local = sum(np.asarray(s.attn_metadata.dcp_local_seq_lens) for s in steps)
    np.testing.assert_array_equal(local, steps[0].attn_metadata.seq_lens)


def test_bad_dcp_configs_are_rejected():
    with pytest.raises(ValueError, match="DCPConfig.rank=2 is outside the world \\[0, world_size=2\\)"):
        DCPConfig(world_size=2, rank=2)
    with pytest.raises(ValueError, match="DCPConfig.rank=-1 is outside"):
        DCPConfig(world_size=2, rank=-1)
    with pytest.raises(ValueError, match="interleave=4 must divide block size 2"):
        dcp_config(2, 0, 4)
    with pytest.raises(ValueError, match="DCP does not support sliding-window"):
        FeatureConfig(dcp=DCPConfig(2, 0), kv_groups=(KVCacheGroupSpec(2, sliding_window=8),))


def test_dcp_tables_need_only_their_virtual_blocks():
    """With W=2 and B=2 a virtual block spans 4 tokens: 7 tokens use 2 columns, not 4."""
    config = dcp_config(2, 0, 1)
    validate(BatchState.from_numpy(**one_request(7)), config)
    short = one_request(7)
    short["block_table"][0, 1] = 0
    with pytest.raises(InvalidBatchError, match="block_table\\[0, 1\\] is the null block"):
        validate(BatchState.from_numpy(**short), config)
