"""Speculative decoding in the serving loop: with greedy sampling every request's output is the
same with and without n-gram drafts (on the loop tests' random workloads), and a rejected draft rolls
back ``num_computed_tokens``, the token table and the next step's positions."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from jaxprep.serving import (
    Engine,
    KVCache,
    ServingBatch,
    StepUpdates,
    check_against_dense,
    init_params,
    random_workload,
    update_and_prepare,
)
from jaxprep.serving.spec_decode.ngram import NgramConfig
from jaxprep.serving.update_packing import pack_updates
from tests.serving.test_loop import MODEL, WORKLOADS, dense_greedy, make_config, small_config

LOOKUP = NgramConfig(prompt_lookup_min=1, prompt_lookup_max=3)


def _outputs(config, workload, seed):
    engine = Engine(config, MODEL, seed=seed)
    engine.submit(copy.deepcopy(workload.requests), workload.arrival_steps)
    finished = engine.run()
    assert len(finished) == len(workload.requests)
    return engine, {request.request_id: request.output_token_ids for request in finished}


@pytest.mark.parametrize("name, k", [(name, 3) for name in WORKLOADS] + [("odd sizes, max_model_len, K=1", 1)])
def test_greedy_outputs_are_identical_with_and_without_drafts(name, k):
    config_args, workload_args = WORKLOADS[name]
    plain = make_config(**config_args)
    spec = dataclasses.replace(plain, num_speculative_tokens=k, ngram=LOOKUP)
    drafts = accepted = 0
    for seed in range(2):
        workload = random_workload(seed, num_requests=12, vocab_size=MODEL.vocab_size, arrival_spread=10,
                                   **workload_args)
        _, expected = _outputs(plain, workload, seed)
        engine, outputs = _outputs(spec, workload, seed)
        assert outputs == expected
        assert check_against_dense(engine.params, MODEL, engine.finished, spec.max_model_len).passed
        drafts += engine.stats.draft_tokens
        accepted += engine.stats.accepted_draft_tokens
    assert 0 < accepted < drafts  # drafts were both kept and rejected


def _prefilled(config, prompt=(5, 6, 7)):
    params = init_params(MODEL, seed=0)
    kv_cache = KVCache.zeros(MODEL, config.num_blocks, config.block_size)
    batch = ServingBatch(config)
    add = [dict(row=0, token_ids=prompt, stop_len=20, block_ids=[1, 2, 3, 4])]
    kv_cache, _ = batch.serve(kv_cache, params, StepUpdates.build(config, add=add, num_scheduled_tokens=[3, 0]),
                              model=MODEL, num_tokens_padded=8)
    return params, kv_cache, batch


def test_a_rejected_draft_rolls_back_the_row():
    """Prompt [5, 6, 7] -> greedy g0; then drafts [g1, wrong, g1] after g0: g1 is kept, the argmax
    g2 replaces the wrong draft, the third draft is dropped."""
    config = dataclasses.replace(small_config(), num_speculative_tokens=3)
    params, kv_cache, batch = _prefilled(config)
    g0, g1, g2 = dense_greedy(params, (5, 6, 7), 3, 32)
    wrong = (g2 + 1) % MODEL.vocab_size
    drafts = np.zeros((2, 3), np.int32)
    drafts[0] = [g1, wrong, g1]
    updates = StepUpdates.build(config, num_scheduled_tokens=[4, 0], num_draft_tokens=[3, 0], draft_token_ids=drafts)
    kv_cache, tokens = batch.serve(kv_cache, params, updates, model=MODEL, num_tokens_padded=8)
    assert tokens[:4, 0].tolist() == [g1, g2, -1, -1]
    state = batch.state
    # 4 tokens known before (prompt + g0), 2 appended; computed: 3 + 4 run - 2 rejected (wrong, last draft)
    assert int(state.num_tokens[0]) == 6 == batch.rows.num_tokens[0]
    assert int(state.batch.num_computed_tokens[0]) == 5 == batch.rows.num_computed_tokens[0]
    assert np.asarray(state.batch.token_ids[0, :8]).tolist() == [5, 6, 7, g0, g1, g2, 0, 0]
    # the next step runs the last token at position 5, in the slot of block 2 (block size 4)
    step = StepUpdates.build(config, num_scheduled_tokens=[1, 0])
    inputs = update_and_prepare(state, pack_updates(step, config), config=config, num_tokens_padded=8)
    assert int(inputs.positions[0]) == 5 and int(inputs.attn_metadata.slot_mapping[0]) == 2 * 4 + 1
    assert int(inputs.input_ids[0]) == g2


def test_accepted_drafts_stop_at_eos():
    """An EOS among the accepted tokens ends the row there: the accepted draft after it is dropped."""
    params = init_params(MODEL, seed=0)
    prompt, greedy = next((p, g) for p in [(5, 6, 7), (9, 10, 11), (20, 3, 41), (2, 2, 2)]
                          if (g := dense_greedy(params, p, 4, 32))[2] not in g[:2])
    config = dataclasses.replace(small_config(eos=greedy[2]), num_speculative_tokens=3)
    params, kv_cache, batch = _prefilled(config, prompt)
    drafts = np.zeros((2, 3), np.int32)
    drafts[0] = greedy[1:4]  # all three would be accepted
    updates = StepUpdates.build(config, num_scheduled_tokens=[4, 0], num_draft_tokens=[3, 0], draft_token_ids=drafts)
    kv_cache, tokens = batch.serve(kv_cache, params, updates, model=MODEL, num_tokens_padded=8)
    assert tokens[:4, 0].tolist() == [greedy[1], greedy[2], -1, -1]
    assert int(batch.state.num_tokens[0]) == 6 == batch.rows.num_tokens[0]
