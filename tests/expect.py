"""Compares a prepared step with the NumPy reference, field by field, padding included."""

from __future__ import annotations

import numpy as np

from jaxprep.reference import pad_reference, prepare_reference


def reference_step(arrays: dict, config, num_tokens_padded: int) -> dict:
    ref = prepare_reference(block_size=config.block_size, **arrays)
    return pad_reference(ref, num_tokens_padded, config.num_reqs_padded(num_tokens_padded))


def step_fields(step) -> dict:
    meta = step.attn_metadata
    return {
        "input_ids": step.input_ids, "positions": step.positions, "logits_indices": step.logits_indices,
        "idx_mapping": step.idx_mapping, "slot_mapping": meta.slot_mapping,
        "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens, "block_table": meta.block_table,
        "num_actual_tokens": meta.num_actual_tokens, "num_reqs": meta.num_reqs,
        "max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len,
    }


def assert_step_matches_reference(step, arrays: dict, config) -> None:
    expected = reference_step(arrays, config, step.num_tokens_padded)
    actual = step_fields(step)
    for name, want in expected.items():
        got = np.asarray(actual[name])
        assert got.dtype == np.int32, f"{name} has dtype {got.dtype}"
        np.testing.assert_array_equal(got, want, err_msg=f"field {name}")
