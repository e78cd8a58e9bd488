"""The host scheduler: token budget, running-first order, chunked prefill, the block free list and
preemption by recompute. A fake device samples token 7 wherever a real one would sample."""

from __future__ import annotations

import numpy as np
import pytest

from jaxprep import PrepConfig
from jaxprep.config import cdiv
from jaxprep.serving import BlockAllocator, Request, Scheduler, ServingConfig
from jaxprep.serving.host.scheduler import Status


def make_config(*, budget=8, block_size=4, num_blocks=64, max_num_reqs=4, max_model_len=64, decode_steps=1):
    prep = PrepConfig(max_num_reqs=max_num_reqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                      block_size=block_size, num_blocks=num_blocks)
    return ServingConfig(prep=prep, decode_steps=decode_steps)


def fake_step(scheduler: Scheduler, out) -> np.ndarray:
    """Tokens a device would append: 7 where the scheduled tokens reach the end of the known ones."""
    tokens = np.full((scheduler.config.decode_steps, scheduler.config.max_num_reqs), -1, np.int32)
    for request in scheduler.running:
        scheduled = out.num_scheduled_tokens[request.row]
        if scheduled and request.num_computed_tokens + scheduled >= request.num_tokens:
            tokens[0, request.row] = 7
    return tokens


def check_invariants(scheduler: Scheduler, out) -> None:
    config = scheduler.config
    assert out.total_num_scheduled_tokens <= config.prep.max_num_batched_tokens
    held = [block for request in scheduler.running for block in request.block_ids]
    assert 0 not in held and len(held) == len(set(held))
    assert len(held) + scheduler.allocator.num_free == config.num_blocks - 1
    rows = [request.row for request in scheduler.running]
    assert len(rows) == len(set(rows)) and all(0 <= row < config.max_num_reqs for row in rows)
    for request in scheduler.running:
        scheduled = int(out.num_scheduled_tokens[request.row])
        assert request.num_computed_tokens + scheduled <= request.num_tokens
        assert cdiv(request.num_computed_tokens + scheduled, config.block_size) <= len(request.block_ids)
    for request in scheduler.waiting:
        assert request.row == -1 and request.block_ids == [] and request.num_computed_tokens == 0


def test_allocator_never_hands_out_the_null_block():
    allocator = BlockAllocator(num_blocks=9)
    blocks = allocator.allocate(3) + allocator.allocate(5)
    assert sorted(blocks) == list(range(1, 9)) and allocator.num_free == 0
    with pytest.raises(RuntimeError, match="1 blocks, 0 free"):
        allocator.allocate(1)
    allocator.free(blocks[:2])
    assert allocator.num_free == 2 and 0 not in allocator.allocate(2)


def test_running_first_with_chunked_prefill():
    """Budget 8: a 20-token prompt is prefilled in chunks 8, 8, 4, and the short one waits for budget."""
    scheduler = Scheduler(make_config(budget=8))
    long, short = Request(0, list(range(2, 22)), max_tokens=2), Request(1, [2, 3, 4], max_tokens=2)
    scheduler.add_request(long)
    scheduler.add_request(short)
    seen = []
    for _ in range(3):
        out = scheduler.schedule()
        check_invariants(scheduler, out)
        seen.append((int(out.num_scheduled_tokens[0]), int(out.num_scheduled_tokens[1])))
        scheduler.update(out, fake_step(scheduler, out), eos_token_id=-1)
    assert seen == [(8, 0), (8, 0), (4, 3)]
    assert long.output_token_ids == [7] and short.output_token_ids == [7]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens[:2].tolist() == [1, 1]  # both decode


def test_preemption_by_recompute():
    """4 allocatable blocks of 2 tokens: the later request is preempted, then recomputed from scratch."""
    scheduler = Scheduler(make_config(budget=16, block_size=2, num_blocks=5))
    first, second = Request(0, [2, 3, 4], max_tokens=4), Request(1, [5, 6, 7], max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted_row, resumed_checked = None, False
    for _ in range(30):
        if not scheduler.has_unfinished:
            break
        out = scheduler.schedule()
        check_invariants(scheduler, out)
        if out.num_preempted:
            assert second.status is Status.WAITING and second.num_computed_tokens == 0
            assert scheduler.waiting[0] is second
            preempted_row = out.finished_rows[-1]
        if preempted_row is not None and out.new_requests:
            resumed = out.new_requests[0]
            assert resumed["token_ids"] == second.prompt_token_ids + second.output_token_ids
            assert len(second.output_token_ids) > 0  # its outputs are recomputed as prefill
            preempted_row, resumed_checked = None, True
        scheduler.update(out, fake_step(scheduler, out), eos_token_id=-1)
    assert second.num_preemptions >= 1 and resumed_checked
    assert [r.output_token_ids for r in (first, second)] == [[7] * 4, [7] * 4]


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_keeps_invariants_and_finishes(seed):
    rng = np.random.default_rng(seed)
    config = make_config(budget=int(rng.integers(4, 20)), block_size=int(rng.choice([1, 2, 4, 8])),
                         num_blocks=int(rng.integers(20, 40)), max_num_reqs=4, max_model_len=32)
    scheduler = Scheduler(config)
    requests = [Request(i, rng.integers(2, 50, int(rng.integers(1, 20))).tolist(),
                        max_tokens=int(rng.integers(1, 14))) for i in range(12)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(2000):
        if not scheduler.has_unfinished:
            break
        out = scheduler.schedule()
        check_invariants(scheduler, out)
        scheduler.update(out, fake_step(scheduler, out), eos_token_id=-1)
    assert not scheduler.has_unfinished
    for request in requests:
        expected = min(request.max_tokens, config.max_model_len - len(request.prompt_token_ids))
        assert request.output_token_ids == [7] * expected


def test_multi_step_allocates_lookahead_blocks():
    """All decoding and nothing waiting: blocks for K more tokens (if free) and decode_steps K."""
    scheduler = Scheduler(make_config(budget=8, block_size=2, decode_steps=4))
    request = Request(0, [2, 3, 4], max_tokens=10)
    scheduler.add_request(request)
    out = scheduler.schedule()  # prefill
    assert out.decode_steps == 1
    scheduler.update(out, fake_step(scheduler, out), eos_token_id=-1)
    out = scheduler.schedule()  # decode position 3 .. 6 -> 7 positions -> 4 blocks
    assert out.decode_steps == 4 and len(request.block_ids) == 4


def test_rejects_requests_that_cannot_fit():
    scheduler = Scheduler(make_config(block_size=2, num_blocks=4, max_model_len=64))
    with pytest.raises(ValueError, match="may need 4 blocks"):
        scheduler.add_request(Request(0, [2] * 5, max_tokens=3))
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add_request(Request(1, [2] * 64, max_tokens=1))
