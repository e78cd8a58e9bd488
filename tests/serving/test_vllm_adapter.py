"""`jaxprep.serving.host.vllm.VllmAdapter`: vLLM's scheduler output in, the step vLLM's own runner prepares out.

The parity test drives vLLM 0.33.0's real ``Scheduler`` / ``AsyncScheduler`` in a subprocess
(tests/support/vllm_adapter_worker.py) and compares every step with vLLM V1's ``_update_states`` +
``_prepare_inputs`` and, in V2 runner mode, with MRV2's input kernels (Triton's CPU interpreter).
The unit tests below feed hand-written scheduler outputs with vLLM's field names (`SimpleNamespace`
stand-ins of `vllm/v1/core/sched/output.py::SchedulerOutput`, so they run without vLLM) and check
issue 21's defects 1-6 through the adapter against worked examples.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprep
from jaxprep.serving import ServingConfig
from jaxprep.serving.host.vllm import VllmAdapter
from support.vllm_workers import worker_report

# --- scheduler outputs with vLLM's field names ---------------------------------------------------

def new_req(req_id, prompt, blocks, computed=0, prefill=None, lora_id=None):
    """`NewRequestData`: ``blocks`` one list per KV-cache group."""
    lora = None if lora_id is None else SimpleNamespace(lora_int_id=lora_id)
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(prompt), prefill_token_ids=prefill,
                           block_ids=tuple(blocks), num_computed_tokens=computed, sampling_params=None,
                           lora_request=lora)


def scheduler_output(scheduled, new=(), cached=(), drafts=None, finished=(), preempted=(), resumed=(),
                     all_token_ids=None):
    """`SchedulerOutput`; ``cached``: (req_id, num_computed_tokens, new block ids per group or None)."""
    cached_reqs = SimpleNamespace(req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached],
                                  new_block_ids=[c[2] for c in cached], resumed_req_ids=set(resumed),
                                  all_token_ids=all_token_ids or {})
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_reqs,
                           num_scheduled_tokens=dict(scheduled), total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens=drafts or {}, finished_req_ids=set(finished),
                           preempted_req_ids=set(preempted))


def config(features: jaxprep.FeatureConfig | None = None, max_model_len=32) -> ServingConfig:
    """Few distinct configurations (each one compiles): 8 rows, budget 32, block size 4."""
    features = jaxprep.FeatureConfig() if features is None else features
    prep = jaxprep.PrepConfig(max_num_reqs=8, max_model_len=max_model_len, max_num_batched_tokens=32,
                              block_size=4, num_blocks=64, features=features, token_buckets=(32,))
    return ServingConfig(prep=prep, vocab_size=100)


PLAIN = config(max_model_len=1024)
SPEC = config(jaxprep.FeatureConfig(num_speculative_tokens=2))
ASYNC_SPEC = config(jaxprep.FeatureConfig(num_speculative_tokens=2, async_tokens=True))


def record(adapter: VllmAdapter, step, sampled: dict, drafts: dict | None = None) -> None:
    """Samples (and, under async scheduling, the drafter's proposals) as device arrays in the step's batch
    order (nothing read back)."""
    rows = step.inputs.idx_mapping.shape[0]
    width = max(1, *(len(v) for v in sampled.values()))
    tokens, counts = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
    proposals = np.zeros((rows, 2), np.int32)
    for req_id, values in sampled.items():
        b = step.req_id_to_index[req_id]
        tokens[b, :len(values)], counts[b] = values, len(values)
        proposals[b] = (drafts or {}).get(req_id, [0, 0])
    adapter.record_sampled(jnp.asarray(tokens), jnp.asarray(counts), None if drafts is None else jnp.asarray(proposals))


def tokens_of(step, field="input_ids"):
    n = int(step.inputs.attn_metadata.num_actual_tokens)
    return np.asarray(getattr(step.inputs, field))[:n].tolist()


# --- issue 21's defects, through the adapter ---------------------------------------------------------

def test_draft_counts_and_ids_reach_prepare():
    """Defect 1: ``a`` decodes 7 with drafts [9, 10], ``b`` decodes 8: counts [2, 0], drafts in input_ids."""
    adapter = VllmAdapter(SPEC)
    step = adapter.step(scheduler_output({"a": 5, "b": 3}, new=[new_req("a", [1, 2, 3, 4, 5], [[1, 2]]),
                                                                 new_req("b", [11, 12, 13], [[3]])]))
    record(adapter, step, {"a": [7], "b": [8]})
    step = adapter.step(scheduler_output({"a": 3, "b": 1}, cached=[("a", 5, None), ("b", 3, None)],
                                         drafts={"a": [9, 10]}))
    spec = step.inputs.spec_decode
    assert step.req_ids == ["a", "b"]
    assert np.asarray(spec.num_draft_tokens)[:2].tolist() == [2, 0]
    assert np.asarray(spec.draft_token_ids)[:2].tolist() == [9, 10]
    assert tokens_of(step) == [7, 9, 10, 8]
    assert tokens_of(step, "positions") == [5, 6, 7, 3]
    # vLLM's scheduler states a's computed count after the drafts' verification (1 of 2 accepted)
    record(adapter, step, {"a": [9, 20], "b": [21]})
    step = adapter.step(scheduler_output({"a": 1, "b": 1}, cached=[("a", 7, None), ("b", 4, ([4],))]))
    assert tokens_of(step) == [20, 21]
    assert tokens_of(step, "positions") == [7, 4]


def test_second_kv_group_and_prefill_len():
    """Defect 2: a 20-token prompt in two chunks of 10, blocks [1, 2, 3] + [4, 5] in group 0 and
    [7, 8, 9] + [10, 11] in group 1 (block size 4): group 1's slots, and the first chunk discarded."""
    groups = (jaxprep.KVCacheGroupSpec(block_size=4), jaxprep.KVCacheGroupSpec(block_size=4))
    adapter = VllmAdapter(config(jaxprep.FeatureConfig(kv_groups=groups, discard_request_mask=True)))
    step = adapter.step(scheduler_output({"a": 10}, new=[new_req("a", range(1, 21), [[1, 2, 3], [7, 8, 9]])]))
    slots = np.asarray(step.inputs.kv_groups[1].slot_mapping)[:10].tolist()
    assert slots == [28, 29, 30, 31, 32, 33, 34, 35, 36, 37]
    assert bool(np.asarray(step.inputs.discard_request_mask)[0])
    record(adapter, step, {"a": []})  # a prefill chunk samples nothing
    step = adapter.step(scheduler_output({"a": 10}, cached=[("a", 10, ([4, 5], [10, 11]))]))
    assert np.asarray(step.inputs.kv_groups[1].slot_mapping)[:10].tolist() == [38, 39, 40, 41, 42, 43, 44, 45,
                                                                                46, 47]
    assert np.asarray(step.inputs.kv_groups[0].slot_mapping)[:10].tolist() == [14, 15, 16, 17, 18, 19, 20, 21,
                                                                                22, 23]
    assert not bool(np.asarray(step.inputs.discard_request_mask)[0])


def test_six_admissions_in_one_step_with_bytes_of_the_change():
    """Defect 3: six new requests at once (max_model_len 1024); the update's bytes follow the 30 prompt
    tokens, not six whole [max_model_len] rows (24 KiB)."""
    adapter = VllmAdapter(PLAIN)
    new = [new_req(f"r{i}", [1 + i] * 5, [[i + 1, 20 + i]]) for i in range(6)]
    before = adapter.batch.h2d_bytes
    step = adapter.step(scheduler_output({f"r{i}": 5 for i in range(6)}, new=new))
    assert step.req_ids == [f"r{i}" for i in range(6)]
    assert tokens_of(step) == [t for i in range(6) for t in [1 + i] * 5]
    assert adapter.batch.h2d_bytes - before < 6 * 1024 * 4 // 10


def test_async_draft_placeholders_need_async_scheduling_and_async_tokens():
    """Defect 4: async scheduling's -1 draft placeholders are refused by an adapter not told of async scheduling
    (vLLM's count then takes the drafts as accepted) and by a configuration without FeatureConfig.async_tokens
    (the device fills them); the refused step leaves the adapter as it was."""
    first = scheduler_output({"a": 4}, new=[new_req("a", [1, 2, 3, 4], [[1]])])
    placeholders = scheduler_output({"a": 3}, cached=[("a", 4, ([2],))], drafts={"a": [-1, -1]})
    adapter = VllmAdapter(SPEC)
    step = adapter.step(first)
    record(adapter, step, {"a": [5]})
    with pytest.raises(ValueError, match="async_scheduling=True"):
        adapter.step(placeholders)
    assert adapter.rows == {"a": 0}
    step = adapter.step(scheduler_output({"a": 1}, cached=[("a", 4, ([2],))]))  # the same step without drafts
    assert tokens_of(step) == [5]
    with pytest.raises(ValueError, match="FeatureConfig.async_tokens"):
        VllmAdapter(SPEC, async_scheduling=True)

    adapter = VllmAdapter(ASYNC_SPEC, async_scheduling=True)
    step = adapter.step(first)
    record(adapter, step, {"a": [5]})
    step = adapter.step(placeholders)
    assert np.asarray(step.inputs.spec_decode.num_draft_tokens)[0] == 2


def test_async_spec_decode_positions_follow_the_device_count():
    """vLLM's AsyncScheduler schedules step N + 1 before step N's drafts are verified: its num_computed_tokens
    takes them as accepted (a: 4 + 3 = 7 though draft 7 was rejected: 6) and its drafts are -1 placeholders. The
    step is prepared from the device's count and the drafter's proposals, as V1 corrects it
    (`update_num_computed_tokens_for_batch_change`, `_prepare_input_ids`); b skips step 3, so its placeholders
    are never filled (-1, clamped to 0 in input_ids) and vLLM's count for it is exact again."""
    adapter = VllmAdapter(ASYNC_SPEC, async_scheduling=True)
    step = adapter.step(scheduler_output({"a": 4, "b": 3}, new=[new_req("a", [1, 2, 3, 4], [[1, 2]]),
                                                                 new_req("b", [11, 12, 13], [[3, 4]])]))
    record(adapter, step, {"a": [5], "b": [14]}, drafts={"a": [6, 7], "b": [15, 16]})
    step = adapter.step(scheduler_output({"a": 3, "b": 3}, cached=[("a", 4, None), ("b", 3, None)],
                                         drafts={"a": [-1, -1], "b": [-1, -1]}))
    assert tokens_of(step) == [5, 6, 7, 14, 15, 16]
    assert tokens_of(step, "positions") == [4, 5, 6, 3, 4, 5]
    assert np.asarray(step.inputs.spec_decode.draft_token_ids)[:4].tolist() == [6, 7, 15, 16]
    record(adapter, step, {"a": [6, 9], "b": [15, 16, 17]}, drafts={"a": [10, 11], "b": [18, 19]})
    step = adapter.step(scheduler_output({"a": 3}, cached=[("a", 7, ([5],))], drafts={"a": [-1, -1]}))
    assert tokens_of(step) == [9, 10, 11]
    assert tokens_of(step, "positions") == [6, 7, 8]
    assert np.asarray(step.inputs.attn_metadata.seq_lens)[0] == 9
    record(adapter, step, {"a": [10, 11, 12]}, drafts={"a": [13, 14]})
    step = adapter.step(scheduler_output({"a": 3, "b": 3}, cached=[("a", 9, None), ("b", 6, ([6],))],
                                         drafts={"a": [-1, -1], "b": [-1, -1]}))
    assert tokens_of(step) == [12, 13, 14, 17, 0, 0]
    assert tokens_of(step, "positions") == [9, 10, 11, 6, 7, 8]
    assert np.asarray(step.inputs.spec_decode.draft_token_ids)[:4].tolist() == [13, 14, -1, -1]
    with pytest.raises(ValueError, match="draft_token_ids"):
        VllmAdapter(SPEC).record_sampled(jnp.zeros((8, 1), jnp.int32), jnp.zeros(8, jnp.int32), jnp.zeros((8, 2)))


def test_a_reused_row_does_not_read_its_former_requests_token():
    """Under async scheduling the next step's input_ids take last step's samples by row; a request admitted into
    the row that ``a`` (sampled 7 last step) just left reads its own prompt [4, 5, 6]."""
    adapter = VllmAdapter(ASYNC_SPEC, async_scheduling=True)
    step = adapter.step(scheduler_output({"a": 3}, new=[new_req("a", [1, 2, 3], [[1]])]))
    record(adapter, step, {"a": [7]}, drafts={"a": [8, 9]})
    step = adapter.step(scheduler_output({"b": 3}, new=[new_req("b", [4, 5, 6], [[2]])], finished={"a"}))
    assert adapter.rows == {"b": 0}
    assert tokens_of(step) == [4, 5, 6]


def test_record_sampled_reads_nothing_back():
    """Defect 5: the sampled tokens stay on the device; the next step reads them there."""
    adapter = VllmAdapter(PLAIN)
    step = adapter.step(scheduler_output({"a": 3}, new=[new_req("a", [1, 2, 3], [[1]])]))
    rows = step.inputs.idx_mapping.shape[0]
    tokens = jnp.zeros((rows, 1), jnp.int32).at[0, 0].set(42)
    counts = jnp.zeros((rows,), jnp.int32).at[0].set(1)
    with jax.transfer_guard_device_to_host("disallow"):
        adapter.record_sampled(tokens, counts)
    step = adapter.step(scheduler_output({"a": 1}, cached=[("a", 3, None)]))
    assert tokens_of(step) == [42]


@pytest.mark.parametrize("mode", ["v1 resumed_req_ids", "v2 re-sent as new"])
def test_preempted_request_resumes_with_its_tokens(mode):
    """Defect 6: ``a`` (prompt [1..6], output 7) is preempted and comes back with fresh blocks [5, 6]: its
    seven tokens recomputed from position 0. No stop_len is given anywhere."""
    adapter = VllmAdapter(PLAIN)
    step = adapter.step(scheduler_output({"a": 6, "b": 2}, new=[new_req("a", range(1, 7), [[1, 2]]),
                                                                 new_req("b", [8, 9], [[3]])]))
    record(adapter, step, {"a": [7], "b": [10]})
    step = adapter.step(scheduler_output({"b": 1}, cached=[("b", 2, None)], preempted={"a"}))
    record(adapter, step, {"b": [11]})
    if mode.startswith("v1"):
        resumed = scheduler_output({"a": 7, "b": 1}, cached=[("b", 3, None), ("a", 0, ([5, 6],))], resumed={"a"},
                                   all_token_ids={"a": [1, 2, 3, 4, 5, 6, 7]})
    else:
        resumed = scheduler_output({"b": 1, "a": 7}, cached=[("b", 3, None)],
                                   new=[new_req("a", range(1, 7), [[5, 6]], prefill=[1, 2, 3, 4, 5, 6, 7])])
    step = adapter.step(resumed)
    b = step.req_id_to_index["a"]
    start = int(np.asarray(step.inputs.attn_metadata.query_start_loc)[b])
    assert tokens_of(step)[start:start + 7] == [1, 2, 3, 4, 5, 6, 7]
    slots = np.asarray(step.inputs.attn_metadata.slot_mapping)[start:start + 7].tolist()
    assert slots == [20, 21, 22, 23, 24, 25, 26]
    b = step.req_id_to_index["b"]
    start = int(np.asarray(step.inputs.attn_metadata.query_start_loc)[b])
    assert tokens_of(step)[start] == 11


def test_finished_rows_are_reused_and_unknown_requests_named():
    adapter = VllmAdapter(PLAIN)
    step = adapter.step(scheduler_output({"a": 2, "b": 2}, new=[new_req("a", [1, 2], [[1]]),
                                                                 new_req("b", [3, 4], [[2]])]))
    record(adapter, step, {"a": [], "b": []})
    step = adapter.step(scheduler_output({"c": 2}, new=[new_req("c", [5, 6], [[3]])], finished={"a"}))
    assert adapter.rows == {"b": 1, "c": 0} and step.req_ids == ["c"]
    with pytest.raises(ValueError, match="request zz holds no row"):
        adapter.step(scheduler_output({"zz": 1}, cached=[("zz", 2, None)]))
    assert adapter.rows == {"b": 1, "c": 0}


# --- vLLM's real scheduler against vLLM's own runner ----------------------------------------------------

@pytest.fixture(scope="module")
def parity_report() -> dict:
    return worker_report("vllm_adapter_worker.py")


def test_every_step_equals_vllms_own_runner(parity_report):
    assert parity_report["mismatches"] == []


def test_the_runs_cover_issue_21s_workloads(parity_report):
    runs = parity_report["workloads"]
    v1 = {k: v for k, v in runs.items() if not v["v2_mode"]}
    v2 = {k: v for k, v in runs.items() if v["v2_mode"]}
    assert v1 and v2 and sum(run["steps"] for run in runs.values()) >= 300

    def total(group, key):
        return sum(run[key] for run in group.values())

    assert total(v1, "preempted") > 0 and total(v1, "resumed") > 0  # V1: resumed_req_ids + all_token_ids
    assert total(v2, "preempted") > 0 and total(v2, "resent") > 0  # V2: preempted requests re-sent as new
    assert total(runs, "drafts") > 0 and total(runs, "prefix_hits") > 0 and total(runs, "lora") > 0
    # the door's steady program (`steady_programs`, as after a warm-up) applied decode steps of every workload
    assert all(run["steady"] > 0 for run in runs.values())
    for group in (v1, v2):  # async scheduling with drafts, some of them rejected
        assert any("async" in name and run["drafts"] and run["rejected"] for name, run in group.items())
    assert max(run["max_admissions"] for run in runs.values()) >= 6
    assert any("async" in name for name in runs)
    assert all("slot_mapping.1" in run["compared"] for name, run in runs.items() if "sliding window" in name)
    assert all("v2.input_ids" in run["compared"] for run in v2.values())  # MRV2's kernels, V2's batch order


def test_a_shifted_value_in_any_compared_field_is_caught(parity_report):
    compared = {field for run in parity_report["workloads"].values() for field in run["compared"]}
    caught = parity_report["caught"]
    assert compared == set(caught)
    for field, (steps, detected) in caught.items():
        assert detected > 0, field
        if not field.startswith("spec.draft") and not field.startswith("spec.target"):
            assert detected == steps, field  # every step (drafts only where a step has some)
