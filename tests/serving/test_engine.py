"""`Engine`'s entry points: every bad submission raises naming the field, the index and the bound,
with nothing queued; finished requests are handed out and forgotten; nothing grows per dispatch."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from jaxprep import PrepConfig
from jaxprep.serving import (
    AddRequests,
    AppendBlocks,
    Engine,
    InvalidUpdateError,
    ModelConfig,
    Request,
    ServingBatch,
    ServingConfig,
    random_workload,
)
from jaxprep.serving.state import FinishRequests, Schedule, StepUpdates

MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, d_ff=64)
CONFIG = ServingConfig(prep=PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                                       num_blocks=24), eos_token_id=1, decode_steps=4)


def engine_state(engine: Engine):
    """Everything a rejected submission must leave as it was."""
    return (list(engine._arrivals), set(engine._live_ids), [len(s.waiting) for s in engine.schedulers],
            engine.has_unfinished)


BAD_SUBMISSIONS = {
    "fewer arrival steps": (lambda: [Request(0, [2, 3], 2), Request(1, [2], 2), Request(2, [4], 2)], [0],
                            "3 requests but 1 arrival_steps"),
    "negative arrival step": (lambda: [Request(0, [2, 3], 2)], [-1], "arrival_steps[0] = -1 must be >= 0"),
    "id 2**40 (int32 would store 0)": (lambda: [Request(7, [5, 2**40], 2)], None,
                                       "request 7: prompt_token_ids[1] = 1099511627776 is outside [0, vocab_size=64)"),
    "id at vocab_size": (lambda: [Request(0, [2, 3], 2), Request(8, [2, 3, 64], 2)], None,
                         "request 8: prompt_token_ids[2] = 64 is outside [0, vocab_size=64)"),
    "negative id": (lambda: [Request(9, [-1], 2)], None, "request 9: prompt_token_ids[0] = -1 is outside"),
    "float id": (lambda: [Request(9, [2.5], 2)], None, "prompt_token_ids[0] = 2.5 is not an integer token id"),
    "repeated id": (lambda: [Request(3, [2], 2), Request(3, [4], 2)], None,
                    "requests[1] has request_id 3, which is already submitted"),
    "prompt too long": (lambda: [Request(4, [2] * 32, 2)], None,
                        "prompt of 32 tokens must lie in [1, max_model_len=32)"),
    # types and states: each used to be queued and then fail inside the loop, or raise a raw TypeError
    "max_tokens 2.5": (lambda: [Request(10, [2, 3], 2.5)], None, "request 10: max_tokens = 2.5 must be an integer"),
    "max_tokens None": (lambda: [Request(10, [2, 3], None)], None, "request 10: max_tokens = None must be an integer"),
    "max_tokens True": (lambda: [Request(10, [2, 3], True)], None, "max_tokens = True must be an integer, not a bool"),
    "max_tokens -3": (lambda: [Request(10, [2, 3], -3)], None, "request 10: max_tokens = -3 must be >= 1"),
    "unhashable id": (lambda: [Request([1], [2, 3], 2)], None, "request_id [1] must be hashable"),
    "arrival step 2.5": (lambda: [Request(11, [2, 3], 2)], [2.5], "arrival_steps[0] = 2.5 must be an integer"),
    "arrival step None": (lambda: [Request(11, [2, 3], 2)], [None], "arrival_steps[0] = None must be an integer"),
    "prompt as an array": (lambda: [Request(12, np.array([2, 3]), 2)], None,
                           "request 12: prompt_token_ids must be a list of ints, got ndarray"),
    "sampling_params a dict": (lambda: [Request(13, [2, 3], 2, sampling_params={"temperature": 0})], None,
                               "request 13: sampling_params must be None (greedy) or a jaxprep.SamplingParams"),
    "a request already run": (lambda: [Request(14, [2, 3], 2, output_token_ids=[5])], None,
                              "request 14: output_token_ids=[5] must be []"),
    "one request, not a list": (lambda: Request(15, [2, 3], 2), None, "takes a list of requests"),
}


@pytest.mark.parametrize("name", BAD_SUBMISSIONS)
def test_bad_submission_raises_and_queues_nothing(name):
    requests, arrival_steps, message = BAD_SUBMISSIONS[name]
    engine = Engine(CONFIG, MODEL)
    engine.submit([Request(100, [2, 3, 4], 3)], [2])  # one queued already: it must stay alone
    before = engine_state(engine)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.submit(requests(), arrival_steps)
    assert engine_state(engine) == before
    assert [r.request_id for r in engine.run()] == [100]


def test_a_live_id_is_rejected_until_its_request_finishes():
    engine = Engine(CONFIG, MODEL)
    engine.submit([Request(5, [2, 3], 2)])
    with pytest.raises(ValueError, match="request_id 5, which is already submitted and not finished"):
        engine.submit([Request(5, [4], 1)], [3])
    engine.run(max_dispatches=1)  # admitted and running: still live
    with pytest.raises(ValueError, match="request_id 5"):
        engine.submit([Request(5, [4], 1)])
    engine.run()
    assert [r.request_id for r in engine.drain_finished()] == [5]
    engine.submit([Request(5, [4], 1)])  # finished: the id is free again
    assert [len(r.output_token_ids) for r in engine.run()] == [1]


def test_vocab_size_comes_from_the_model_and_cannot_exceed_it():
    assert Engine(CONFIG, MODEL).config.vocab_size == 64
    assert Engine(dataclasses.replace(CONFIG, vocab_size=32), MODEL).config.vocab_size == 32
    with pytest.raises(ValueError, match="ServingConfig.vocab_size=65 exceeds the model's vocab_size=64"):
        Engine(dataclasses.replace(CONFIG, vocab_size=65), MODEL)
    with pytest.raises(ValueError, match="ServingConfig.vocab_size must be"):
        dataclasses.replace(CONFIG, vocab_size=0)


@pytest.mark.parametrize("name", ["max_new_reqs_per_step", "max_block_appends_per_step"])
def test_the_removed_per_step_caps_are_refused(name):
    """A step's update holds any number of admissions and blocks; the two caps that did nothing are gone, so
    passing one is a TypeError (the same config without it builds)."""
    with pytest.raises(TypeError, match=name):
        ServingConfig(prep=CONFIG.prep, **{name: 2})
    assert ServingConfig(prep=CONFIG.prep).prep == CONFIG.prep


def test_add_requests_payload_rejects_ids_outside_the_vocabulary():
    """`AddRequests.build` and `ServingBatch.add_requests` (a payload built without the bound) both check."""
    config = dataclasses.replace(CONFIG, vocab_size=64)
    with pytest.raises(ValueError, match=re.escape("AddRequests entry 0 (row 1): token_ids[2] = 64 is outside "
                                                   "[0, vocab_size=64)")):
        AddRequests.build(config, [dict(row=1, token_ids=[2, 3, 64], stop_len=8, block_ids=[1])])
    unbounded = AddRequests.build(CONFIG, [dict(row=1, token_ids=[2, 3, 64], stop_len=8, block_ids=[1])])
    batch = ServingBatch(config)
    state, mirror = batch.state, batch.rows.copy()
    with pytest.raises(InvalidUpdateError, match=re.escape("AddRequests entry 0 (row 1): token_ids[2] = 64 is outside "
                                                           "[0, vocab_size=64)")):
        batch.add_requests(unbounded)
    assert batch.state is state and not state.num_tokens.is_deleted()
    np.testing.assert_array_equal(batch.rows.num_tokens, mirror.num_tokens)


def test_drain_finished_hands_out_every_request_once_and_nothing_grows():
    workload = random_workload(4, num_requests=24, vocab_size=64, prompt_len=(1, 12), max_tokens=(1, 8),
                               arrival_spread=12)
    engine = Engine(CONFIG, MODEL)
    engine.submit(workload.requests, workload.arrival_steps)
    drained = []
    while engine.has_unfinished or engine._arrivals:
        engine.run(max_dispatches=5)
        drained += engine.drain_finished()
        assert engine.finished == []
    assert sorted(r.request_id for r in drained) == list(range(24))
    assert all(len(r.output_token_ids) >= 1 for r in drained)
    assert engine.drain_finished() == [] and engine._live_ids == set()
    assert engine.stats.dispatches > 5 and engine.stats.dispatches_log == [] and engine.stats.prep_us == []
    scheduler = engine.scheduler
    assert scheduler.finished == [] and not scheduler.waiting and not scheduler.running
    assert len(scheduler._free_rows) == CONFIG.max_num_reqs
    assert scheduler.allocator.num_free == CONFIG.num_blocks - 1


def _finished_tokens(engine: Engine) -> dict:
    return {r.request_id: list(r.output_token_ids) for r in engine.drain_finished()}


@pytest.mark.parametrize("bad", ["max tokens 2.5", "unhashable id", "arrival 2.5"])
def test_a_bad_submission_mid_run_changes_no_other_request(bad):
    """A workload runs with and without a bad submission in between: the bad one is refused, and
    every other request finishes with the same tokens (before the checks, max_tokens 2.5 was queued
    and wedged the engine after its first step)."""
    def workload():
        return random_workload(7, num_requests=10, vocab_size=64, prompt_len=(2, 12), max_tokens=(2, 6),
                               arrival_spread=4)

    clean, disturbed = Engine(CONFIG, MODEL), Engine(CONFIG, MODEL)
    for engine in (clean, disturbed):
        engine.submit(workload().requests, workload().arrival_steps)
        engine.run(max_dispatches=3)
    request, steps = {"max tokens 2.5": (Request(50, [2, 3, 4], 2.5), None),
                      "unhashable id": (Request({"id": 50}, [2, 3, 4], 3), None),
                      "arrival 2.5": (Request(50, [2, 3, 4], 3), [2.5])}[bad]
    with pytest.raises(ValueError, match="must be"):
        disturbed.submit([request], steps)
    for engine in (clean, disturbed):
        engine.run()
    expected = _finished_tokens(clean)
    assert sorted(expected) == list(range(10)) and all(expected.values())
    assert _finished_tokens(disturbed) == expected
    assert not disturbed.has_unfinished and disturbed._live_ids == set()


def test_the_comparison_of_outputs_sees_a_changed_request():
    """Negative control of the test above: a workload with one request's max_tokens changed finishes
    with different tokens, so the comparison can fail."""
    runs = []
    for max_tokens in (4, 5):
        engine = Engine(CONFIG, MODEL)
        workload = random_workload(7, num_requests=10, vocab_size=64, prompt_len=(2, 12), max_tokens=(2, 6),
                                   arrival_spread=4)
        requests = list(workload.requests)
        requests[3] = dataclasses.replace(requests[3], max_tokens=max_tokens)
        engine.submit(requests, workload.arrival_steps)
        engine.run()
        runs.append(_finished_tokens(engine))
    assert runs[0] != runs[1]


BAD_PAYLOADS = {  # built by hand: a count of 2.7 tokens was truncated to 2, row 2**32 + 1 wrapped to 1
    "Schedule 2.7 tokens": (lambda c: StepUpdates.build(c, num_scheduled_tokens=[2.7]),
                            "Schedule.num_scheduled_tokens must hold integers, got dtype float64"),
    "Schedule NaN drafts": (lambda c: Schedule.build(c, num_draft_tokens=[float("nan")]),
                            "Schedule.num_draft_tokens must hold integers, got dtype float64"),
    "Schedule bool counts": (lambda c: Schedule.build(c, num_scheduled_tokens=[True, False]),
                             "Schedule.num_scheduled_tokens must hold integers, got dtype bool"),
    "finish row 2**32 + 1": (lambda c: FinishRequests.build(c, [2**32 + 1]),
                             "FinishRequests.rows[0] = 4294967297 is outside int32"),
    "decode_steps 1.5": (lambda c: StepUpdates.build(c, decode_steps=1.5),
                         "StepUpdates.decode_steps = 1.5 must be an integer"),
    "add stop_len 8.5": (lambda c: AddRequests.build(c, [dict(row=0, token_ids=[2], stop_len=8.5, block_ids=[1])]),
                         "AddRequests entry 0 (row 0): stop_len = 8.5 is not an integer"),
    "append row 0.5": (lambda c: AppendBlocks.build(c, {0.5: [3]}),
                       "AppendBlocks row 0.5: row = 0.5 is not an integer"),
}


@pytest.mark.parametrize("name", BAD_PAYLOADS)
def test_a_payload_with_a_fractional_count_is_rejected_not_truncated(name):
    build, message = BAD_PAYLOADS[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        build(CONFIG)


def test_a_hand_built_schedule_with_float_arrays_is_rejected_with_state_unchanged():
    """The dataclass built directly (no ``build``): `ServingBatch` checks every leaf before its own checks."""
    batch = ServingBatch(CONFIG)
    batch.add_requests(AddRequests.build(CONFIG, [dict(row=0, token_ids=[2, 3, 4, 5], stop_len=8, block_ids=[1])]))
    state, mirror = batch.state, batch.rows.copy()
    counts = np.zeros(CONFIG.max_num_reqs)
    counts[0] = 2.7
    schedule = dataclasses.replace(Schedule.build(CONFIG), num_scheduled_tokens=counts)
    with pytest.raises(InvalidUpdateError,
                       match=re.escape("StepUpdates.schedule.num_scheduled_tokens[0] = 2.7 is not an integer")):
        batch.schedule(schedule)
    assert batch.state is state and not state.num_tokens.is_deleted()
    np.testing.assert_array_equal(batch.rows.num_scheduled_tokens, mirror.num_scheduled_tokens)
    counts[0] = 3.0  # an integral float is taken as the integer it is
    batch.schedule(dataclasses.replace(schedule, num_scheduled_tokens=counts))
    assert batch.rows.num_scheduled_tokens[0] == 3
