"""The vLLM door in a few lines: `VllmAdapter.from_vllm` reads every size from vLLM 0.33.0's own config
objects, `VllmAdapter.take_sampled` records a step's samples and hands vLLM its ``ModelRunnerOutput``, and the
mistakes of a door written by hand are named (the feature a call needs, a block size that disagrees with
vLLM's, a step whose samples were never recorded).

vLLM's real ``Scheduler`` drives the guide's loop over the workloads of tests/support/vllm_scheduler.py; the
"model" predicts "last token + 1", so every request's output is known in advance and a wrong token, slot or
record would show in it. The mistakes are shown on hand-written outputs with vLLM's field names (as in
tests/serving/test_vllm_adapter.py) where no scheduler is needed.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from serving.test_vllm_adapter import new_req, scheduler_output

import jaxprep
from jaxprep.serving import AdapterUsageError, ServingConfig, VllmAdapter, serving_config_from_vllm

pytest.importorskip("vllm")
from support.vllm_scheduler import VOCAB_SIZE, WORKLOADS, Requests, kv_cache_config, make_scheduler, vllm_config

BY_NAME = {work.name: work for work in WORKLOADS}


@pytest.mark.parametrize("work", WORKLOADS, ids=[work.name for work in WORKLOADS])
def test_from_vllm_reads_every_size_from_vllms_config(work):
    """Each setting as the workload gave it to vLLM (read from the workload, not from vLLM's attributes)."""
    config = serving_config_from_vllm(vllm_config(work), kv_cache_config(work))
    prep, features = config.prep, config.prep.features
    assert (prep.max_num_reqs, prep.max_model_len, prep.max_num_batched_tokens, prep.block_size, prep.num_blocks) == (
        work.max_num_seqs, work.max_model_len, work.max_num_batched_tokens, work.block_size, work.num_blocks)
    assert config.vocab_size == VOCAB_SIZE and features.discard_request_mask
    assert features.num_speculative_tokens == work.num_speculative_tokens
    assert features.speculative_method == (work.spec_method if work.num_speculative_tokens else None)
    assert features.async_tokens == (work.async_scheduling and work.num_speculative_tokens > 0)
    windows = [(group.block_size, group.sliding_window, group.num_blocks) for group in features.kv_groups]
    assert windows == ([(work.block_size, None, work.num_blocks), (work.block_size, work.sliding_window,
                                                                   work.num_blocks)] if work.sliding_window else [])
    assert (features.lora.max_loras if features.lora is not None else 0) == work.num_loras
    adapter = VllmAdapter.from_vllm(vllm_config(work), kv_cache_config(work))
    assert adapter.async_scheduling == work.async_scheduling


def test_from_vllm_keeps_the_callers_other_features_and_refuses_a_contradiction():
    work = BY_NAME["n-gram spec decode"]
    config = serving_config_from_vllm(vllm_config(work), kv_cache_config(work), token_buckets=(16, 48),
                                      features=jaxprep.FeatureConfig(structured_outputs=True))
    assert config.prep.features.structured_outputs and config.prep.token_buckets == (16, 48)
    with pytest.raises(AdapterUsageError, match=r"FeatureConfig.num_speculative_tokens=3 disagrees with vLLM's "
                                                r"configuration, which gives 2"):
        serving_config_from_vllm(vllm_config(work), kv_cache_config(work),
                                 features=jaxprep.FeatureConfig(num_speculative_tokens=3))


def test_a_kind_of_kv_cache_group_the_door_does_not_read_is_named():
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    work = WORKLOADS[0]
    spec = ChunkedLocalAttentionSpec(block_size=8, num_kv_heads=1, head_size=32, dtype=torch.float32,
                                     attention_chunk_size=64)
    groups = [*kv_cache_config(work).kv_cache_groups, KVCacheGroupSpec(["local"], spec)]
    with pytest.raises(AdapterUsageError, match=r"kv_cache_groups\[1\] is a ChunkedLocalAttentionSpec"):
        serving_config_from_vllm(vllm_config(work), KVCacheConfig(work.num_blocks, [], groups))


@pytest.mark.parametrize("name", ["chunked prefill, preemption", "full + sliding window, LoRA"])
def test_the_guides_loop_serves_vllms_scheduler(name):
    """The guide's loop, four lines of jaxprep, over vLLM's real scheduler: chunked prefill and preemption by
    recompute, or two KV-cache groups (a sliding window) with LoRA requests and prefix caching. Every output
    is "last token + 1" onwards, so a wrong input id, position, slot or record shows. (A step with no
    inputs, which vLLM sends to report finished requests, goes through the same lines: the test below.)"""
    work = dataclasses.replace(BY_NAME[name], arrivals_per_step=3)
    scheduler, made, requests = make_scheduler(work), Requests(work), []
    adapter = VllmAdapter.from_vllm(scheduler.vllm_config, scheduler.kv_cache_config,
                                    token_buckets=(16, work.max_num_batched_tokens))  # two compiles
    counts = dict(steps=0, preempted=0)
    for number in range(400):
        for request in made.arrivals(number):
            requests.append(request)
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests() and made.made == work.num_requests:
            break
        output = scheduler.schedule()
        step = adapter.step(output)
        tokens = None if step.inputs is None else (step.inputs.input_ids[step.inputs.logits_indices] + 1) % VOCAB_SIZE
        scheduler.update_from_output(output, adapter.take_sampled(step, tokens))
        counts["steps"] += 1
        counts["preempted"] += len(output.preempted_req_ids or ())
    assert len(requests) == work.num_requests and not scheduler.has_unfinished_requests(), counts
    for request in requests:
        last = request.prompt_token_ids[-1]
        expected = [(last + k) % VOCAB_SIZE for k in range(1, request.max_tokens + 1)]
        assert list(request.output_token_ids) == expected, (request.request_id, counts)
    if name.startswith("chunked"):
        assert counts["preempted"] > 0, counts
    assert not any(adapter.batch.errors().values())


# --- the mistakes of a hand-written door, named --------------------------------------------------------------

def hand_config(block_size=4, features=None) -> ServingConfig:
    prep = jaxprep.PrepConfig(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=32, block_size=block_size,
                              num_blocks=64, features=features or jaxprep.FeatureConfig(), token_buckets=(32,))
    return ServingConfig(prep=prep, vocab_size=100)


def test_take_sampled_without_the_discard_mask_names_the_feature():
    """Before: ``~inputs.discard_request_mask`` in the user's loop, ``TypeError: bad operand type for unary ~:
    'NoneType'``. Now the call names the switch; with it, a partial prefill chunk samples nothing."""
    adapter = VllmAdapter(hand_config())
    step = adapter.step(scheduler_output({"a": 3}, new=[new_req("a", range(1, 7), [[1, 2]])]))
    with pytest.raises(AdapterUsageError, match=r"needs FeatureConfig\(discard_request_mask=True\)"):
        adapter.take_sampled(step, jnp.full(8, 5, jnp.int32))
    adapter = VllmAdapter(hand_config(features=jaxprep.FeatureConfig(discard_request_mask=True)))
    step = adapter.step(scheduler_output({"a": 3, "b": 2}, new=[new_req("a", range(1, 7), [[1, 2]]),
                                                                 new_req("b", [8, 9], [[3]])]))
    output = adapter.take_sampled(step, jnp.asarray([5, 6, 0, 0, 0, 0, 0, 0], jnp.int32))
    assert output.req_ids == ["a", "b"] and output.sampled_token_ids == [[], [6]]  # a's chunk stops short: none


def test_take_sampled_counts_a_spec_decode_rows_accepted_tokens():
    """``[R_pad, 1 + K]`` with -1 after each row's accepted tokens, as vLLM's rejection sampler writes them."""
    adapter = VllmAdapter(hand_config(features=jaxprep.FeatureConfig(discard_request_mask=True,
                                                                     num_speculative_tokens=2)))
    step = adapter.step(scheduler_output({"a": 2, "b": 2}, new=[new_req("a", [1, 2], [[1]]),
                                                                 new_req("b", [3, 4], [[2]])]))
    sampled = np.full((8, 3), -1, np.int32)
    sampled[:2] = [[7, 8, -1], [9, -1, -1]]
    assert adapter.take_sampled(step, jnp.asarray(sampled)).sampled_token_ids == [[7, 8], [9]]


@pytest.mark.parametrize("blocks, jaxprep_size, message", [
    ([[1, 2]], 8, r"19 tokens in 2 blocks of KV-cache group 0; at PrepConfig.block_size=8 needs 3: vLLM's block "
                  r"size is larger than jaxprep's"),
    ([[1, 2, 3]], 32, r"19 tokens in 3 blocks of KV-cache group 0; at PrepConfig.block_size=32 its longest "
                      r"sequence \(24 tokens\) needs at most 1: vLLM's block size is smaller than jaxprep's"),
])
def test_a_block_size_that_disagrees_with_vllms_is_named(blocks, jaxprep_size, message):
    """Before: "blocks of block_table needed by num_computed_tokens + num_scheduled_tokens at row 0 is 3,
    which exceeds the row's allocated blocks" (larger), or slots silently in the wrong blocks (smaller)."""
    adapter = VllmAdapter(hand_config(block_size=jaxprep_size))
    request = new_req("r0", range(1, 20), blocks)
    request.sampling_params = _max_tokens(4)
    with pytest.raises(AdapterUsageError, match=message):
        adapter.step(scheduler_output({"r0": 19}, new=[request]))
    assert adapter.rows == {}  # nothing taken


def test_a_step_whose_samples_were_not_recorded_is_named():
    """Before: "num_computed_tokens + num_scheduled_tokens at row 0 is 20, which passes the row's num_tokens +
    num_draft_tokens (tokens not known yet)". Control: recorded, the same step is taken."""
    adapter = VllmAdapter(hand_config(features=jaxprep.FeatureConfig(discard_request_mask=True)))
    first = adapter.step(scheduler_output({"a": 3}, new=[new_req("a", [1, 2, 3], [[1, 2]])]))
    decode = scheduler_output({"a": 1}, cached=[("a", 3, None)])
    with pytest.raises(AdapterUsageError, match=r"the last step's sampled tokens were never recorded: .* call "
                                                r"adapter.take_sampled\(step, sampled_token_ids\)"):
        adapter.step(decode)
    adapter.take_sampled(first, jnp.full(8, 4, jnp.int32))
    assert np.asarray(adapter.step(decode).inputs.input_ids)[0] == 4


def test_a_step_with_no_inputs_takes_none():
    adapter = VllmAdapter(hand_config(features=jaxprep.FeatureConfig(discard_request_mask=True)))
    step = adapter.step(scheduler_output({}))
    assert step.inputs is None
    output = adapter.take_sampled(step, None)
    assert output.req_ids == [] and output.sampled_token_ids == []
    with pytest.raises(AdapterUsageError, match="scheduled nothing"):
        adapter.take_sampled(step, jnp.zeros(8, jnp.int32))


def _max_tokens(n: int):
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n)
