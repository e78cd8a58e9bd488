"""LoRA metadata (`FeatureConfig.lora`): vLLM 0.33.0's worked example, graph keys, random batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprep import BatchState, FeatureConfig, LoRAConfig, prepare_padded
from jaxprep._constants import NO_LORA_ID, NO_LORA_SLOT, PAD_SAMPLER_INDEX_PADDED
from jaxprep.reference.lora import lora_reference
from support import mrv2_examples as ex
from support.feature_batches import RUN_MODES, batch_rows, feature_batches, run_step
from support.mrv2_examples import BASE, lora_fields, with_random_adapters


@pytest.mark.parametrize("mode", RUN_MODES)
def test_worked_example_v1(mode):
    """Rows r0..r3 in V1's persistent-batch order, n_samp = D + 1 = [3, 1, 1, 2] logits rows."""
    got = lora_fields(run_step(ex.arrays(ex.V1_ROWS), ex.config("v1"), mode))
    n, num_logits = 12, 7
    assert got["token_lora_mapping"][:n].tolist() == [7, 7, 7, 0, 0, 0, 0, 0, 0, 3, 7, 7]
    assert got["prompt_lora_mapping"][:num_logits].tolist() == [7, 7, 7, 0, 3, 7, 7]
    assert got["token_lora_indices"][:n].tolist() == [2, 2, 2, -1, -1, -1, -1, -1, -1, 0, 2, 2]
    assert got["sampler_indices"][:num_logits].tolist() == [2, 2, 2, -1, 0, 2, 2]
    assert got["sampler_indices_padded"][:num_logits].tolist() == [14, 15, 16, 31, 4, 19, 20]
    assert got["embeddings_indices"][:n].tolist() == [128, 128, 128, 0, 0, 0, 0, 0, 0, 0, 128, 128]
    assert got["indices_len"].tolist() == [n, num_logits, num_logits, n]
    assert got["token.token_indices_sorted_by_lora_ids"][:n].tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 10, 11]
    assert got["token.active_lora_ids"].tolist() == [-1, 0, 2, -1, -1]
    assert got["token.num_tokens_per_lora"].tolist() == [6, 1, 5, 0, 0]
    assert got["token.lora_token_start_loc"].tolist() == [0, 6, 7, 12, 0, 0]
    assert int(got["token.num_active_loras"]) == 5  # 3 ids {-1, 0, 2}, rounded to the captured (5,)
    assert int(got["num_active_loras"]) == 2 and int(got["cudagraph_num_active_loras"]) == 5


@pytest.mark.parametrize("mode", RUN_MODES)
def test_worked_example_v2(mode):
    """Batch [r0, r3, r2, r1] (slots [5, 1, 2, 3]): 4 prompt entries for 7 logits rows."""
    step = run_step(ex.arrays(ex.V2_SLOTS), ex.config("v2"), mode)
    got = lora_fields(step)
    n, r = 12, 4
    assert np.asarray(step.idx_mapping)[:r].tolist() == [5, 1, 2, 3]
    assert got["prompt_lora_mapping"][:r].tolist() == [7, 7, 3, 0]
    assert got["token_lora_mapping"][:n].tolist() == [7, 7, 7, 7, 7, 3, 0, 0, 0, 0, 0, 0]
    assert got["token_lora_indices"][:n].tolist() == [2, 2, 2, 2, 2, 0, -1, -1, -1, -1, -1, -1]
    assert got["sampler_indices"][:r].tolist() == [2, 2, 0, -1]
    assert got["sampler_indices_padded"][:r].tolist() == [8, 9, 2, 19]
    assert got["token.token_indices_sorted_by_lora_ids"][:n].tolist() == [6, 7, 8, 9, 10, 11, 5, 0, 1, 2, 3, 4]
    assert got["token.active_lora_ids"].tolist() == [-1, 0, 2, -1, -1]
    assert got["token.num_tokens_per_lora"].tolist() == [6, 1, 5, 0, 0]
    assert got["token.lora_token_start_loc"].tolist() == [0, 6, 7, 12, 0, 0]
    assert got["indices_len"].tolist() == [n, r, r, n]
    assert int(got["num_active_loras"]) == 2 and int(got["cudagraph_num_active_loras"]) == 5
    meta = step.lora.token_mapping_meta
    assert meta.sorted_token_indices is meta.token_indices_sorted_by_lora_ids


KEYS = [  # cudagraph_specialize_lora, specialize_active_lora, LoRA ids -> V1 key, V2 key, kernel num_active
    (True, False, None, 5, 5, 5),
    (True, True, None, 2, 2, 4),
    (True, False, [0] * 6, 0, 0, 0),
    (True, True, [0] * 6, 0, 0, 0),
    (False, False, [0] * 6, 0, 0, 0),
    (False, True, [0] * 6, 0, 0, 0),
]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("case", KEYS, ids=[f"csl={c[0]},sal={c[1]},ids={'zero' if c[2] else 'example'}"
                                            for c in KEYS])
def test_graph_keys_of_the_worked_example(runner, case):
    cudagraph_specialize, specialize, ids, v1_key, v2_key, kernel = case
    config = ex.config(runner, cudagraph_specialize_lora=cudagraph_specialize, specialize_active_lora=specialize)
    step = run_step(ex.arrays(ex.V1_ROWS if runner == "v1" else ex.V2_SLOTS, lora_ids=ids), config, "jit")
    assert int(step.lora.cudagraph_num_active_loras) == (v1_key if runner == "v1" else v2_key)
    assert int(step.lora.token_mapping_meta.num_active_loras) == kernel


def test_capture_cases():
    """V1 without cudagraph_specialize_lora captures no case 0, so a step with no adapter runs eagerly."""
    assert LoRAConfig(max_loras=4).capture_cases("v1") == (0, 5)
    assert LoRAConfig(max_loras=4).capture_cases("v2") == (0, 5)
    assert LoRAConfig(max_loras=4, specialize_active_lora=True).capture_cases("v1") == (0, 1, 2, 4, 5)
    off = LoRAConfig(max_loras=4, cudagraph_specialize_lora=False)
    assert off.capture_cases("v1") == (5,) and off.capture_cases("v2") == (0, 5)


@pytest.mark.parametrize("runner, option, want", [
    ("v2", "logits_rows", [7, 7, 7, 7, 7, 3, 0]),  # V2's batch, one entry per logits row (V1's rule)
    ("v1", "requests", [7, 0, 3, 7]),  # V1's rows, one entry per request (V2's rule)
])
def test_prompt_mapping_option(runner, option, want):
    rows = ex.V1_ROWS if runner == "v1" else ex.V2_SLOTS
    lora = run_step(ex.arrays(rows), ex.config(runner, prompt_mapping=option), "jit").lora
    assert np.asarray(lora.prompt_lora_mapping)[:len(want)].tolist() == want
    assert int(lora.indices_len[1]) == len(want)


def test_a_step_without_adapters_resets_the_kernel_metadata():
    """vLLM returns early (all -1): ids -1, counts and starts 0, num_active 0; the sort is the identity here."""
    step = run_step(ex.arrays(ex.V2_SLOTS, lora_ids=[0] * 6), ex.config("v2"), "jit")
    for meta in (step.lora.token_mapping_meta, step.lora.prompt_mapping_meta):
        assert np.asarray(meta.active_lora_ids).tolist() == [-1] * 5
        assert np.asarray(meta.num_tokens_per_lora).tolist() == [0] * 5
        assert np.asarray(meta.lora_token_start_loc).tolist() == [0] * 6
        assert int(meta.num_active_loras) == 0
        np.testing.assert_array_equal(meta.token_indices_sorted_by_lora_ids,
                                      np.arange(meta.token_indices_sorted_by_lora_ids.shape[0]))
    assert int(step.lora.num_active_loras) == 0 and int(step.lora.cudagraph_num_active_loras) == 0


# --- random batches against the NumPy reference ------------------------------------------------

def check_against_reference(step, arrays, features) -> None:
    rows = np.asarray(step.idx_mapping)[: int(step.attn_metadata.num_reqs)]
    want = lora_reference(arrays["lora_ids"], arrays["lora_slots"], rows, arrays["num_scheduled_tokens"],
                          arrays.get("num_draft_tokens", np.zeros(len(arrays["lora_ids"]), np.int32)),
                          features.lora, features.runner, features.spec_decode)
    got = lora_fields(step)
    pads = {"token_lora_mapping": NO_LORA_ID, "prompt_lora_mapping": NO_LORA_ID, "token_lora_indices": NO_LORA_SLOT,
            "sampler_indices": NO_LORA_SLOT, "sampler_indices_padded": PAD_SAMPLER_INDEX_PADDED,
            "embeddings_indices": 0}
    for name, pad in pads.items():
        real = len(want[name])
        np.testing.assert_array_equal(got[name][:real], want[name], err_msg=name)
        assert (got[name][real:] == pad).all(), name
    np.testing.assert_array_equal(got["indices_len"], want["indices_len"])
    for prefix in ("token", "prompt"):
        meta, real = want[f"{prefix}_mapping_meta"], int(want["indices_len"][0 if prefix == "token" else 1])
        for name, value in meta.items():
            sorted_rows = got[f"{prefix}.{name}"]
            if name == "token_indices_sorted_by_lora_ids":
                value = np.arange(real) if value is None else value  # vLLM leaves it stale; jaxprep: identity
                np.testing.assert_array_equal(sorted_rows[:real], value, err_msg=prefix)
                np.testing.assert_array_equal(sorted_rows[real:], np.arange(real, len(sorted_rows)))
            else:
                np.testing.assert_array_equal(sorted_rows, value, err_msg=f"{prefix}.{name}")
    assert int(got["num_active_loras"]) == want["num_active_loras"]
    assert int(got["cudagraph_num_active_loras"]) == want["cudagraph_num_active_loras"]


LORA_OPTIONS = st.fixed_dictionaries({
    "runner": st.sampled_from(["v1", "v2"]), "k": st.sampled_from([0, 2]), "max_loras": st.integers(1, 5),
    "specialize_active_lora": st.booleans(), "cudagraph_specialize_lora": st.booleans(),
    "prompt_mapping": st.sampled_from(["runner", "runner", "logits_rows", "requests"]),
})


@pytest.mark.parametrize("mode", RUN_MODES)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), options=LORA_OPTIONS)
def test_random_batches_match_reference(mode, data, options):
    lora = LoRAConfig(max_loras=options["max_loras"], vocab_size=1000,
                      specialize_active_lora=options["specialize_active_lora"],
                      cudagraph_specialize_lora=options["cudagraph_specialize_lora"],
                      prompt_mapping=options["prompt_mapping"])
    features = FeatureConfig(num_speculative_tokens=options["k"], runner=options["runner"], lora=lora)
    config = dataclasses.replace(BASE, features=features)
    arrays = data.draw(feature_batches(config, max_drafts=options["k"]))
    arrays = with_random_adapters(arrays, lora.max_loras, np.random.default_rng(data.draw(st.integers(0, 2**20))))
    step = run_step(arrays, config, mode)
    check_against_reference(step, arrays, features)
    if options["runner"] == "v1":
        np.testing.assert_array_equal(np.asarray(step.idx_mapping)[: len(batch_rows(arrays))], batch_rows(arrays))


def test_unchecked_unloaded_adapter_flags_its_row_which_leaves_the_batch():
    """Without validation an id no slot holds sets LORA_ID_NOT_LOADED and its row leaves the batch
    (docs/guides/errors.md); the other rows keep their adapters."""
    from jaxprep.features.flags import LORA_ID_NOT_LOADED

    arrays = ex.arrays(ex.V2_SLOTS)
    valid = prepare_padded(BatchState.from_numpy(**arrays), ex.config("v2"), 16)
    assert int(valid.errors) == 0 and 2 in np.asarray(valid.idx_mapping)  # the control: r2 is in the batch
    arrays["lora_ids"][2] = 9  # r2 (slot 2) asks for an adapter that is not loaded
    step = prepare_padded(BatchState.from_numpy(**arrays), ex.config("v2"), 16)
    assert int(step.errors) == LORA_ID_NOT_LOADED
    assert 2 not in np.asarray(step.idx_mapping)
    assert 9 not in np.asarray(step.lora.token_lora_mapping)
    assert np.asarray(step.lora.token_lora_indices).max() < ex.config("v2").features.lora.max_loras
