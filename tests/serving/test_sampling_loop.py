"""The serving loop with `FeatureConfig.sampling`: greedy outputs unchanged, seeded requests
reproducible whatever their neighbours, penalty bins kept on the device, stop token ids."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxprep import FeatureConfig, PrepConfig, SamplingConfig, SamplingParams
from jaxprep.serving import Engine, InvalidUpdateError, ModelConfig, ServingBatch, ServingConfig, random_workload
from jaxprep.serving.host.scheduler import Request
from jaxprep.serving.state import AddRequests, StepUpdates

MODEL = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=2, d_ff=64)
SAMPLING = FeatureConfig(sampling=SamplingConfig(vocab_size=MODEL.vocab_size))


def config(features=SAMPLING, *, decode_steps=4, num_blocks=24, eos=1) -> ServingConfig:
    prep = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=8, block_size=2,
                      num_blocks=num_blocks, features=features)
    return ServingConfig(prep=prep, eos_token_id=eos, decode_steps=decode_steps)


def outputs(config_, requests, arrivals=None, seed=0, max_dispatches=None) -> dict[int, list[int]]:
    engine = Engine(config_, MODEL, seed=seed)
    engine.submit(requests, arrivals)
    engine.run(max_dispatches)
    return {r.request_id: r.output_token_ids for r in engine.finished}, engine


def new(request: Request, **changes) -> Request:
    """An unserved copy of ``request`` (its id, prompt, max_tokens and sampling parameters), with ``changes``."""
    fields = dict(request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                  max_tokens=request.max_tokens, sampling_params=request.sampling_params)
    return Request(**{**fields, **changes})


def fresh(requests):
    return [new(r) for r in requests]


def test_greedy_outputs_are_unchanged_by_the_switch():
    """Same workload (chunked prefill, preemption, multi-step) with the switch off and on: equal tokens."""
    workload = random_workload(3, num_requests=12, vocab_size=MODEL.vocab_size, prompt_len=(1, 20),
                               max_tokens=(1, 12), arrival_spread=8)
    off, _ = outputs(config(FeatureConfig()), fresh(workload.requests), workload.arrival_steps)
    on, engine = outputs(config(), fresh(workload.requests), workload.arrival_steps)
    explicit = [new(r, sampling_params=SamplingParams.greedy()) for r in workload.requests]
    greedy, _ = outputs(config(), explicit, workload.arrival_steps)
    assert on == off == greedy
    assert engine.stats.preemptions > 0 and engine.stats.multi_step_dispatches > 0


def test_seeded_request_is_reproducible_whatever_its_neighbours():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.3)
    mine = Request(request_id=0, prompt_token_ids=[5, 9, 13, 2], max_tokens=12, sampling_params=params)
    alone, _ = outputs(config(eos=-1), [mine])
    for seed in (1, 2):
        workload = random_workload(seed, num_requests=8, vocab_size=MODEL.vocab_size, prompt_len=(1, 14),
                                   max_tokens=(2, 10), arrival_spread=4)
        others = [new(r, request_id=r.request_id + 1,
                      sampling_params=SamplingParams(temperature=0.8, seed=None if i % 2 else i))
                  for i, r in enumerate(workload.requests)]
        mixed, _ = outputs(config(eos=-1), [new(mine), *others], [seed, *workload.arrival_steps])
        assert mixed[0] == alone[0], seed
    assert len(set(alone[0])) > 3  # it did sample, not repeat one token


def test_unseeded_requests_differ_and_seeded_ones_repeat():
    prompt = [7, 8, 9]
    hot = SamplingParams(temperature=2.0)
    requests = [Request(request_id=i, prompt_token_ids=prompt, max_tokens=10, sampling_params=hot) for i in range(2)]
    got, _ = outputs(config(eos=-1), requests)
    assert got[0] != got[1]  # seeds drawn on the host at admission
    seeded = [new(r, sampling_params=dataclasses.replace(hot, seed=3)) for r in requests]
    got, _ = outputs(config(eos=-1), seeded)
    assert got[0] == got[1]


def test_output_bin_counts_follow_the_outputs_across_preemption():
    """Mid-run, every running request's device bins: prompt bits and counts of its outputs."""
    workload = random_workload(4, num_requests=10, vocab_size=MODEL.vocab_size, prompt_len=(4, 16),
                               max_tokens=(10, 16), arrival_spread=2)
    requests = [new(r, sampling_params=SamplingParams(temperature=1.0, repetition_penalty=1.3))
                for r in workload.requests]
    _, engine = outputs(config(num_blocks=20), requests, workload.arrival_steps, max_dispatches=14)
    assert engine.stats.preemptions > 0
    state = engine.batch.state.batch
    counts, mask = np.asarray(state.output_bin_counts), np.asarray(state.prompt_bin_mask).view(np.uint32)
    checked = 0
    for request in engine.scheduler.running:
        want = np.bincount(request.output_token_ids, minlength=MODEL.vocab_size)
        np.testing.assert_array_equal(counts[request.row], want, err_msg=str(request.request_id))
        bits = [(int(mask[request.row, t // 32]) >> (t % 32)) & 1 for t in range(MODEL.vocab_size)]
        assert [t for t in range(MODEL.vocab_size) if bits[t]] == sorted(set(request.prompt_token_ids))
        checked += 1
    assert checked > 0


def test_stop_token_ids_stop_the_request():
    request = Request(request_id=0, prompt_token_ids=[3, 4, 5], max_tokens=10)
    full, _ = outputs(config(eos=-1), [request])
    stop = full[0][3]
    first = full[0].index(stop)
    params = SamplingParams.greedy(stop_token_ids=(stop,))
    got, _ = outputs(config(eos=-1), [new(request, sampling_params=params)])
    assert got[0] == full[0][: first + 1]


def test_sampling_needs_the_switch():
    request = Request(request_id=0, prompt_token_ids=[3], max_tokens=2, sampling_params=SamplingParams())
    with pytest.raises(ValueError, match="needs FeatureConfig.sampling"):
        Engine(config(FeatureConfig()), MODEL).scheduler.add_request(request)


def test_bad_admission_payload_is_rejected_before_dispatch():
    serving = config()
    batch = ServingBatch(serving)
    add = AddRequests.build(serving, [dict(row=0, token_ids=[3, 4], stop_len=6, block_ids=[1],
                                           sampling=SamplingParams(temperature=0.5))])
    before = batch.state
    entry = add.entries[0]
    bad = dataclasses.replace(entry, sampling=dict(entry.sampling, top_p=1.5))  # a payload built by hand
    with pytest.raises(InvalidUpdateError, match=r"AddRequests.sampling.top_p at row 0 is 1.5, which is not in \(0, 1"):
        batch.add_requests(dataclasses.replace(add, entries=(bad,)))
    assert batch.state is before and not before.num_tokens.is_deleted()
    batch.apply_updates(StepUpdates.build(serving, add=[dict(row=0, token_ids=[3, 4], stop_len=6, block_ids=[1])]))
