"""The device reads each section of a packed buffer at a static size bounded by the buffer's rung
(`packing.section_sizes`), not by max_num_reqs: every buffer `pack_step` writes fits the sizes of
its rung, the bounds are tight, the small sizes apply updates as the NumPy reference does, and a
header claiming more than its buffer holds sets an error bit and drops the excess."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import FeatureConfig, LoRAConfig, PrepConfig, SamplingConfig
from jaxprep.serving import ServingBatch, ServingConfig, StepUpdates, pack_step, payload_buckets
from jaxprep.serving import reference as ref
from jaxprep.serving.host import batch as batch_module
from jaxprep.serving.state import ERROR_BITS
from jaxprep.serving.transitions import apply_packed
from jaxprep.serving.update_packing import (
    HEADER,
    HEADER_WORDS,
    bulk_rungs,
    payload_layout,
    section_sizes,
    unpack_updates,
)
from support.run_keys import recording_run

VOCAB = 64
ROWS = 24


def plain_config(rows: int = ROWS) -> ServingConfig:
    features = FeatureConfig(sampling=SamplingConfig(vocab_size=VOCAB))
    return ServingConfig(prep=PrepConfig(max_num_reqs=rows, max_model_len=32, max_num_batched_tokens=64, block_size=4,
                                         num_blocks=128, features=features), vocab_size=VOCAB)


def rich_config(rows: int = ROWS) -> ServingConfig:
    features = FeatureConfig(num_speculative_tokens=2, structured_outputs=True, mrope=True,
                             lora=LoRAConfig(max_loras=2), sampling=SamplingConfig(vocab_size=VOCAB))
    return ServingConfig(prep=PrepConfig(max_num_reqs=rows, max_model_len=32, max_num_batched_tokens=64, block_size=4,
                                         num_blocks=128, features=features), num_speculative_tokens=2, vocab_size=VOCAB)


PLAIN, RICH = plain_config(), rich_config()
COUNTS = {"n_finish": "finish", "n_add": "add", "n_resume": "resume", "n_segments": "segments",
          "n_schedule": "schedule", "n_data": "data"}


def header(buffer: np.ndarray) -> dict[str, int]:
    return {name: int(buffer[i]) for i, name in enumerate(HEADER)}


def random_updates(config: ServingConfig, rng) -> StepUpdates:
    """Any mix of finish, add, resume, append, LoRA slots and schedule (host checks do not matter here:
    `pack_step` packs whatever it is given)."""
    rows = rng.permutation(ROWS)
    cut = np.sort(rng.integers(0, ROWS + 1, 3))
    finish, added, resumed, rest = np.split(rows, cut)
    mrope = config.prep.features.mrope

    def request(row):
        n = int(rng.integers(1, 17))
        extra = dict(mrope_positions=rng.integers(0, 50, (3, n))) if mrope else {}
        return dict(row=int(row), token_ids=rng.integers(0, VOCAB, n), block_ids=list(rng.integers(1, 128, -(-n // 4))),
                    **extra)

    resume = [dict(row=int(r), num_computed_tokens=int(rng.integers(0, 8)),
                   **(dict(token_ids=rng.integers(0, VOCAB, 3), block_ids=[5]) if rng.random() < 0.5 else {}))
              for r in resumed]
    append = {int(r): list(rng.integers(1, 128, rng.integers(1, 4))) for r in rest if rng.random() < 0.5}
    scheduled = rng.integers(0, 3, ROWS) * (rng.random(ROWS) < rng.random())
    k = config.num_speculative_tokens
    drafts = {}
    if k:
        drafts = dict(num_draft_tokens=np.minimum(scheduled, k), draft_token_ids=rng.integers(0, VOCAB, (ROWS, k)))
    grammar = dict(grammar_index={int(r): 0 for r in rest[:2]}) if config.prep.features.structured_outputs else {}
    lora = dict(lora_slots=[1, -1]) if config.prep.features.lora is not None and rng.random() < 0.5 else {}
    schedule = dict(num_scheduled_tokens=scheduled, **drafts, **grammar) if rng.random() < 0.8 else {}
    return StepUpdates.build(config, finish=finish, add=[request(r) for r in added], resume=resume, append=append,
                             **schedule, **lora)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rich=st.booleans())
def test_every_packed_buffer_fits_the_sizes_of_its_rung(seed, rich):
    """Random updates, packed (split over several buffers when large): each buffer's header counts are
    within `section_sizes` of its length, and its counted words fit the buffer."""
    config, rng = (RICH if rich else PLAIN), np.random.default_rng(seed)
    lay = payload_layout(config)
    packed = pack_step(config, random_updates(config, rng), rng.integers(0, 3, (ROWS, lay.num_tables)))
    assert len(packed.step) in payload_buckets(config)
    for buffer in packed.buffers:
        assert len(buffer) in payload_buckets(config) + bulk_rungs(config)  # a leading buffer may be of the bulk rung
        head, sizes = header(buffer), section_sizes(config, len(buffer))
        for count, section in COUNTS.items():
            assert 0 <= head[count] <= getattr(sizes, section), (count, head, sizes)
        schedule_words = head["n_schedule"] * (len(lay.schedule_fields) - head["schedule_dense"])
        used = (HEADER_WORDS + head["n_finish"] + head["n_add"] * len(lay.add_fields) + head["n_data"]
                + head["n_resume"] * (5 + lay.num_tables) + head["n_segments"] * 4 + schedule_words
                + head["has_lora_slots"] * lay.max_loras)
        assert used <= len(buffer)
        assert not buffer[used:].any()  # the padding is zeros: the counts account for every word


@pytest.mark.parametrize("make", [plain_config, rich_config])
def test_section_sizes_are_tight_at_every_rung(make):
    """max_num_reqs 256: a finish of as many rows as a rung holds, and a dense schedule likewise, fill
    the rung and reach their static sizes exactly (a size one smaller would drop an entry)."""
    config = make(256)
    lay = payload_layout(config)
    width = len(lay.schedule_fields) - 1  # a dense entry: no row field
    no_blocks = np.zeros((256, lay.num_tables))
    for words in payload_buckets(config)[:4]:
        sizes, body = section_sizes(config, words), words - HEADER_WORDS
        assert sizes.add == body // len(lay.add_fields) and sizes.resume == body // (5 + lay.num_tables)
        finish = pack_step(config, StepUpdates.build(config, finish=range(body)), no_blocks).step
        assert len(finish) == words and header(finish)["n_finish"] == sizes.finish == body
        n = body // width
        schedule = StepUpdates.build(config, num_scheduled_tokens=[1] * n + [0] * (256 - n))
        packed = pack_step(config, schedule, no_blocks).step
        assert words - width < HEADER_WORDS + n * width <= words == len(packed)
        assert header(packed)["n_schedule"] == sizes.schedule == n
    assert section_sizes(config, 64).add < section_sizes(config, 64).finish < 256


def test_unpacked_shapes_follow_the_rung():
    sizes = section_sizes(RICH, 64)
    updates = jax.eval_shape(lambda blob: unpack_updates(blob, RICH), np.zeros(64, np.int32))
    assert updates.finish_rows.shape == (sizes.finish,)
    assert {v.shape for v in updates.add.values()} == {(sizes.add,)}
    assert {v.shape for v in updates.resume.values()} == {(sizes.resume,)}
    assert updates.data_value.shape == (sizes.data,)
    assert updates.schedule["num_scheduled_tokens"].shape == (ROWS,)


def test_small_rungs_apply_updates_like_the_reference():
    """Adds in buffers of the small rungs (17 add fields: the 64-word rung reads 3 add entries, the 96-word top
    rung 5): 2 adds at the 64-word rung, 4 at the 96-word one, then a finish, 2 adds and an append; every step
    against the NumPy oracle (sampling rows and penalty bins included), with a negative control."""
    rng = np.random.default_rng(3)
    batch = ServingBatch(PLAIN)
    expected = {name: value.copy() for name, value in batch.state.to_numpy().items()}

    def request(row, n):
        return dict(row=row, token_ids=rng.integers(0, VOCAB, n), block_ids=list(rng.integers(1, 128, -(-n // 4))),
                    prompt_len=n - 1)

    steps = [dict(add=[request(r, 2) for r in range(2)], num_scheduled_tokens=[2, 2] + [0] * (ROWS - 2)),
             dict(add=[request(r, 3) for r in range(2, 6)]),
             dict(finish=[1, 4], add=[request(1, 5), request(4, 2)], append={0: [9]},
                  num_scheduled_tokens=[1] * 6 + [0] * (ROWS - 6))]
    buffers = []  # (n_add, sizes.add) of each buffer
    for step in steps:
        updates = StepUpdates.build(PLAIN, **step)
        buffers += [(header(b)['n_add'], section_sizes(PLAIN, len(b)).add) for b in batch.pack(updates).buffers]
        batch.apply_updates(updates)
        expected = ref.apply_updates(expected, updates)
        got = batch.state.to_numpy()
        for name, value in expected.items():
            if not name.startswith("_"):
                np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert {(2, 3), (4, 5)} <= set(buffers)  # adds at the 64-word rung's 3 entries, and past them at the 96's 5
    assert not batch.errors()["packed_counts"]
    shifted = expected["output_bin_counts"].copy()
    shifted[2, int(np.argmax(shifted[2]))] += 1
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(batch.state.to_numpy()["output_bin_counts"], shifted)


def test_a_large_admission_goes_in_bulk_buffers_and_applies_like_the_reference(monkeypatch):
    """Every row admitted at once, 12-16 tokens each (~900 words: past the 96-word top rung, which holds
    5 add records): the leading buffers are of the bulk rung (`bulk_rungs`: 768 words), two of them, not the
    ten top-rung buffers a split at the top would take, each applied by the bulk rung's program in one call;
    the state is the NumPy reference's after it and after a decode step; negative control: a changed token is
    seen."""
    rng = np.random.default_rng(5)
    (bulk,) = bulk_rungs(PLAIN)
    assert bulk == 768 and payload_buckets(PLAIN)[-1] == 96
    batch = ServingBatch(PLAIN)
    expected = {name: value.copy() for name, value in batch.state.to_numpy().items()}
    adds = [dict(row=r, token_ids=rng.integers(0, VOCAB, int(rng.integers(12, 17))),
                 block_ids=list(rng.integers(1, 128, 4)), prompt_len=11) for r in range(ROWS)]
    steps = [StepUpdates.build(PLAIN, add=adds, num_scheduled_tokens=[2] * ROWS),
             StepUpdates.build(PLAIN, append={3: [9]}, num_scheduled_tokens=[1] * ROWS)]
    packed = batch.pack(steps[0])
    assert [len(b) for b in packed.before] == [bulk, bulk] and len(packed.step) in payload_buckets(PLAIN)
    assert sum(header(b)["n_add"] for b in packed.before) == ROWS
    keys = []
    monkeypatch.setattr(batch_module, "run", recording_run(keys))
    for updates in steps:
        batch.apply_updates(updates)
        expected = ref.apply_updates(expected, updates)
    assert keys.count(("apply", False, bulk)) == 2  # one call per bulk buffer, no widening before it
    assert keys[:2] == [("apply", False, bulk)] * 2
    got = batch.state.to_numpy()
    for name, value in expected.items():
        if not name.startswith("_"):
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not any(batch.errors().values())
    changed = expected["token_ids"].copy()
    changed[ROWS - 1, 0] += 1
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(got["token_ids"], changed)


def busy_batch() -> ServingBatch:
    batch = ServingBatch(PLAIN)
    batch.apply_updates(StepUpdates.build(PLAIN, add=[dict(row=r, token_ids=[r + 1], block_ids=[r + 1])
                                                      for r in range(ROWS)]))
    return batch


def test_a_count_past_its_size_is_flagged_and_nothing_written():
    """max_num_reqs 16, a 64-word buffer with n_finish 20 > sizes.finish 16: rows 0-7 twice (entries
    0-15), then rows 8-11 (entries 16-19). The bit is set and the buffer refused whole: every row keeps
    its request, the state equals the state before but for the error word; the same rows with
    n_finish 16 free rows 0-7 (control)."""
    config = ServingConfig(prep=PrepConfig(max_num_reqs=16, max_model_len=32, max_num_batched_tokens=64, block_size=4,
                                           num_blocks=128), vocab_size=VOCAB)
    batch = ServingBatch(config)
    batch.apply_updates(StepUpdates.build(config, add=[dict(row=r, token_ids=[r + 1], block_ids=[r + 1])
                                                       for r in range(16)]))
    assert section_sizes(config, 64).finish == 16
    buffer = np.zeros(64, np.int32)
    buffer[HEADER.index("n_finish")] = 20
    buffer[HEADER_WORDS: HEADER_WORDS + 20] = [*range(8), *range(8), 8, 9, 10, 11]
    before = batch.state.to_numpy()
    state = apply_packed(batch.state, buffer, config=config)
    assert int(state.errors[0]) == ERROR_BITS["packed_counts"]
    assert_equal_but_errors(state.to_numpy(), before)
    buffer[HEADER.index("n_finish")] = 16
    state = apply_packed(state, buffer, config=config)
    assert int(state.errors[0]) == ERROR_BITS["packed_counts"]  # kept
    np.testing.assert_array_equal(np.asarray(state.num_tokens), [0] * 8 + [1] * 8)
    control = ServingBatch(config)
    assert int(apply_packed(control.state, buffer, config=config).errors[0]) == 0


def assert_equal_but_errors(after: dict, before: dict) -> None:
    """Every leaf of the state after equals the state before, bit for bit, the error word aside."""
    assert after.keys() == before.keys()
    for name in before:
        if name != "errors":
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.parametrize("count, value", [("n_add", "size+1"), ("n_finish", -1), ("n_data", 2**30),
                                          ("n_schedule", 2**30), ("n_resume", "fits-alone")])
def test_a_header_claiming_more_than_its_buffer_sets_the_error_bit(count, value):
    """Each count out of bounds on its own (past its size, negative, int32-overflowing products, or within
    its size but with the others more words than the buffer): the bit is set and nothing is written (the
    zero records it would read are bad values too: both bits may be set)."""
    sizes = section_sizes(PLAIN, 64)
    buffer = np.zeros(64, np.int32)
    if value == "size+1":
        value = getattr(sizes, COUNTS[count]) + 1
    if value == "fits-alone":  # 9 resumes (54 words) fit alone; with 1 finish row they do not
        value = sizes.resume
        buffer[HEADER.index("n_finish")] = 1
    buffer[HEADER.index(count)] = value
    batch = busy_batch()
    before = batch.state.to_numpy()
    state = apply_packed(batch.state, buffer, config=PLAIN)
    assert int(state.errors[0]) & ERROR_BITS["packed_counts"]
    assert_equal_but_errors(state.to_numpy(), before)
    clean = apply_packed(busy_batch().state, np.zeros(64, np.int32), config=PLAIN)
    assert int(clean.errors[0]) == 0


def test_drafts_of_a_sparse_schedule_at_the_smallest_rung_match_the_reference():
    """24 decoding rows, drafts for rows 3 and 20 only: a sparse schedule in the 64-word rung, which
    reads 10 schedule entries; each entry's drafts land after its row's tokens, as the oracle has it."""
    batch = ServingBatch(RICH)
    adds = [dict(row=r, token_ids=[r + 1] * 4, num_computed_tokens=3, block_ids=[2 * r + 1, 2 * r + 2])
            for r in range(ROWS)]
    batch.apply_updates(StepUpdates.build(RICH, add=adds))
    expected = {name: value.copy() for name, value in batch.state.to_numpy().items()}
    scheduled, drafts = np.zeros(ROWS, np.int64), np.zeros(ROWS, np.int64)
    scheduled[[3, 20]], drafts[[3, 20]] = 3, 2
    draft_ids = np.arange(ROWS * 2).reshape(ROWS, 2) % VOCAB
    updates = StepUpdates.build(RICH, num_scheduled_tokens=scheduled, num_draft_tokens=drafts,
                                draft_token_ids=draft_ids)
    buffer = batch.pack(updates).step
    assert len(buffer) == 64 and header(buffer)["schedule_dense"] == 0 and section_sizes(RICH, 64).schedule < ROWS
    batch.apply_updates(updates)
    expected = ref.schedule(expected, updates.schedule)
    got = batch.state.to_numpy()
    for name in ("token_ids", "num_draft_tokens", "num_scheduled_tokens"):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    np.testing.assert_array_equal(got["token_ids"][20, 4:6], draft_ids[20])
    assert not got["token_ids"][[2, 4, 19, 21], 4:6].any()  # negative control: no other row gets drafts
