"""The serving layer driven from outside (issue 21): every feature input a transition maintains,
payloads that grow with the change, the resume transition, draft ids checked, and a read-free
`record_sampled`. Each state is compared with the NumPy oracle `jaxprep.serving.reference`, with
negative controls."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep import FeatureConfig, KVCacheGroupSpec, LoRAConfig, PrepConfig, SamplingConfig, prepare_inputs
from jaxprep.features.config import HybridConfig
from jaxprep.serving import InvalidUpdateError, ServingBatch, ServingConfig, StepUpdates, pack_step, transitions
from jaxprep.serving import reference as ref
from jaxprep.serving.state import AddRequests, ResumeRequests

VOCAB = 64
FEATURES = FeatureConfig(
    num_speculative_tokens=2, discard_request_mask=True,
    kv_groups=(KVCacheGroupSpec(block_size=4), KVCacheGroupSpec(block_size=8, sliding_window=8, num_blocks=16)),
    mrope=True, prompt_embeds=True, lora=LoRAConfig(max_loras=2), structured_outputs=True, hybrid=HybridConfig(),
    sampling=SamplingConfig(vocab_size=VOCAB))
FULL = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                                     num_blocks=32, features=FEATURES), num_speculative_tokens=2, vocab_size=VOCAB)
GROUPS = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                                       num_blocks=32, features=FeatureConfig(discard_request_mask=True,
                                                                             kv_groups=FEATURES.kv_groups)))
SPEC = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                                     num_blocks=32, features=FeatureConfig(num_speculative_tokens=2)),
                     num_speculative_tokens=2, vocab_size=VOCAB)


def assert_state(batch: ServingBatch, expected: dict) -> None:
    got = batch.state.to_numpy()
    for name, value in expected.items():
        if name.startswith("_"):
            continue
        values = zip(got[name], value) if isinstance(value, tuple) else [(got[name], value)]
        for have, want in values:
            np.testing.assert_array_equal(have, want, err_msg=name)


def reference_of(batch: ServingBatch) -> dict:
    return {name: (tuple(v.copy() for v in value) if isinstance(value, tuple) else value.copy())
            for name, value in batch.state.to_numpy().items()}


def request(row, n, rng, **extra):
    tokens = rng.integers(0, VOCAB, n)
    return dict(row=row, token_ids=tokens, block_ids=[list(rng.integers(1, 32, -(-n // 4))),
                                                      [0] + list(rng.integers(1, 16, -(-n // 8) - 1))],
                mrope_positions=rng.integers(0, 100, (3, n)), mrope_position_delta=int(rng.integers(-5, 5)),
                is_token_ids=rng.random(n) < 0.5, prompt_embeds_start=int(rng.integers(0, 9)),
                lora_id=int(rng.integers(0, 4)), mamba_block_ids=[int(rng.integers(1, 32))], prompt_len=n - 1,
                **extra)


@pytest.mark.parametrize("seed", [0])
def test_every_feature_input_follows_the_reference(seed):
    """Two KV groups (one sliding-window, null blocks allowed), M-RoPE, prompt embeddings, LoRA ids
    and slots, Mamba rows, grammar rows and sampling rows through add, resume, append, finish and
    schedule, against the NumPy oracle; a shifted value fails the comparison."""
    rng = np.random.default_rng(seed)
    batch = ServingBatch(FULL)
    expected = reference_of(batch)
    steps = [
        dict(add=[request(1, 20, rng), request(3, 5, rng)], lora_slots=[3, -1], num_scheduled_tokens=[0, 10, 0, 5],
             grammar_index={1: 0}),
        dict(append={1: [[7], []], 3: {1: [4]}}, num_scheduled_tokens=[0, 6, 0, 0], grammar_index={1: 2}),
        dict(finish=[3], resume=[dict(row=1, num_computed_tokens=0, token_ids=rng.integers(0, VOCAB, 9),
                                      block_ids=[[5, 6, 8], [9, 10]], mamba_block_ids=[2])],
             add=[request(0, 3, rng)], num_scheduled_tokens=[3, 9, 0, 0], lora_slots=[-1, 2]),
    ]
    for step in steps:
        updates = StepUpdates.build(FULL, **step)
        batch.apply_updates(updates)
        expected = ref.apply_updates(expected, updates)
        assert_state(batch, expected)
    shifted = dict(expected, extra_block_tables=(expected["extra_block_tables"][0] + 1,))
    with pytest.raises(AssertionError):
        assert_state(batch, shifted)
    shifted = dict(expected, mrope_positions=expected["mrope_positions"] + 1)
    with pytest.raises(AssertionError):
        assert_state(batch, shifted)


def test_second_group_slots_and_prefill_len_reach_prepare():
    """Worked example: a 10-of-20 prefill chunk of row 1. Group 1 (block size 8, sliding window 8)
    holds [null, 5, 6]: positions 8, 9 go to slots 5 * 8 + 0, 5 * 8 + 1; positions 0..7 lie outside
    the window (-1). ``prefill_len`` 20 makes the chunk's sample discarded."""
    batch = ServingBatch(GROUPS)
    tokens = list(range(1, 21))
    batch.apply_updates(StepUpdates.build(GROUPS, add=[dict(row=1, token_ids=tokens, block_ids=[[1, 2, 3], [0, 5, 6]])],
                                          num_scheduled_tokens=[0, 10, 0, 0]))
    step = prepare_inputs(batch.state.batch, GROUPS.prep)
    np.testing.assert_array_equal(np.asarray(step.kv_groups[1].slot_mapping[:10]), [-1] * 8 + [40, 41])
    assert bool(step.discard_request_mask[0])
    assert not np.array_equal(np.asarray(step.kv_groups[1].slot_mapping[:10]), [-1] * 8 + [41, 42])


def test_draft_counts_reach_prepare():
    """Defect 1: the schedule's draft counts are `BatchState.num_draft_tokens` (one copy)."""
    batch = ServingBatch(SPEC)
    batch.apply_updates(StepUpdates.build(SPEC, add=[dict(row=0, token_ids=[5, 6, 7], block_ids=[1, 2]),
                                                     dict(row=1, token_ids=[8, 9], block_ids=[3])],
                                          num_scheduled_tokens=[3, 2, 0, 0]))
    batch.record_sampled(np.array([0, 1, -1, -1]), np.array([[11], [12], [0], [0]]), np.array([1, 1, 0, 0]))
    batch.apply_updates(StepUpdates.build(SPEC, num_scheduled_tokens=[3, 1, 0, 0], num_draft_tokens=[2, 0, 0, 0],
                                          draft_token_ids=[[21, 22], [0, 0], [0, 0], [0, 0]]))
    drafts = np.asarray(prepare_inputs(batch.state.batch, SPEC.prep).spec_decode.num_draft_tokens[:2])
    np.testing.assert_array_equal(drafts, [2, 0])
    assert not np.array_equal(drafts, [0, 0])
    np.testing.assert_array_equal(np.asarray(batch.state.batch.token_ids[0, :6]), [5, 6, 7, 11, 21, 22])


@pytest.mark.parametrize("features, draft, message", [
    ({}, -1, "Schedule.draft_token_ids[0][1] = -1 is outside [0, vocab_size=64)"),
    (dict(num_speculative_tokens=2), -1, None),
    (dict(num_speculative_tokens=2, async_tokens=True), 64, "Schedule.draft_token_ids[0][0] = 64 is outside "
                                                            "[0, vocab_size=64)"),
    (dict(num_speculative_tokens=2, async_tokens=True), -1, None),
])
def test_draft_ids_are_range_checked(features, draft, message):
    """Defect 4 and issue 31: vLLM's -1 placeholder only where the prepared step clamps it out of input_ids and
    reads it as a draft never accepted (spec decode or async tokens on in the PrepConfig); a serving config with
    drafts whose PrepConfig has neither would hand -1 to the model."""
    config = ServingConfig(prep=PrepConfig(max_num_reqs=2, max_model_len=16, max_num_batched_tokens=8, block_size=4,
                                           num_blocks=8, features=FeatureConfig(**features)),
                           num_speculative_tokens=2, vocab_size=VOCAB)
    batch = ServingBatch(config)
    batch.apply_updates(StepUpdates.build(config, add=[dict(row=0, token_ids=[7], block_ids=[1])]))
    drafts = [[draft, -1], [0, 0]] if draft == 64 else [[5, draft], [0, 0]]
    updates = StepUpdates.build(config, num_scheduled_tokens=[3, 0], num_draft_tokens=[2, 0], draft_token_ids=drafts)
    if message is None:
        batch.apply_updates(updates)
        np.testing.assert_array_equal(np.asarray(batch.state.batch.token_ids[0, :3]), [7, 5, -1])
        step = batch.prepare(8)
        assert np.asarray(step.input_ids)[:3].tolist() == [7, 5, 0]  # clamped, as V1's _preprocess
        assert np.asarray(step.spec_decode.draft_token_ids)[:2].tolist() == [5, -1]  # never accepted
        return
    before = batch.state.to_numpy()
    with pytest.raises(InvalidUpdateError, match=re.escape(message)):
        batch.apply_updates(updates)
    np.testing.assert_array_equal(batch.state.to_numpy()["token_ids"], before["token_ids"])


def decoding_batch(config=SPEC) -> ServingBatch:
    batch = ServingBatch(config)
    batch.apply_updates(StepUpdates.build(config, add=[dict(row=0, token_ids=[5, 6, 7], block_ids=[1, 2]),
                                                       dict(row=1, token_ids=[8, 9], block_ids=[3])],
                                          num_scheduled_tokens=[3, 2, 0, 0]))
    return batch


def test_record_sampled_reads_nothing_back():
    """Defect 5: device arrays are recorded with no device-to-host transfer; a row with drafts is
    pending until a resume states its computed tokens; bad device values set the error word."""
    batch = decoding_batch()
    with jax.transfer_guard_device_to_host("disallow"):
        batch.record_sampled(jnp.array([0, 1, -1, -1]), jnp.array([[11], [12], [0], [0]]), jnp.array([1, 1, 0, 0]))
    np.testing.assert_array_equal(batch.rows.num_tokens[:2], [4, 3])
    batch.apply_updates(StepUpdates.build(SPEC, num_scheduled_tokens=[3, 1, 0, 0], num_draft_tokens=[2, 0, 0, 0],
                                          draft_token_ids=[[21, 22], [0, 0], [0, 0], [0, 0]]))
    with jax.transfer_guard_device_to_host("disallow"):  # row 0 keeps one draft, then its bonus token
        batch.record_sampled(jnp.array([0, 1, -1, -1]), jnp.array([[21, 30, 0], [1000, 0, 0], [0] * 3, [0] * 3]),
                             jnp.array([2, 1, 0, 0]))
    assert batch.errors() == {"sampled_token_id": True, "num_sampled": False, "idx_mapping": False,
                              "packed_counts": False, "draft_token_id": False, "packed_values": False}
    assert int(batch.state.batch.token_ids[1, 3]) == 0  # the bad token is not written
    with pytest.raises(InvalidUpdateError, match="pending"):
        batch.apply_updates(StepUpdates.build(SPEC, num_scheduled_tokens=[1, 0, 0, 0]))
    with pytest.raises(InvalidUpdateError, match=re.escape("num_computed_tokens=7 is outside [4, 6]")):
        batch.apply_updates(StepUpdates.build(SPEC, resume=[dict(row=0, num_computed_tokens=7)]))
    batch.apply_updates(StepUpdates.build(SPEC, resume=[dict(row=0, num_computed_tokens=5)],
                                          num_scheduled_tokens=[1, 0, 0, 0]))
    assert int(batch.state.num_tokens[0]) == 6 == batch.rows.num_tokens[0]
    assert int(batch.state.batch.num_computed_tokens[0]) == 5


def test_unverified_drafts_keep_the_device_count():
    """vLLM's async scheduler states row 0's count as 6 (3 + 3, its drafts [21, 22] taken as accepted) though the
    device kept one (C 5): with unverified_drafts the device keeps 5 and the mirror knows [4, 6]; a count past
    what the drafts allow, or unverified drafts on a settled row, are refused. After the next step (all 3
    kept: C 8) an exact count anywhere in [5, 9] settles the row."""
    batch = decoding_batch()
    batch.record_sampled(jnp.array([0, 1, -1, -1]), jnp.array([[11], [12], [0], [0]]), jnp.array([1, 1, 0, 0]))
    batch.apply_updates(StepUpdates.build(SPEC, num_scheduled_tokens=[3, 1, 0, 0], num_draft_tokens=[2, 0, 0, 0],
                                          draft_token_ids=[[21, 22], [0, 0], [0, 0], [0, 0]]))
    batch.record_sampled(jnp.array([0, 1, -1, -1]), jnp.array([[21, 30, 0], [13, 0, 0], [0] * 3, [0] * 3]),
                         jnp.array([2, 1, 0, 0]))
    with pytest.raises(InvalidUpdateError, match=re.escape("num_computed_tokens=9 (less up to 2 unverified drafts) "
                                                           "is outside [4, 6]")):
        batch.apply_updates(StepUpdates.build(SPEC, resume=[dict(row=0, num_computed_tokens=9, unverified_drafts=2)]))
    with pytest.raises(InvalidUpdateError, match="pending"):
        batch.apply_updates(StepUpdates.build(SPEC, resume=[dict(row=1, num_computed_tokens=3, unverified_drafts=1)]))
    batch.apply_updates(StepUpdates.build(SPEC, resume=[dict(row=0, num_computed_tokens=6, unverified_drafts=2)],
                                          append={0: [5]}, num_scheduled_tokens=[3, 0, 0, 0],
                                          num_draft_tokens=[2, 0, 0, 0],
                                          draft_token_ids=[[31, 32], [0, 0], [0, 0], [0, 0]]))
    assert int(batch.state.batch.num_computed_tokens[0]) == 5 and int(batch.state.num_tokens[0]) == 6
    assert (batch.rows.num_computed_tokens[0], batch.rows.slack[0]) == (6, 2)
    assert np.asarray(batch.prepare(16).positions)[:3].tolist() == [5, 6, 7]
    batch.record_sampled(jnp.array([0, -1, -1, -1]), jnp.array([[31, 32, 40]] + [[0] * 3] * 3), jnp.array([3, 0, 0, 0]))
    assert (batch.rows.num_computed_tokens[0], batch.rows.pending_drafts[0], batch.rows.slack[0]) == (5, 4, 0)
    batch.apply_updates(StepUpdates.build(SPEC, resume=[dict(row=0, num_computed_tokens=8)]))
    assert int(batch.state.batch.num_computed_tokens[0]) == 8 == batch.rows.num_computed_tokens[0]


@pytest.mark.parametrize("sampled, counts, message", [
    ([[1000], [3]], [1, 1], "record_sampled.sampled_token_ids[0][0] = 1000 is outside [0, vocab_size=64)"),
    ([[3], [-5]], [1, 1], "record_sampled.sampled_token_ids[1][0] = -5 is outside [0, vocab_size=64)"),
    (np.array([[2**40 + 9], [3]], np.int64), [1, 1], "sampled_token_ids[0][0] = 1099511627785 is outside"),
    ([[3, 4, 5]], [1, 1], "must agree"),
    ([[[3]], [[4]]], [1, 1], "sampled_token_ids must be 2-D"),
])
def test_record_sampled_host_arrays_are_checked(sampled, counts, message):
    batch = decoding_batch()
    before, mirror = batch.state.to_numpy(), batch.rows.copy()
    with pytest.raises(InvalidUpdateError, match=re.escape(message)):
        batch.record_sampled(np.array([0, 1]), sampled, np.array(counts))
    np.testing.assert_array_equal(batch.state.to_numpy()["num_tokens"], before["num_tokens"])
    np.testing.assert_array_equal(batch.rows.num_tokens, mirror.num_tokens)


def test_resume_replaces_blocks_and_tokens_and_stop_len_is_optional():
    """Defect 6: a preempted request resumes in its row with new blocks and all its tokens (vLLM V1
    ``resumed_req_ids`` + ``all_token_ids``); ``stop_len`` defaults to max_model_len."""
    batch = decoding_batch()
    assert batch.rows.stop_len[0] == SPEC.max_model_len
    batch.record_sampled(np.array([0, 1, -1, -1]), np.array([[11], [12], [0], [0]]), np.array([1, 1, 0, 0]))
    expected = reference_of(batch)
    updates = StepUpdates.build(SPEC, resume=[dict(row=0, num_computed_tokens=0, block_ids=[9, 10],
                                                   token_ids=[5, 6, 7, 11, 13])],
                                num_scheduled_tokens=[5, 0, 0, 0])
    batch.apply_updates(updates)
    expected = ref.apply_updates(expected, updates)
    assert_state(batch, expected)
    np.testing.assert_array_equal(expected["block_table"][0, :3], [9, 10, 0])
    np.testing.assert_array_equal(expected["token_ids"][0, :5], [5, 6, 7, 11, 13])
    with pytest.raises(AssertionError):
        assert_state(batch, dict(expected, num_computed_tokens=expected["num_computed_tokens"] + 1))


def test_six_adds_in_one_step_and_bytes_grow_with_the_change():
    """Defect 3: any admission count up to max_num_reqs in one update; the buffers' bytes stay within
    2x of the entries written plus a fixed header, from 6 requests of 8 tokens to 256 of them."""
    prep = PrepConfig(max_num_reqs=256, max_model_len=8192, max_num_batched_tokens=2048, block_size=16,
                      num_blocks=4096)
    config = ServingConfig(prep=prep, vocab_size=32000)
    rows = np.zeros((256, 1), np.int64)
    for count in (6, 64, 256):
        adds = [dict(row=r, token_ids=np.arange(8) + r, block_ids=[r + 1]) for r in range(count)]
        updates = StepUpdates.build(config, add=adds, num_scheduled_tokens=[8] * min(count, 256))
        packed = pack_step(config, updates, rows)
        changed_bytes = 4 * (count * (8 + 1 + 4) + count)  # tokens, block, 4 counters, the scheduled count
        assert packed.changed_words * 4 == changed_bytes
        assert packed.nbytes <= 2 * changed_bytes + 64 * 4, (count, packed.nbytes, changed_bytes)
    assert 100 * packed.nbytes < 8192 * 256 * 4  # the old [A, max_model_len] rows


def test_add_entry_bounds_name_the_field():
    batch = ServingBatch(FULL)
    bad = {
        "group 1 block id 16": (dict(block_ids=[[1], [16]]), "extra_block_tables[0] block id [0] = 16 is outside "
                                                           "[0, 15]"),
        "group 0 null block": (dict(block_ids=[[0], []]), "block_table block id [0] = 0 is outside [1, 31]"),
        "mrope too long": (dict(mrope_positions=np.zeros((3, 5), int)), "mrope_positions has 5 positions"),
        "prompt_len": (dict(prompt_len=9), "prompt_len=9 is outside [0, num_tokens=4]"),
    }
    for name, (fields, message) in bad.items():
        entry = dict(dict(row=0, token_ids=[1, 2, 3, 4], block_ids=[[1], []]), **fields)
        with pytest.raises(InvalidUpdateError, match=re.escape(message)):
            batch.add_requests(AddRequests.build(FULL, [entry]))
        assert not batch.rows.busy.any(), name
    with pytest.raises(InvalidUpdateError, match="holds no request"):
        batch.resume_requests(ResumeRequests.build(FULL, [dict(row=2, num_computed_tokens=0)]))


def test_no_compile_after_warmup():
    """`ServingBatch.warmup` compiles every payload rung and token bucket: updates of any size after
    it (here 4 requests of 1, 27 and 9 tokens, finishes) and `prepare` compile nothing."""
    from jaxprep import count_compiles
    from jaxprep.serving import payload_buckets

    batch = ServingBatch(SPEC)
    batch.warmup(threads=1)
    assert len(payload_buckets(SPEC)) > 1
    rng = np.random.default_rng(0)
    with count_compiles() as compiles:
        for n in (1, 27, 9):
            adds = [dict(row=r, token_ids=rng.integers(0, VOCAB, n), block_ids=list(range(1 + 7 * r, 8 + 7 * r)))
                    for r in range(4)]
            batch.apply_updates(StepUpdates.build(SPEC, add=adds, num_scheduled_tokens=[min(n, 4)] * 4))
            batch.prepare(16)
            batch.apply_updates(StepUpdates.build(SPEC, finish=range(4)))
    assert compiles.compiles == 0


def test_append_bounds_name_the_segment_and_change_nothing():
    """The append checks (all segments at once, NumPy) name the first bad segment as the per-segment
    walk does, and leave the mirror unchanged; a valid append (the control) passes and counts."""
    from jaxprep.serving.state import AppendBlocks

    batch = ServingBatch(FULL)
    batch.add_requests(AddRequests.build(FULL, [dict(row=1, token_ids=[1, 2, 3, 4], block_ids=[[1], [3]])]))
    before = batch.rows.copy()
    bad = {
        "group 1 id past its pool": ({1: [[2], [16]]}, "AppendBlocks row 1: extra_block_tables[0] block id [0] = 16 "
                                                       "is outside [0, 15]"),
        "group 0 null block": ({1: [[0], []]}, "AppendBlocks row 1: block_table block id [0] = 0 is outside [1, 31]"),
        "past the width": ({1: [[2], list(range(16))]}, "AppendBlocks row 1: extra_block_tables[0] would hold 17 "
                                                        "blocks, more than its width 16"),
        "idle row": ({2: [[5], []]}, "AppendBlocks.rows: row 2 holds no request"),
    }
    for name, (appends, message) in bad.items():
        with pytest.raises(InvalidUpdateError, match=re.escape(message)):
            batch.append_block_ids(AppendBlocks.build(FULL, appends))
        for field in ("table_blocks", "num_tokens"):
            np.testing.assert_array_equal(getattr(batch.rows, field), getattr(before, field), err_msg=name)
    batch.append_block_ids(AppendBlocks.build(FULL, {1: [[2, 4], [5]]}))
    assert batch.rows.table_blocks[1, :2].tolist() == [3, 2]


ASYNC_SPEC = dataclasses.replace(SPEC, prep=dataclasses.replace(
    SPEC.prep, features=FeatureConfig(num_speculative_tokens=2, async_tokens=True)))


@pytest.mark.parametrize("drafts, message", [
    ([[64, 3], [1, 2]], r"record_prev_tokens.draft_token_ids\[0\] = 64 is outside \[0, vocab_size=64\)"),
    ([[1, -2], [1, 2]], r"record_prev_tokens.draft_token_ids\[1\] = -2 is outside \[0, vocab_size=64\)"),
    ([[1, 2, 3], [1, 2, 3]], r"draft_token_ids has shape \(2, 3\), expected \[B=2, <= num_speculative_tokens=2\]"),
    ([[1, 2]], r"draft_token_ids has shape \(1, 2\), expected \[B=2"),
])
def test_host_draft_proposals_get_named_errors_and_leave_the_state(drafts, message):
    batch = ServingBatch(ASYNC_SPEC)
    before = batch.state.to_numpy()
    with pytest.raises(InvalidUpdateError, match=message):
        batch.record_prev_tokens(np.array([0, 1]), np.array([[5], [6]]), np.array([1, 1]), np.array(drafts))
    for name, value in batch.state.to_numpy().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


@pytest.mark.parametrize("where", ["device", "host"])
def test_the_record_with_prev_tokens_is_both_records_in_one_call(where, monkeypatch):
    """`record_with_prev_tokens` (async scheduling's record of a step) leaves the state and the mirror as
    `record_prev_tokens` then `record_sampled` do, field by field, in one dispatch; with drafts, a rejected one
    and a padded batch row, from device arrays (read-free) and from host arrays (checked). Negative control:
    `record_sampled` alone leaves the previous-step fields as they were, so the comparison sees them."""
    array = jnp.array if where == "device" else np.array
    inputs = (array([0, 1, -1, -1]), array([[21, 30, 0], [13, 0, 0], [0] * 3, [0] * 3]), array([2, 1, 0, 0]),
              array([[7, 8], [9, -1], [-1, -1], [-1, -1]]))
    two, one, alone = (decoding_batch(ASYNC_SPEC) for _ in range(3))
    for batch in (two, one, alone):  # a step with drafts on row 0
        batch.record_sampled(np.array([0, 1, -1, -1]), np.array([[11], [12], [0], [0]]), np.array([1, 1, 0, 0]))
        batch.apply_updates(StepUpdates.build(ASYNC_SPEC, num_scheduled_tokens=[3, 1, 0, 0],
                                              num_draft_tokens=[2, 0, 0, 0],
                                              draft_token_ids=[[21, 22], [0, 0], [0, 0], [0, 0]]))
    two.record_prev_tokens(*inputs)
    two.record_sampled(*inputs[:3])
    calls = []
    real = transitions.record_with_prev_tokens
    monkeypatch.setattr(transitions, "record_with_prev_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    one.record_with_prev_tokens(*inputs)
    alone.record_sampled(*inputs[:3])
    assert calls == [1]
    expected, got, control = two.state.to_numpy(), one.state.to_numpy(), alone.state.to_numpy()
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert np.asarray(expected["prev_sampled_token_ids"])[:2].tolist() == [30, 13]
    assert not np.array_equal(control["prev_draft_token_ids"], expected["prev_draft_token_ids"])
    for name in ("num_tokens", "num_computed_tokens", "pending_drafts", "slack"):
        np.testing.assert_array_equal(getattr(one.rows, name), getattr(two.rows, name), err_msg=name)
    assert not any(one.errors().values())


def test_a_refused_record_with_prev_tokens_records_nothing():
    """A host record the checks refuse (a sampled id outside the vocabulary, or a draft proposal) raises, naming
    it, before the one call: neither the previous-step fields nor the tokens nor the mirror change. (Two calls
    would have kept the previous-step fields before `record_sampled` refused.)"""
    for sampled, drafts, message in [([[99], [12], [0], [0]], [[7, 8], [9, 9], [-1, -1], [-1, -1]],
                                      "sampled_token_ids[0][0] = 99 is outside"),
                                     ([[11], [12], [0], [0]], [[7, 64], [9, 9], [-1, -1], [-1, -1]],
                                      "draft_token_ids[1] = 64 is outside")]:
        batch = decoding_batch(ASYNC_SPEC)
        before, mirror = batch.state.to_numpy(), batch.rows.copy()
        with pytest.raises(InvalidUpdateError, match=re.escape(message)):
            batch.record_with_prev_tokens(np.array([0, 1, -1, -1]), np.array(sampled), np.array([1, 1, 0, 0]),
                                          np.array(drafts))
        for name, value in batch.state.to_numpy().items():
            np.testing.assert_array_equal(value, before[name], err_msg=name)
        np.testing.assert_array_equal(batch.rows.num_tokens, mirror.num_tokens)


def test_device_draft_proposals_outside_the_vocabulary_set_a_bit_and_become_placeholders():
    """Read-free: a proposal outside [-1, vocab_size) is kept as -1 (never accepted) and flags
    ``draft_token_id``; a last sampled token outside the vocabulary is kept as 0. Control: good ids pass."""
    for drafts, sampled, stored, bits in [
        ([[7, 64], [-1, 9]], [[5], [6]], [[7, -1], [-1, 9]], {"draft_token_id"}),
        ([[7, 8], [-1, 9]], [[5], [99]], [[7, 8], [-1, 9]], {"sampled_token_id"}),
        ([[7, 8], [-1, 9]], [[5], [6]], [[7, 8], [-1, 9]], set()),
    ]:
        batch = ServingBatch(ASYNC_SPEC)
        with jax.transfer_guard_device_to_host("disallow"):
            batch.record_prev_tokens(jnp.array([0, 1]), jnp.array(sampled), jnp.array([1, 1]), jnp.array(drafts))
        np.testing.assert_array_equal(np.asarray(batch.state.batch.prev_draft_token_ids)[:2], stored)
        prev = np.asarray(batch.state.batch.prev_sampled_token_ids)[:2]
        np.testing.assert_array_equal(prev, [5, 0 if sampled[1][0] >= VOCAB else sampled[1][0]])
        assert {name for name, on in batch.errors().items() if on} == bits
