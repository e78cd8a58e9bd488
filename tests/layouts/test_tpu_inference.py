"""`jaxprep.layouts.tpu_inference` against tpu-inference 0.32.0's runner and RPA v3 kernel reference, as
transcribed in `tests/support/tpu_inference_runner.py` (its source files and functions are cited there):
worked examples written out by hand, random steps field for field (order and padding included), the
ladders, the v3 cache, and attention through the kernel's reference against jaxprep's attention oracle.
Each cross-check has a negative control: a stable decode-first order, a cache with K and V not
interleaved, jaxprep's own ladder.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep.bounds import OVER_BUCKET
from jaxprep.features.config import FeatureConfig
from jaxprep.layouts import tpu_inference as tpu
from support.tpu_inference_layouts import (
    FIELDS,
    SMALL,
    WIDE,
    attention_case,
    fixed_state,
    layout,
    random_state,
    runner_for,
)
from support.tpu_inference_runner import (
    TpuRunner,
    build_token_paddings,
    get_padded_token_len,
    get_req_paddings,
    merge_kv,
    ref_ragged_paged_attention,
)


def differing(ours, theirs: dict) -> list[str]:
    """The fields where the layout and the runner differ (shape, dtype or value)."""
    bad = [name for name in FIELDS if np.asarray(getattr(ours, name)).dtype != np.int32
           or not np.array_equal(np.asarray(getattr(ours, name)), theirs[name])]
    if ours.padded_num_reqs != theirs["padded_num_reqs"]:
        bad.append("padded_num_reqs")
    n = len(theirs["req_ids"])
    if list(np.asarray(ours.idx_mapping)[:n]) != theirs["req_ids"] or (np.asarray(ours.idx_mapping)[n:] != -1).any():
        bad.append("idx_mapping")
    return bad


def test_two_pointer_order_worked_examples():
    """tpu-inference's swap is not stable: [P0, D1, P2, D3] becomes [D3, D1, P2, P0] (a stable
    partition gives [D1, D3, P0, P2]); its own `_reorder_batch` (transcribed) agrees on each."""
    cases = {"PDPD": [3, 1, 2, 0], "DPPDD": [0, 4, 3, 2, 1], "DDD": [0, 1, 2], "PPP": [0, 1, 2], "P": [0],
             "PD": [1, 0], "DP": [0, 1], "PPDPD": [4, 2, 1, 3, 0]}
    two_pointer_order = jax.jit(tpu.two_pointer_order)
    for kinds, expected in cases.items():
        padded = kinds + "P" * (8 - len(kinds))  # padding rows (past num_reqs) stay where they are
        order = two_pointer_order(jnp.asarray([k == "D" for k in padded]), jnp.int32(len(kinds)))
        assert np.asarray(order).tolist() == expected + list(range(len(kinds), 8)), kinds
        runner = TpuRunner(8, 8, 64, 2, req_ids=[])
        for i in range(len(kinds)):
            runner.add_request(i, [0], 0, [])
        runner.reorder_batch({i: 1 if k == "D" else 2 for i, k in enumerate(kinds)}, 0)
        assert runner.req_ids == expected, kinds


WORKED = dict(  # example 'P0 D1 P2 D3': block size 2, max_model_len 8; token (r, p) is 10 * (r + 1) + p
    token_ids=np.array([[10 * (r + 1) + p for p in range(8)] for r in range(4)], np.int32),
    block_table=np.pad(np.array([[1, 2, 0, 0], [3, 4, 5, 0], [6, 7, 0, 0], [8, 9, 10, 0]], np.int32),
                       ((0, 0), (0, 60))),
    num_computed_tokens=np.array([0, 4, 2, 5], np.int32),
    num_scheduled_tokens=np.array([3, 1, 2, 1], np.int32))


def test_worked_example():
    """Batch [P0 (3 tokens), D1, P2 (2 tokens), D3] -> tpu-inference's order [D3, D1, P2, P0]; 8 attention
    rows (MIN_NUM_SEQS), 4 pages a row, 16 tokens, 8 logits rows. The values are written out by hand."""
    config = PrepConfig(max_num_reqs=4, max_model_len=8, max_num_batched_tokens=16, block_size=2)
    expected = dict(
        input_ids=[45, 24, 32, 33, 10, 11, 12] + [0] * 9,
        positions=[5, 4, 2, 3, 0, 1, 2] + [0] * 9,
        query_start_loc=[0, 1, 2, 4, 7, 7, 7, 7, 7],
        seq_lens=[6, 5, 4, 3, 0, 0, 0, 0],
        block_tables=[8, 9, 10, 0, 3, 4, 5, 0, 6, 7, 0, 0, 1, 2, 0, 0] + [0] * 16,
        request_distribution=[2, 2, 4],
        logits_indices=[0, 1, 3, 6, -1, -1, -1, -1],
        padded_num_reqs=4, req_ids=[3, 1, 2, 0])
    _, ours = layout(config, WORKED)
    theirs = TpuRunner.step(*runner_for(config, WORKED))
    for name in FIELDS:
        assert np.asarray(getattr(ours, name)).tolist() == expected[name] == theirs[name].tolist(), name
    assert np.asarray(ours.idx_mapping).tolist() == [3, 1, 2, 0, -1, -1, -1, -1] and theirs["req_ids"] == [3, 1, 2, 0]
    assert ours.padded_num_reqs == theirs["padded_num_reqs"] == 4 and int(ours.errors) == 0


@pytest.mark.parametrize("config", [SMALL, WIDE], ids=["6-rows", "12-rows"])
def test_random_steps_match_the_runner(config):
    """40 random steps each: every field of the layout equals the runner's, order and padding included.
    Negative control: the same runner with a stable decode-first order instead of its swap differs
    wherever the two orders do (and such steps occur)."""
    rng = np.random.default_rng(config.max_num_reqs)
    unstable = 0
    for _ in range(40):
        arrays = random_state(config, rng)
        _, ours = layout(config, arrays, bucket=config.token_buckets[-1])  # one jaxprep shape: fewer compiles
        runner, scheduled = runner_for(config, arrays)
        stable = sorted(runner.req_ids, key=lambda r: scheduled[r] > 1)
        theirs = runner.step(scheduled)
        assert differing(ours, theirs) == [], (differing(ours, theirs), arrays["num_scheduled_tokens"])
        if stable != theirs["req_ids"]:
            unstable += 1
            control, _ = runner_for(config, arrays, rows=stable)  # decodes already first: nothing to swap
            assert {"input_ids", "idx_mapping"} <= set(differing(ours, control.step(scheduled)))
    assert unstable >= 5, unstable


def test_ladders_match_the_runner():
    """`tpu_inference_sizes` picks tpu-inference's rungs for every budget, row count and total tried.
    Negative control: jaxprep's own token ladder is another one (8 and 1.5x rungs)."""
    for budget in range(1, 300):
        theirs = build_token_paddings(16, budget, 0)
        assert list(tpu.token_paddings(budget)) == theirs, budget
    for rows in range(1, 70):
        config = PrepConfig(max_num_reqs=rows, max_model_len=16, max_num_batched_tokens=200, block_size=4)
        assert list(tpu.request_paddings(config)) == get_req_paddings(8, max(rows, 8)), rows
        for num_reqs in range(1, rows + 1):
            total = 3 * num_reqs
            assert tpu.tpu_inference_sizes(config, total, num_reqs) == (
                get_padded_token_len(build_token_paddings(16, 200, 0), total),
                get_padded_token_len(get_req_paddings(8, max(rows, 8)), num_reqs))
    assert list(PrepConfig(max_num_reqs=4, max_model_len=16, max_num_batched_tokens=200,
                           block_size=4).token_buckets) != build_token_paddings(16, 200, 0)
    with pytest.raises(ValueError, match="num_scheduled_tokens=0"):
        tpu.tpu_inference_sizes(SMALL, 0, 1)


def test_stale_positions_are_zero_here():
    """A runner reused for a shorter step keeps the last step's positions in its padded tail (a stale
    host buffer, DIVERGENCES.md); the layout pads with 0, as a fresh runner does."""
    config = SMALL
    long_step = fixed_state(config, [10, 0, 0, 0, 0, 0], [20, 0, 0, 0, 0, 0])
    runner, scheduled = runner_for(config, long_step)
    runner.step(scheduled)
    short = dict(long_step, num_scheduled_tokens=np.array([2, 0, 0, 0, 0, 0], np.int32))
    theirs = runner.step({0: 2})
    _, ours = layout(config, short)
    assert differing(ours, theirs) == ["positions"]
    assert np.asarray(ours.positions)[:2].tolist() == theirs["positions"][:2].tolist() == [10, 11]
    assert (np.asarray(ours.positions)[2:] == 0).all() and (theirs["positions"][2:16] != 0).any()


def test_bad_sizes_and_features():
    """A step its sizes cannot hold sets OVER_BUCKET and comes out empty (every index in bounds);
    features that change the step's fields, and rungs past tpu-inference's, are refused when tracing."""
    arrays = fixed_state(SMALL, [0, 5, 0, 0, 0, 0], [20, 1, 0, 0, 0, 0])
    total = 21
    _, fits = layout(SMALL, arrays)
    assert int(fits.errors) == 0  # control
    _, over = layout(SMALL, arrays, sizes=(16, 8))
    assert int(over.errors) & OVER_BUCKET
    assert (np.asarray(over.input_ids) == 0).all() and (np.asarray(over.logits_indices) == -1).all()
    assert np.asarray(over.request_distribution).tolist() == [0, 0, 0] and (np.asarray(over.block_tables) == 0).all()
    step = prepare_padded(BatchState.from_numpy(**arrays), SMALL, SMALL.bucket_for(total))
    ordered = dataclasses.replace(SMALL, features=FeatureConfig(reorder="decode_first"))
    with pytest.raises(ValueError, match="FeatureConfig.batch_order='decode_first' must be None"):
        tpu.tpu_inference_layout(step, ordered, 64, 8)
    with pytest.raises(ValueError, match=r"num_reqs_padded=9 in \[1, 8\]"):
        tpu.tpu_inference_layout(step, SMALL, 64, 9)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_v3_cache_layout(dtype):
    """`to_rpa_v3_cache` = the kernel's own packing of a token's K and V (``merge_kv``) at each slot, in
    its ``get_kv_cache_shape``: float32 (one value a word) and bfloat16 (two), 3 KV heads, head dim 40 (to 128)."""
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((6 * 4, 3, 40)), dtype) for _ in range(2))
    ours = np.asarray(tpu.to_rpa_v3_cache(k, v, 4))
    assert ours.shape == tpu.rpa_v3_cache_shape(6, 4, 3, 40, dtype)
    expected = merge_kv(np.asarray(k), np.asarray(v)).reshape(ours.shape)
    assert ours.dtype == expected.dtype and np.array_equal(ours, expected)
    assert ours.shape == ((6, 4, 6, 1, 128) if dtype == jnp.float32 else (6, 4, 3, 2, 128))


def test_attention_through_the_v3_reference():
    """The layout and the v3 cache fed to the kernel's reference (which writes each token's K and V
    into the cache itself) give every token the attention jaxprep's oracle gives it on jaxprep's step,
    and leave the cache jaxprep's slot mapping writes. Negative control: K and V not interleaved by head."""
    for seed in range(4):
        case = attention_case(seed)
        np.testing.assert_allclose(case.reference_out, case.oracle_out, rtol=1e-5, atol=1e-5)
        written = tpu.to_rpa_v3_cache(*map(jnp.asarray, case.written), SMALL.block_size)
        assert np.array_equal(case.reference_cache, np.asarray(written))
        slots, kv_heads, head_dim = case.cache[0].shape
        unpaired = np.concatenate(case.cache, axis=1).reshape(-1, SMALL.block_size, 2 * kv_heads, 1, head_dim)
        unpaired = np.pad(unpaired, ((0, 0),) * 4 + ((0, 128 - head_dim),))  # heads [k0, k1, v0, v1]
        wrong, _ = ref_ragged_paged_attention(*case.qkv, unpaired, *case.kernel_inputs, sm_scale=case.sm_scale)
        assert not np.allclose(wrong, case.reference_out, atol=1e-3)
