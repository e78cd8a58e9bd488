"""Async scheduling (`jaxprep.serving.host.overlap`): the host schedules step N+1 before it reads step N's
tokens, and every request's greedy output is the synchronous loop's; a stop wastes at most one step."""

from __future__ import annotations

import dataclasses

import pytest

from jaxprep.serving import Engine, Request, check_against_dense, random_workload
from jaxprep.serving.host.overlap import AsyncEngine
from support.loop_workloads import MODEL, WORKLOADS, make_config


def serve(engine_type, config, workload, seed):
    engine = engine_type(config, MODEL, seed=seed)
    requests = [dataclasses.replace(r, output_token_ids=[]) for r in workload.requests]  # each engine its own
    engine.submit(requests, workload.arrival_steps)
    return engine, {r.request_id: r.output_token_ids for r in engine.run()}


@pytest.mark.parametrize("name", WORKLOADS)
def test_async_outputs_equal_the_synchronous_loop(name):
    config_args, workload_args = WORKLOADS[name]
    config = make_config(**config_args)
    for seed in range(2):
        workload = random_workload(seed, num_requests=16, vocab_size=MODEL.vocab_size, arrival_spread=10,
                                   **workload_args)
        _, sync = serve(Engine, config, workload, seed)
        engine, overlapped = serve(AsyncEngine, config, workload, seed)
        assert overlapped == sync and len(sync) == 16
        assert engine.stats.multi_step_dispatches == 0 and not engine.has_unfinished
        finished = engine.finished
        assert check_against_dense(engine.params, MODEL, finished, config.max_model_len).passed
        assert all(r.num_output_placeholders == 0 for r in finished)


def test_an_eos_stop_wastes_one_step_and_a_length_stop_none():
    """One request decoding alone: at EOS the step already dispatched runs once more (its token is
    discarded); at max_tokens the host schedules nothing past the stop."""
    config = make_config(budget=8, block_size=4, num_blocks=16, max_num_reqs=2, max_model_len=32, decode_steps=1,
                         eos=-1)
    sync_engine, sync = serve(Engine, config, _one(max_tokens=12), seed=0)
    output = sync[0]
    engine, tokens = serve(AsyncEngine, config, _one(max_tokens=12), seed=0)
    assert tokens[0] == output and engine.stats.dispatches == sync_engine.stats.dispatches == 12  # length stop
    eos = output[4]  # stop where this id first appears: sync runs that many steps, async one more
    eos_config = dataclasses.replace(config, eos_token_id=eos)
    first = output.index(eos) + 1
    sync_engine, sync = serve(Engine, eos_config, _one(max_tokens=12), seed=0)
    engine, tokens = serve(AsyncEngine, eos_config, _one(max_tokens=12), seed=0)
    assert tokens[0] == sync[0] == output[:first]
    assert engine.stats.dispatches == sync_engine.stats.dispatches + 1 == first + 1


def _one(max_tokens):
    from jaxprep.serving import Workload

    return Workload(requests=(Request(0, [5, 6, 7], max_tokens=max_tokens),), arrival_steps=(0,))


def test_async_engine_refuses_speculative_decoding():
    """The host cannot predict how many drafts a row keeps, so it cannot schedule ahead of them."""
    config = dataclasses.replace(make_config(**WORKLOADS[next(iter(WORKLOADS))][0]), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be 0, got 2"):
        AsyncEngine(config, None)
