"""``Engine(..., separate_updates=True)``: each step's updates applied in dispatches of their own, then the step
without them (`step.run_step`). The tokens are the fused loop's on every workload of the loop tests (chunked
prefill, preemption, multi-step decode, odd sizes), with speculative decoding too, and the dense model's; the
warm-up compiles one step per bucket and nothing compiles after it. Negative control: the same comparison
against an engine with other weights fails."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from jaxprep.compilation import count_compiles
from jaxprep.serving import Engine, check_against_dense, random_workload
from jaxprep.serving.host import batch as batch_module
from jaxprep.serving.spec_decode.ngram import NgramConfig
from jaxprep.serving.update_packing import step_payload_buckets
from support.loop_workloads import MODEL, WORKLOADS, make_config
from support.run_keys import recording_run


def served(config, workload, *, separate: bool, seed: int = 0) -> tuple[Engine, dict, int]:
    """The engine after the workload, each request's tokens, and what compiled after its warm-up."""
    engine = Engine(config, MODEL, seed=seed, separate_updates=separate)
    engine.warmup()
    engine.submit(copy.deepcopy(workload.requests), workload.arrival_steps)
    with count_compiles() as compiles:
        finished = engine.run()
    assert len(finished) == len(workload.requests)
    return engine, {request.request_id: request.output_token_ids for request in finished}, compiles.compiles


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_tokens_are_the_fused_loops(name, monkeypatch):
    config_args, workload_args = WORKLOADS[name]
    config = make_config(**config_args)
    workload = random_workload(3, num_requests=10, vocab_size=MODEL.vocab_size, arrival_spread=6, **workload_args)
    _, fused, _ = served(config, workload, separate=False)
    keys = []
    monkeypatch.setattr(batch_module, "run", recording_run(keys))
    engine, separate, compiled = served(config, workload, separate=True)
    assert separate == fused
    assert compiled == 0
    # decode steps' buffers (no row finished, added or resumed: `update_packing.is_steady`) went to the steady
    # `apply_packed`, unwidened, the others to the general one after a widening; all compiled by the warm-up
    applied = [i for i, key in enumerate(keys) if key[0] == "apply"]
    assert {keys[i][:2] for i in applied} == {("apply", False), ("apply", True)}
    assert all(keys[i - 1][0] != "widen" for i in applied if keys[i][1] and i)
    assert any(keys[i - 1][0] == "widen" for i in applied if not keys[i][1])
    assert all(key in engine.batch.executables for key in keys)
    assert check_against_dense(engine.params, MODEL, engine.finished, config.max_model_len).passed
    if name == next(iter(WORKLOADS)):  # negative control (once): other weights give other tokens, and it is seen
        _, other, _ = served(config, workload, separate=True, seed=1)
        assert other != fused


def test_speculative_decoding_too():
    config_args, workload_args = WORKLOADS["multi-step"]
    config = dataclasses.replace(make_config(**config_args), num_speculative_tokens=2,
                                 ngram=NgramConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    workload = random_workload(1, num_requests=8, vocab_size=MODEL.vocab_size, arrival_spread=4, **workload_args)
    fused_engine, fused, _ = served(config, workload, separate=False)
    engine, separate, compiled = served(config, workload, separate=True)
    assert separate == fused and compiled == 0
    assert engine.stats.draft_tokens == fused_engine.stats.draft_tokens > 0
    assert engine.stats.accepted_draft_tokens == fused_engine.stats.accepted_draft_tokens


def test_seeded_sampling_and_penalties_too():
    """Every request's sampling parameters (written by the update) and its seeded draws: the same tokens."""
    from jaxprep import FeatureConfig, PrepConfig, SamplingConfig, SamplingParams
    from jaxprep.serving import Request, ServingConfig

    prep = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4, num_blocks=33,
                      features=FeatureConfig(sampling=SamplingConfig(vocab_size=MODEL.vocab_size)))
    config = ServingConfig(prep=prep, eos_token_id=-1, decode_steps=1)
    workload = random_workload(2, num_requests=8, vocab_size=MODEL.vocab_size, prompt_len=(3, 12),
                               max_tokens=(4, 10), arrival_spread=4)
    params = [SamplingParams(temperature=0.8 + 0.1 * (i % 3), top_k=5 if i % 2 else 0, seed=100 + i,
                             repetition_penalty=1.2 if i % 3 == 0 else 1.0) for i in range(8)]

    def requests():
        return [Request(r.request_id, list(r.prompt_token_ids), max_tokens=r.max_tokens, sampling_params=p)
                for r, p in zip(workload.requests, params)]

    outputs = {}
    for separate in (False, True):
        engine = Engine(config, MODEL, seed=0, separate_updates=separate)
        engine.submit(requests(), workload.arrival_steps)
        outputs[separate] = {r.request_id: r.output_token_ids for r in engine.run()}
    assert outputs[True] == outputs[False] and len(outputs[True]) == 8
    # negative control: other seeds draw other tokens, and the comparison sees it
    params = [dataclasses.replace(p, seed=p.seed + 1000) for p in params]
    engine = Engine(config, MODEL, seed=0, separate_updates=True)
    engine.submit(requests(), workload.arrival_steps)
    assert {r.request_id: r.output_token_ids for r in engine.run()} != outputs[False]


def test_the_warmup_compiles_one_step_per_bucket():
    config = make_config(**WORKLOADS["multi-step"][0])
    fused, separate = (Engine(config, MODEL, separate_updates=flag) for flag in (False, True))
    buckets = config.prep.reachable_buckets
    steps = [e.key for e in separate._warmup_executables() if e.key[0] == "run_step"]
    assert steps == [("run_step", MODEL, bucket) for bucket in reversed(buckets)]
    assert not [e for e in separate._warmup_executables() if e.key[0] == "serve_step"]
    assert separate.num_executables == len(list(separate._warmup_executables()))
    # and the steady updates' own program, which the fused engine does not compile
    steady = [("apply", True, words) for words in step_payload_buckets(config)]
    assert [e.key for e in separate._warmup_executables() if e.key[0] == "apply"] == [("apply", False), *steady]
    assert [e.key for e in fused._warmup_executables() if e.key[0] == "apply"] == [("apply", False)]
    serve = [e.key for e in fused._warmup_executables() if e.key[0] == "serve_step"]
    assert fused.num_executables == len(list(fused._warmup_executables()))
    assert fused.num_executables - separate.num_executables == len(serve) - len(buckets) - len(steady)
    for bucket in buckets:  # the fused step at the bucket's door rungs: the top step rung and at most one other
        rungs = [key[3] for key in serve if key[2] == bucket]
        assert 1 <= len(rungs) <= 2 and rungs[-1] == step_payload_buckets(config)[-1], (bucket, rungs)
    assert "without its updates" in separate.warmup_plan() and "without" not in fused.warmup_plan()
