"""Issue 31, "never wrong at vLLM's door": `VllmAdapter` serves what vLLM's runners serve and refuses, by name
and with nothing written, what no vLLM scheduler sends.

The first tests read the report of tests/support/vllm_door_worker.py, which drives vLLM 0.33.0's real
``Scheduler`` (both runner modes) and compares every step with vLLM V1's own runner (and MRV2's kernels):
the sync scheduler's -1 placeholder drafts (``pad_spec_decode``), M-RoPE positions of text-only requests
(vLLM's Qwen2-VL position code in V1's runner) and of an image request (through the adapter's hook), and
structured-output bitmask rows (vLLM's ``GrammarOutput``, V1's ``apply_grammar_bitmask``); then vLLM's own
outputs with one field broken, and jaxprep's packed buffers with one word replaced. The unit tests below
use `SimpleNamespace` stand-ins for what needs no vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import jaxprep
from jaxprep.serving import ServingConfig
from jaxprep.serving.host.vllm import InvalidSchedulerOutputError, VllmAdapter
from support.vllm_workers import worker_report


@pytest.fixture(scope="module")
def door_report() -> dict:
    return worker_report("vllm_door_worker.py")


def test_every_step_equals_vllms_own_runner(door_report):
    assert door_report["mismatches"] == []


def test_placeholder_drafts_of_the_sync_scheduler_are_served(door_report):
    """Issue 31 item 1: vLLM pads a joining request with one token left to compute, in both ways the issue
    names (a short prompt, a prefix-cache hit of all but the last token), in both runner modes."""
    runs = door_report["runs"]
    for mode in ("V1", "V2"):
        assert runs[f"pad spec decode [{mode}]"]["padded_new"] > 0
        assert runs[f"pad via prefix cache [{mode}]"]["padded_prefix_hit"] > 0
        assert "spec.draft_token_ids" in runs[f"pad spec decode [{mode}]"]["compared"]
    assert "v2.input_ids" in runs["pad spec decode [V2]"]["compared"]


def test_mrope_positions_equal_v1s(door_report):
    """Item 2: text-only requests (with a preemption and its resume) and a request with an image."""
    runs = door_report["runs"]
    assert all("mrope_positions" in runs[f"M-RoPE text [{mode}]"]["compared"] for mode in ("V1", "V2"))
    assert sum(runs[f"M-RoPE text [{mode}]"]["preempted"] for mode in ("V1", "V2")) > 0
    assert "mrope_positions" in runs["M-RoPE image [V1]"]["compared"]
    assert runs["M-RoPE image [V1]"]["image_delta"] == -2  # 12 tokens, positions up to 9: not text's 0


def test_grammar_rows_mask_what_v1_masks(door_report):
    """Item 3: every structured-output request's logits rows masked as V1 masks them; the bitmask's request
    blocks reversed are caught (the control)."""
    for mode in ("V1", "V2"):
        run = door_report["runs"][f"structured outputs [{mode}]"]
        assert run["grammar_rows"] > 0 and "grammar_mask" in run["compared"]
        assert run["grammar_reversed"] > 0 and run["grammar_reversed_caught"] == run["grammar_reversed"]


def test_a_shifted_value_in_any_compared_field_is_caught(door_report):
    compared = {field for run in door_report["runs"].values() for field in run["compared"]}
    caught = door_report["caught"]
    assert compared == set(caught)
    for field, (steps, detected) in caught.items():
        assert detected > 0, field
        if field in ("mrope_positions", "grammar_mask", "input_ids", "positions", "slot_mapping.0"):
            assert detected == steps, field


def test_every_broken_scheduler_output_is_refused_with_nothing_written(door_report):
    """Item 4 (and the randomized test): every kind of corruption was tried on real outputs; each raised a
    ValueError naming the field and left the device state, the host mirror and the adapter's maps as they were.
    Control: the snapshot sees what each real step changes."""
    corruption = door_report["corruption"]
    assert set(corruption) == set(door_report["corruption_kinds"])
    for name, entry in corruption.items():
        assert entry["cases"] > 0, name
        assert entry["refused"] == entry["unchanged"] == entry["cases"], (name, entry["messages"])
        assert not any(m.startswith("UNNAMED") for m in entry["messages"]), (name, entry["messages"])
    assert sum(entry["cases"] for entry in corruption.values()) >= 30
    assert door_report["corruption_controls"] and all(door_report["corruption_controls"])


def test_a_broken_buffer_word_is_flagged_and_writes_nothing_or_stays_in_bounds(door_report):
    """Item 5 (randomized): one word of a real update buffer replaced; flagged -> the state equals the state
    before but for the error word; not flagged -> every value kept in bounds. Controls: the buffer as packed is
    not flagged, and the bounds check sees a row past max_model_len."""
    buffers = door_report["buffers"]
    assert buffers["cases"] >= 20 and buffers["failures"] == []
    assert buffers["flagged"] >= buffers["cases"] // 2
    assert buffers["clean_flagged"] == 0
    assert buffers["bounds_control"] == ["num_tokens", "stop_len"]


# --- named errors without vLLM --------------------------------------------------------------------------------

def config(**features) -> ServingConfig:
    prep = jaxprep.PrepConfig(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=16, block_size=4, num_blocks=32,
                              features=jaxprep.FeatureConfig(**features), token_buckets=(16,))
    return ServingConfig(prep=prep, vocab_size=100)


def new_req(req_id, prompt, blocks, mm_features=()):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(prompt), prefill_token_ids=None,
                           block_ids=tuple(blocks), num_computed_tokens=0, sampling_params=None, lora_request=None,
                           mm_features=list(mm_features))


def output(scheduled, new=(), structured=False):
    cached = SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set(),
                             all_token_ids={})
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                           finished_req_ids=set(), preempted_req_ids=set(), has_structured_output_requests=structured)


IMAGE = SimpleNamespace(modality="image", mm_position=SimpleNamespace(offset=1, length=4), data={})


def test_a_multimodal_request_without_positions_is_named_and_a_hook_serves_it():
    """M-RoPE on: an image request needs the model's positions (named error, nothing written); with the hook,
    its columns are the hook's, then ``p + delta``; a text request beside it reads ``arange`` on every row."""
    so = output({"m": 6, "t": 3}, [new_req("m", [1, 9, 9, 9, 9, 2], [[1, 2]], [IMAGE]), new_req("t", [3, 4, 5], [[3]])])
    adapter = VllmAdapter(config(mrope=True))
    before = adapter.batch.state.to_numpy()
    with pytest.raises(InvalidSchedulerOutputError, match=r"NewRequestData 'm' carries multimodal features \(image\)"
                                                          r".*mrope_positions=fn"):
        adapter.step(so)
    assert adapter.rows == {} and adapter.admitted == {}
    assert all(np.array_equal(v, before[k]) for k, v in adapter.batch.state.to_numpy().items())

    positions = np.array([[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]])  # worked example, delta -2
    adapter = VllmAdapter(config(mrope=True), mrope_positions=lambda new: (positions, -2))
    step = adapter.step(so)
    mrope = np.asarray(step.inputs.mrope_positions)[:, :9]
    np.testing.assert_array_equal(mrope[:, :6], positions)
    np.testing.assert_array_equal(mrope[:, 6:], [[0, 1, 2]] * 3)
    control = VllmAdapter(config(mrope=True), mrope_positions=lambda new: (positions + 1, -2)).step(so)
    assert not np.array_equal(np.asarray(control.inputs.mrope_positions)[:, :6], positions)
    with pytest.raises(InvalidSchedulerOutputError, match=r"expected integers \[3, prompt_len=6\]"):
        VllmAdapter(config(mrope=True), mrope_positions=lambda new: (positions[:, :5], -2)).step(so)


@pytest.mark.parametrize("features, grammar, message", [
    ({}, SimpleNamespace(structured_output_request_ids=["a"], grammar_bitmask=np.zeros((1, 4), np.int32)),
     "FeatureConfig.structured_outputs is off"),
    (dict(structured_outputs=True), SimpleNamespace(structured_output_request_ids=["zz"],
                                                    grammar_bitmask=np.zeros((1, 4), np.int32)),
     r"names \['zz'\], not scheduled"),
    (dict(structured_outputs=True), SimpleNamespace(structured_output_request_ids=["a"],
                                                    grammar_bitmask=np.zeros((2, 4), np.int32)),
     r"grammar_bitmask has shape \(2, 4\)"),
    (dict(structured_outputs=True), "missing", "has_structured_output_requests is set, but no GrammarOutput"),
])
def test_grammar_outputs_the_step_cannot_take_are_named(features, grammar, message):
    so = output({"a": 3}, [new_req("a", [1, 2, 3], [[1]])], structured=True)
    adapter = VllmAdapter(config(**features))
    with pytest.raises(InvalidSchedulerOutputError, match=message):
        adapter.step(so) if grammar == "missing" else adapter.step(so, grammar)
    assert adapter.rows == {}
    step = adapter.step(so, None)  # the step without structured-output rows: what get_grammar_bitmask gave
    assert step.req_ids == ["a"] and step.grammar_bitmask is None
