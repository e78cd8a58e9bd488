"""Serving-state transitions: jitted, donated updates checked against the NumPy reference, and bad
updates rejected on the host with the state left as it was."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from jaxprep import PrepConfig, count_compiles
from jaxprep.config import cdiv
from jaxprep.serving import (
    AddRequests,
    AppendBlocks,
    FinishRequests,
    InvalidUpdateError,
    Schedule,
    ServingBatch,
    ServingConfig,
    StepUpdates,
    payload_buckets,
)
from jaxprep.serving import reference as ref

CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=16, max_num_batched_tokens=16, block_size=4,
                                       num_blocks=20, max_blocks_per_req=5),
                       num_speculative_tokens=2)
PREP = CONFIG.prep
MAX_ADDS, MAX_APPENDS = 2, 6
"""The random updates' own sizes: up to 2 requests added and 6 blocks appended per step."""


def reference_empty():
    return ref.empty_state(PREP.max_num_reqs, PREP.max_model_len, PREP.max_blocks_per_req)


def assert_matches_reference(batch: ServingBatch, expected: dict) -> None:
    got = batch.state.to_numpy()
    expected = {name: value for name, value in expected.items() if not name.startswith("_")}
    assert set(expected) <= set(got)  # BatchState may grow fields the serving reference does not model
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    for name in ("num_tokens", "stop_len", "num_computed_tokens"):
        np.testing.assert_array_equal(getattr(batch.rows, name), expected[name], err_msg=f"host mirror {name}")
    np.testing.assert_array_equal(batch.rows.num_blocks, expected["num_blocks"], err_msg="host mirror num_blocks")


def random_add(rng, free_rows):
    requests = []
    for row in rng.permutation(free_rows)[: rng.integers(1, MAX_ADDS + 1)]:
        num_tokens = int(rng.integers(1, PREP.max_model_len))
        computed = int(rng.integers(0, num_tokens))
        num_blocks = int(rng.integers(cdiv(computed, PREP.block_size), PREP.max_blocks_per_req + 1))
        requests.append(dict(row=int(row), token_ids=rng.integers(2, 100, num_tokens),
                             stop_len=int(rng.integers(num_tokens, PREP.max_model_len + 1)),
                             block_ids=rng.integers(1, PREP.num_blocks, num_blocks), num_computed_tokens=computed))
    return AddRequests.build(CONFIG, requests)


def random_append(rng, rows):
    appends, total = {}, 0
    for row in np.flatnonzero(rows.busy):
        room = min(PREP.max_blocks_per_req - int(rows.num_blocks[row]), MAX_APPENDS - total)
        count = int(rng.integers(0, room + 1))
        if count:
            appends[int(row)] = rng.integers(1, PREP.num_blocks, count).tolist()
            total += count
    return AppendBlocks.build(CONFIG, appends)


def random_schedule(rng, rows):
    """Largest valid counts, randomly cut; a decoding row sometimes schedules drafts."""
    scheduled, drafts = np.zeros(PREP.max_num_reqs, np.int64), np.zeros(PREP.max_num_reqs, np.int64)
    budget = PREP.max_num_batched_tokens
    for row in rng.permutation(np.flatnonzero(rows.busy)):
        computed, num_tokens = int(rows.num_computed_tokens[row]), int(rows.num_tokens[row])
        room = min(rows.num_blocks[row] * PREP.block_size, PREP.max_model_len) - computed
        if computed == num_tokens - 1 and rng.random() < 0.5:
            d = int(rng.integers(1, CONFIG.num_speculative_tokens + 1))
            if d + 1 <= min(room, budget) and num_tokens + d + 1 <= PREP.max_model_len:
                scheduled[row], drafts[row], budget = d + 1, d, budget - d - 1
            continue
        top = min(num_tokens - computed, room, budget)
        if num_tokens >= PREP.max_model_len:
            top = min(top, num_tokens - computed - 1)  # a sampling step would pass max_model_len
        if top > 0:
            scheduled[row] = int(rng.integers(1, top + 1))
            budget -= scheduled[row]
    return Schedule.build(CONFIG, scheduled, drafts, rng.integers(2, 100, (PREP.max_num_reqs, 2)))


def random_record(rng, rows):
    order = rng.permutation(np.flatnonzero(rows.num_scheduled_tokens > 0))
    idx_mapping = np.full(PREP.max_num_reqs, -1, np.int32)
    idx_mapping[: len(order)] = order
    drafts = np.where(idx_mapping >= 0, rows.num_draft_tokens[np.maximum(idx_mapping, 0)], 0)
    num_sampled = np.array([rng.integers(1, d + 2) for d in drafts], np.int32)
    return idx_mapping, rng.integers(2, 100, (PREP.max_num_reqs, 3)).astype(np.int32), num_sampled


@pytest.mark.parametrize("seed", range(4))
def test_random_transitions_match_reference(seed):
    rng = np.random.default_rng(seed)
    batch, expected = ServingBatch(CONFIG), reference_empty()
    for _ in range(60):
        rows = batch.rows
        busy = np.flatnonzero(rows.busy)
        op = rng.choice(["finish", "add", "append", "step"])
        if op == "finish" and len(busy):
            finish = rng.permutation(busy)[: rng.integers(1, len(busy) + 1)]
            batch.finish_requests(FinishRequests.build(CONFIG, finish))
            expected = ref.finish(expected, finish)
        elif op == "add" and len(busy) < PREP.max_num_reqs:
            payload = random_add(rng, np.flatnonzero(~rows.busy))
            batch.add_requests(payload)
            expected = ref.add(expected, payload)
        elif op == "append":
            payload = random_append(rng, rows)
            batch.append_block_ids(payload)
            expected = ref.append(expected, payload)
        elif op == "step":
            payload = random_schedule(rng, rows)
            batch.schedule(payload)
            expected = ref.schedule(expected, payload)
            assert_matches_reference(batch, expected)
            record = random_record(rng, batch.rows)
            batch.record_sampled(*record)
            expected = ref.record_sampled(expected, *record)
        assert_matches_reference(batch, expected)


def test_fused_updates_match_reference():
    """finish, add, append and schedule in one `apply_updates` equal the four reference steps."""
    rng = np.random.default_rng(7)
    batch, expected = ServingBatch(CONFIG), reference_empty()
    first = random_add(rng, np.arange(PREP.max_num_reqs))
    batch.add_requests(first)
    expected = ref.add(expected, first)
    busy = np.flatnonzero(batch.rows.busy)
    finish = FinishRequests.build(CONFIG, busy[:1])
    rows_after_finish = ref.finish(expected, busy[:1])
    add = random_add(rng, np.flatnonzero(rows_after_finish["num_tokens"] == 0))
    mirror = batch.rows.copy()
    for name in ("num_tokens", "num_computed_tokens"):
        getattr(mirror, name)[:] = ref.add(rows_after_finish, add)[name]
    mirror.num_blocks[:] = ref.add(rows_after_finish, add)["num_blocks"]
    append = random_append(rng, mirror)
    mirror.num_blocks[:] = ref.append(ref.add(rows_after_finish, add), append)["num_blocks"]
    schedule = random_schedule(rng, mirror)
    batch.apply_updates(StepUpdates(finish=finish, add=add, append=append, schedule=schedule,
                                    decode_steps=np.ones(1, np.int32)))
    expected = ref.schedule(ref.append(ref.add(rows_after_finish, add), append), schedule)
    assert_matches_reference(batch, expected)


def test_updates_donate_the_old_state_and_never_recompile():
    rng = np.random.default_rng(3)
    batch = ServingBatch(CONFIG)
    batch.add_requests(random_add(rng, np.arange(PREP.max_num_reqs)))  # compiles
    old = batch.state
    with count_compiles() as compiles:
        for _ in range(5):
            busy = np.flatnonzero(batch.rows.busy)
            batch.finish_requests(FinishRequests.build(CONFIG, busy[:1]))
            batch.add_requests(random_add(rng, np.flatnonzero(~batch.rows.busy)))
    assert compiles.compiles <= len(payload_buckets(CONFIG))  # one executable per buffer length, at most
    # every array of the old state was donated (its fields are views of them: the counters of `rows`, token_ids)
    assert old.rows.is_deleted() and old.tokens.is_deleted() and old.tables.is_deleted()


def test_padded_rows_touch_nothing():
    """Row -1 pads: it must not wrap to the last row (JAX wraps -1 even with mode='drop')."""
    batch = ServingBatch(CONFIG)
    last = PREP.max_num_reqs - 1
    batch.add_requests(AddRequests.build(CONFIG, [dict(row=last, token_ids=[5, 6, 7], stop_len=8,
                                                       block_ids=[3])]))
    before = batch.state.to_numpy()
    batch.append_block_ids(AppendBlocks.build(CONFIG))  # all entries padded
    batch.finish_requests(FinishRequests.build(CONFIG))
    batch.add_requests(AddRequests.build(CONFIG))
    after = batch.state.to_numpy()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def busy_batch() -> ServingBatch:
    """Row 0: 6 tokens, 4 computed, 1 block; row 1: 15 tokens (one short of max_model_len), 4 blocks."""
    batch = ServingBatch(CONFIG)
    batch.add_requests(AddRequests.build(CONFIG, [
        dict(row=0, token_ids=range(10, 16), stop_len=12, block_ids=[1], num_computed_tokens=4),
        dict(row=1, token_ids=range(20, 35), stop_len=16, block_ids=[3, 4, 5, 6], num_computed_tokens=14)]))
    return batch


BAD_UPDATES = {
    "row out of range": ("finish_requests", lambda: FinishRequests.build(CONFIG, [4]), "outside the rows"),
    "finish a free row": ("finish_requests", lambda: FinishRequests.build(CONFIG, [2]), "holds no request"),
    "add to a busy row": ("add_requests", lambda: AddRequests.build(CONFIG, [
        dict(row=0, token_ids=[1, 2], stop_len=4, block_ids=[7])]), "row 0 is busy"),
    "add beyond max_model_len": ("add_requests", lambda: AddRequests.build(CONFIG, [
        dict(row=2, token_ids=[1, 2], stop_len=17, block_ids=[7])]), "max_model_len=16"),
    "add the null block": ("add_requests", lambda: AddRequests.build(CONFIG, [
        dict(row=2, token_ids=[1, 2], stop_len=4, block_ids=[0])]), "null block"),
    "prefix hit without its blocks": ("add_requests", lambda: AddRequests.build(CONFIG, [
        dict(row=2, token_ids=range(1, 10), stop_len=12, block_ids=[7], num_computed_tokens=8)]),
        "num_computed_tokens=8"),
    "token id past int32 (a raw payload)": ("add_requests", lambda: AddRequests(entries=(dataclasses.replace(
        AddRequests.build(CONFIG, [dict(row=2, token_ids=[1, 2], stop_len=4, block_ids=[7])]).entries[0],
        token_ids=np.array([1, 2**40], np.int64)),)),
        "AddRequests entry 0 (row 2): token_ids[1] = 1099511627776 is outside [0, 2**31 (int32))"),
    "more blocks than a row holds": ("append_block_ids", lambda: AppendBlocks.build(CONFIG, {0: [7, 8, 9, 10, 11]}),
                                     "block_table would hold 6 blocks, more than its width 5"),
    "append to a free row": ("append_block_ids", lambda: AppendBlocks.build(CONFIG, {3: [7]}), "holds no request"),
    "block id past the cache": ("append_block_ids", lambda: AppendBlocks.build(CONFIG, {0: [20]}), "num_blocks - 1"),
    "schedule a free row": ("schedule", lambda: Schedule.build(CONFIG, [0, 0, 1, 0]), "free row"),
    "schedule unknown tokens": ("schedule", lambda: Schedule.build(CONFIG, [3, 0, 0, 0]), "num_tokens"),
    "schedule without blocks": ("schedule", lambda: Schedule.build(CONFIG, [2, 0, 0, 0]), "append its blocks"),
    "sequence beyond max_model_len": ("schedule", lambda: Schedule.build(CONFIG, [0, 2, 0, 0], [0, 1, 0, 0]),
                                      "max_model_len=16"),
    "drafts without their tokens": ("schedule", lambda: Schedule.build(CONFIG, [1, 0, 0, 0], [1, 0, 0, 0]),
                                    "num_draft_tokens + 1"),
    "over the token budget": ("schedule", lambda: Schedule.build(CONFIG, [0, 17, 0, 0]), "max_num_batched_tokens"),
}


@pytest.mark.parametrize("name", BAD_UPDATES)
def test_bad_update_raises_and_leaves_state_unchanged(name):
    method, payload, message = BAD_UPDATES[name]
    batch = busy_batch()
    state, before = batch.state, batch.state.to_numpy()
    mirror = batch.rows.copy()
    with pytest.raises(InvalidUpdateError, match=re.escape(message)):
        getattr(batch, method)(payload())
    assert batch.state is state and not state.num_tokens.is_deleted()
    for field, value in before.items():
        np.testing.assert_array_equal(batch.state.to_numpy()[field], value, err_msg=field)
    np.testing.assert_array_equal(batch.rows.num_blocks, mirror.num_blocks)
    batch.schedule(Schedule.build(CONFIG, [0, 1, 0, 0]))  # the batch still works


def test_record_past_max_model_len_raises():
    batch = busy_batch()
    batch.schedule(Schedule.build(CONFIG, [0, 1, 0, 0]))
    with pytest.raises(InvalidUpdateError, match="record_sampled.num_sampled"):
        batch.record_sampled([1, -1, -1, -1], np.zeros((4, 3), np.int32), [2, 0, 0, 0])


def test_record_prev_tokens_skips_an_idx_mapping_entry_outside_the_rows():
    """Async scheduling's last-step links: an ``idx_mapping`` entry below -1 links no row (as
    `record_sampled` skips it), never a row it would wrap to."""
    from jaxprep import FeatureConfig
    from jaxprep._constants import NO_PREV_ROW
    from jaxprep.serving.state import ServingState
    from jaxprep.serving.transitions import record_prev_tokens

    features = FeatureConfig(num_speculative_tokens=2, async_tokens=True)
    config = ServingConfig(prep=dataclasses.replace(PREP, features=features), num_speculative_tokens=2)
    sampled, counts = np.array([[7, -1, -1], [8, -1, -1], [9, -1, -1]], np.int32), np.ones(3, np.int32)
    expected = np.full(PREP.max_num_reqs, NO_PREV_ROW)
    expected[1] = 0
    control = np.where(np.arange(PREP.max_num_reqs) == 2, 1, expected)  # an in-range entry does link its row
    for idx_mapping, links in [([1, -3, -1], expected), ([1, 2, -1], control)]:
        state = record_prev_tokens(ServingState.empty(config), np.array(idx_mapping, np.int32), sampled, counts)
        np.testing.assert_array_equal(np.asarray(state.batch.prev_batch_rows), links, err_msg=str(idx_mapping))
