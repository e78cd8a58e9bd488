"""Issue 31 item 5: `transitions.apply_packed` refuses a raw buffer it cannot take whole: a bad header or a bad
value sets a bit of the error word and writes nothing else (the state after equals the state before, bit for
bit, but for the error word). The cases are the issue's, each a word of a real buffer (`pack_step`'s) changed;
the control is the same buffer unchanged, which applies without a bit and changes the state."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxprep import FeatureConfig, PrepConfig, SamplingConfig
from jaxprep.serving import ServingBatch, ServingConfig, StepUpdates
from jaxprep.serving.host.checks import InvalidUpdateError
from jaxprep.serving.state import ERROR_BITS
from jaxprep.serving.transitions import apply_packed
from jaxprep.serving.update_packing import HEADER, HEADER_WORDS, pack_step, payload_layout, resume_fields

VOCAB = 64
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=8, max_model_len=32, max_num_batched_tokens=32, block_size=4,
                                       num_blocks=32, features=FeatureConfig(num_speculative_tokens=2,
                                                                             sampling=SamplingConfig(vocab_size=VOCAB))),
                       num_speculative_tokens=2, vocab_size=VOCAB)
COUNTS, VALUES = ERROR_BITS["packed_counts"], ERROR_BITS["packed_values"]


def busy_batch() -> ServingBatch:
    """Rows 0 and 1 hold requests (4 and 3 tokens); row 0 decodes with two drafts."""
    batch = ServingBatch(CONFIG)
    batch.apply_updates(StepUpdates.build(CONFIG, add=[dict(row=0, token_ids=[5, 6, 7, 8], num_computed_tokens=3,
                                                            block_ids=[1, 2]),
                                                       dict(row=1, token_ids=[9, 10, 11], block_ids=[3])]))
    return batch


def the_update() -> StepUpdates:
    """Row 2 added (tokens [12, 13], block 4), a block appended to row 1, row 0 scheduled with drafts [20, 21]."""
    return StepUpdates.build(CONFIG, add=[dict(row=2, token_ids=[12, 13], block_ids=[4])], append={1: [5]},
                             num_scheduled_tokens=[3, 3, 2] + [0] * 5, num_draft_tokens=[2] + [0] * 7,
                             draft_token_ids=[[20, 21]] + [[0, 0]] * 7)


def words(buffer: np.ndarray) -> dict[str, int]:
    """Where each part of a buffer with no resume starts: the add record's fields, the segment, the data."""
    head = {name: int(buffer[i]) for i, name in enumerate(HEADER)}
    lay = payload_layout(CONFIG)
    add = HEADER_WORDS + head["n_finish"]
    segments = add + head["n_add"] * len(lay.add_fields) + head["n_resume"] * len(resume_fields(CONFIG))
    schedule = segments + 4 * head["n_segments"]
    data = (schedule + head["n_schedule"] * (len(lay.schedule_fields) - head["schedule_dense"])
            + head["has_lora_slots"] * lay.max_loras)
    out = {f"add.{name}": add + f * head["n_add"] for f, name in enumerate(lay.add_fields)}
    out.update(segment_row=segments + head["n_segments"], data=data, schedule=schedule)
    return out


def change(name: str, buffer: np.ndarray) -> int:
    """Sets one word of ``buffer`` as the case ``name`` says; returns the bit it must set."""
    at, n = words(buffer), int(buffer[HEADER.index("n_schedule")])
    edits = {
        "num_tokens -5": (at["add.num_tokens"], -5, VALUES),
        "stop_len 1000": (at["add.stop_len"], 1000, VALUES),
        "token id 5000 of 64": (at["data"], 5000, VALUES),
        "block id past the cache": (at["data"] + 2, 32, VALUES),  # the add's table run follows its 2 tokens
        "the null block in group 0": (at["data"] + 2, 0, VALUES),
        "has_schedule 7": (HEADER.index("has_schedule"), 7, COUNTS),
        "schedule_dense 2": (HEADER.index("schedule_dense"), 2, COUNTS),
        "added row outside the rows": (at["add.row"], 99, VALUES),
        "added row busy": (at["add.row"], 1, VALUES),
        "appended row free": (at["segment_row"], 5, VALUES),
        "top_k 0": (at["add.top_k"], 0, VALUES),
        "num_computed_tokens = num_tokens": (at["add.num_computed_tokens"], 2, VALUES),
        "draft id 64": (at["schedule"] + 3 * n, 64, VALUES),  # dense fields: num_scheduled, num_draft, draft_0, draft_1
        "draft id -2": (at["schedule"] + 3 * n, -2, VALUES),
        "3 drafts": (at["schedule"] + 1 * n, 3, VALUES),
        "n_data one short": (HEADER.index("n_data"), int(buffer[HEADER.index("n_data")]) - 1, COUNTS),
    }
    index, value, bit = edits[name]
    buffer[index] = value
    return bit


CASES = ("num_tokens -5", "stop_len 1000", "token id 5000 of 64", "block id past the cache",
         "the null block in group 0", "has_schedule 7", "schedule_dense 2", "added row outside the rows",
         "added row busy", "appended row free", "top_k 0", "num_computed_tokens = num_tokens", "draft id 64",
         "draft id -2", "3 drafts", "n_data one short")


def test_the_buffer_as_packed_applies():
    """The control: the real buffer sets no bit and changes the state (row 2 added, the drafts written)."""
    batch = busy_batch()
    before = batch.state.to_numpy()
    buffer = pack_step(CONFIG, the_update(), batch.rows.table_blocks).step
    state = apply_packed(batch.state, buffer, config=CONFIG).to_numpy()
    assert int(state["errors"][0]) == 0
    assert state["num_tokens"][2] == 2 and not np.array_equal(state["token_ids"], before["token_ids"])
    assert state["token_ids"][0, 4:6].tolist() == [20, 21]
    at, n = words(buffer), int(buffer[HEADER.index("n_schedule")])  # the cases below change these words
    assert [int(buffer[at[k]]) for k in ("add.row", "add.num_tokens", "add.stop_len", "add.num_computed_tokens",
                                         "segment_row")] == [2, 2, 32, 0, 1]
    assert buffer[at["data"]: at["data"] + 3].tolist() == [12, 13, 4]
    assert [int(buffer[at["schedule"] + k * n]) for k in range(4)] == [3, 2, 20, 21]


@pytest.mark.parametrize("name", CASES)
def test_a_bad_word_sets_a_bit_and_writes_nothing(name):
    batch = busy_batch()
    before = batch.state.to_numpy()
    buffer = pack_step(CONFIG, the_update(), batch.rows.table_blocks).step.copy()
    bit = change(name, buffer)
    after = apply_packed(batch.state, buffer, config=CONFIG).to_numpy()
    assert int(after["errors"][0]) & bit, (name, int(after["errors"][0]))
    for field in before:
        if field != "errors":
            np.testing.assert_array_equal(after[field], before[field], err_msg=f"{name}: {field}")


@pytest.mark.parametrize("buffer, message", [
    (np.zeros(0, np.int32), "shape (0,) and dtype int32"),
    (np.zeros(HEADER_WORDS - 1, np.int32), f"shape ({HEADER_WORDS - 1},)"),
    (np.zeros(64, np.float32), "dtype float32"),
    (np.zeros((2, 64), np.int32), "shape (2, 64)"),
])
def test_a_buffer_that_cannot_be_one_is_refused_by_name_before_it_runs(buffer, message):
    """Static facts, checked while tracing (no IndexError, no truncated float): nothing runs, nothing donated."""
    batch = busy_batch()
    with pytest.raises(InvalidUpdateError, match=re.escape(message)):
        apply_packed(batch.state, buffer, config=CONFIG)
    assert int(batch.state.num_tokens[0]) == 4  # the state was not donated
