"""The serving loop end to end: greedy tokens equal a dense recomputation across random workloads,
multi-step decode stops where it must, and 2,000 steps neither compile nor grow device memory."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxprep import PrepConfig, count_compiles
from jaxprep.serving import (
    NO_TOKEN,
    Engine,
    InvalidUpdateError,
    KVCache,
    ServingBatch,
    ServingConfig,
    StepUpdates,
    check_against_dense,
    dense_forward,
    init_params,
    random_workload,
)
from support.loop_workloads import EOS, MODEL, WORKLOADS, make_config


@pytest.mark.parametrize("name", WORKLOADS)
def test_greedy_tokens_match_dense_recomputation(name):
    config_args, workload_args = WORKLOADS[name]
    config = make_config(**config_args)
    totals = dict(preemptions=0, multi_step=0, chunked=0)
    for seed in range(3):
        workload = random_workload(seed, num_requests=16, vocab_size=MODEL.vocab_size, arrival_spread=10,
                                   **workload_args)
        engine = Engine(config, MODEL, seed=seed)
        engine.submit(workload.requests, workload.arrival_steps)
        finished = engine.run()
        assert len(finished) == len(workload.requests)
        check = check_against_dense(engine.params, MODEL, finished, config.max_model_len)
        assert check.passed, check
        totals["preemptions"] += engine.stats.preemptions
        totals["multi_step"] += engine.stats.multi_step_dispatches
        totals["chunked"] += sum(len(r.prompt_token_ids) > config.prep.max_num_batched_tokens for r in finished)
    if name in ("chunked+preempt", "tight cache"):
        assert totals["preemptions"] > 0
    if name in ("chunked+preempt", "odd sizes, max_model_len, K=1"):
        assert totals["chunked"] > 0
    if name == "multi-step":
        assert totals["multi_step"] > 0


def test_the_ragged_kernel_serves_the_same_greedy_tokens():
    """The loop with jaxprep's ragged attention kernel (Pallas' interpreter on CPU: the kernel inside the
    real `serve_step`, its layer loop and its decode iterations): every greedy token equals the dense
    recomputation, over chunked prefills, mixed batches and preemptions."""
    import dataclasses

    config = make_config(**WORKLOADS["tight cache"][0])
    model = dataclasses.replace(MODEL, attention="ragged")
    workload = random_workload(0, num_requests=6, vocab_size=MODEL.vocab_size, arrival_spread=4,
                               **WORKLOADS["tight cache"][1])
    engine = Engine(config, model, seed=0)
    engine.submit(workload.requests, workload.arrival_steps)
    finished = engine.run()
    assert len(finished) == len(workload.requests) and sum(len(r.output_token_ids) for r in finished) > 30
    check = check_against_dense(engine.params, MODEL, finished, config.max_model_len)
    assert check.passed, check


def test_updates_too_big_for_the_step_buffer_go_first():
    """Steps whose update passes the step's buffer (`step_payload_buckets`: here 64 words) send the
    rest first, through `transitions.apply_packed`; the outputs still equal the dense recomputation."""
    prep = PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=2, num_blocks=40)
    config = ServingConfig(prep=prep, eos_token_id=EOS, decode_steps=4)
    workload = random_workload(5, num_requests=12, vocab_size=MODEL.vocab_size, prompt_len=(10, 20),
                               max_tokens=(2, 10))
    engine = Engine(config, MODEL, seed=4)
    first_buffers = []
    pack = engine.batch.pack
    engine.batch.pack = lambda updates, *bucket: (lambda packed: (first_buffers.append(len(packed.before)),
                                                                   packed)[1])(pack(updates, *bucket))
    engine.submit(workload.requests)
    finished = engine.run()
    assert sum(first_buffers) > 0 and len(finished) == 12
    assert check_against_dense(engine.params, MODEL, finished, prep.max_model_len).passed


def test_two_thousand_steps_compile_nothing_and_keep_memory_flat():
    config = make_config(budget=16, block_size=4, num_blocks=24, max_num_reqs=4, max_model_len=48, decode_steps=4)
    workload = random_workload(11, num_requests=1000, vocab_size=MODEL.vocab_size, prompt_len=(1, 30),
                               max_tokens=(1, 16), arrival_spread=2400)
    engine = Engine(config, MODEL, seed=3)
    seen = []
    engine.warmup(on_compiled=lambda done, total, what: seen.append((done, total, what)))
    # the warm-up names each executable: every (bucket, update size) step and the updates alone at each size
    assert [done for done, _, _ in seen] == list(range(1, engine.num_executables + 1))
    assert {what for _, _, what in seen} >= {f"serving step at {b} tokens, updates of 64 words"
                                              for b in config.prep.token_buckets}
    assert engine.warmup_plan().startswith(f"the serving step at the {len(config.prep.token_buckets)} token buckets")
    engine.submit(workload.requests, workload.arrival_steps)
    engine.run(max_dispatches=20)
    before = _live_device_memory()
    with count_compiles() as compiles:
        engine.run(max_dispatches=2000)
    after = _live_device_memory()
    assert engine.stats.dispatches == 2020
    assert compiles.compiles == 0 and compiles.traces == 0
    assert after == before
    stats = engine.stats
    assert stats.preemptions > 0 and stats.multi_step_dispatches > 0 and stats.model_steps > 2020
    check = check_against_dense(engine.params, MODEL, engine.scheduler.finished, config.max_model_len)
    assert check.passed and check.num_requests > 100, check


def _live_device_memory() -> tuple[int, int]:
    arrays = jax.live_arrays()
    return len(arrays), sum(a.nbytes for a in arrays)


@functools.partial(jax.jit, static_argnames=("model",))
def _dense_logits(params, token_ids, model):
    return dense_forward(params, token_ids, model=model)


def dense_greedy(params, prompt, num_tokens, max_model_len):
    tokens = list(prompt)
    for _ in range(num_tokens):
        padded = np.zeros(max_model_len, np.int32)
        padded[: len(tokens)] = tokens
        tokens.append(int(np.argmax(np.asarray(_dense_logits(params, padded, MODEL))[len(tokens) - 1])))
    return tokens[len(prompt):]


def decode_once_then_multi(config, *, stop_len, num_blocks, prompt=(5, 6, 7)):
    """Prefill ``prompt`` in one step, then one multi-step dispatch of up to K decode iterations.
    Returns the tokens of both dispatches (iterations x row 0, -1 dropped) and the batch."""
    params = init_params(MODEL, seed=0)
    kv_cache = KVCache.zeros(MODEL, config.num_blocks, config.block_size)
    batch = ServingBatch(config)
    add = [dict(row=0, token_ids=prompt, stop_len=stop_len, block_ids=list(range(1, num_blocks + 1)))]
    first = StepUpdates.build(config, add=add, num_scheduled_tokens=[len(prompt), 0])
    kv_cache, tokens0 = batch.serve(kv_cache, params, first, model=MODEL, num_tokens_padded=8)
    multi = StepUpdates.build(config, num_scheduled_tokens=[1, 0], decode_steps=config.decode_steps)
    kv_cache, tokens1 = batch.serve(kv_cache, params, multi, model=MODEL, num_tokens_padded=8)
    assert (tokens0[1:] == NO_TOKEN).all() and (tokens0[0, 1:] == NO_TOKEN).all()
    column = [int(t) for t in np.concatenate([tokens0[:1, 0], tokens1[:, 0]]) if t != NO_TOKEN]
    return params, column, batch


def small_config(eos=-1):
    return make_config(budget=8, block_size=4, num_blocks=16, max_num_reqs=2, max_model_len=32, decode_steps=8,
                       eos=eos)


def test_multi_step_stops_at_max_tokens():
    params, tokens, batch = decode_once_then_multi(small_config(), stop_len=7, num_blocks=4)
    assert tokens == dense_greedy(params, (5, 6, 7), 4, 32)  # 3 prompt tokens + 4 = stop_len
    assert batch.rows.num_tokens[0] == 7 and int(batch.state.num_tokens[0]) == 7


def test_multi_step_stops_at_block_capacity():
    """2 blocks of 4 hold positions 0..7: decoding stops once position 7 is computed (token 9 sampled)."""
    params, tokens, batch = decode_once_then_multi(small_config(), stop_len=32, num_blocks=2)
    assert tokens == dense_greedy(params, (5, 6, 7), 6, 32)
    assert int(batch.state.batch.num_computed_tokens[0]) == 8 == batch.rows.num_computed_tokens[0]


def test_multi_step_stops_at_eos():
    params = init_params(MODEL, seed=0)
    greedy = dense_greedy(params, (5, 6, 7), 8, 32)
    stop = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # first new token after 2 decodes
    _, tokens, _ = decode_once_then_multi(small_config(eos=greedy[stop]), stop_len=32, num_blocks=8)
    assert tokens == greedy[: stop + 1]


def test_multi_step_over_a_prefill_is_rejected_before_dispatch():
    config = small_config()
    batch = ServingBatch(config)
    kv_cache = KVCache.zeros(MODEL, config.num_blocks, config.block_size)
    state = batch.state
    add = [dict(row=0, token_ids=[5, 6, 7], stop_len=12, block_ids=[1, 2])]
    updates = StepUpdates.build(config, add=add, num_scheduled_tokens=[3, 0], decode_steps=4)
    with pytest.raises(InvalidUpdateError, match="decode its last token"):
        batch.serve(kv_cache, init_params(MODEL, seed=0), updates, model=MODEL, num_tokens_padded=8)
    assert batch.state is state and not state.num_tokens.is_deleted() and not kv_cache.k.is_deleted()
    assert not batch.rows.busy.any()
