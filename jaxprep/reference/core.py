"""NumPy reference of vLLM V1's input preparation (docs/semantics.md#core-outputs), written for reading.

The oracle of the tests (the benchmarks measure vLLM's own code path instead). It works on unpadded host arrays,
the way vLLM's ``_prepare_inputs`` does, and `pad_reference` lays the result out in jaxprep's
padded shapes with the padding constants.
"""

from __future__ import annotations

import numpy as np

from jaxprep import NULL_BLOCK_ID, PAD_INPUT_ID, PAD_LOGITS_INDEX, PAD_POSITION, PAD_SEQ_LEN, PAD_SLOT_ID, PAD_STATE_ROW


def prepare_reference(token_ids, block_table, num_computed_tokens, num_scheduled_tokens, block_size):
    """vLLM V1 ``_prepare_inputs`` over the rows with work. Returns a dict of unpadded arrays."""
    token_ids = np.asarray(token_ids)
    block_table = np.asarray(block_table)
    # rows with work, in row order: num_scheduled [0,3,0,2] -> idx_mapping [1,3]
    idx_mapping = np.flatnonzero(np.asarray(num_scheduled_tokens) > 0)
    num_scheduled = np.asarray(num_scheduled_tokens)[idx_mapping].astype(np.int64)
    num_computed = np.asarray(num_computed_tokens)[idx_mapping].astype(np.int64)
    num_reqs = len(idx_mapping)

    # num_scheduled [2,5,3] -> req_indices [0,0,1,1,1,1,1,2,2,2]
    req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
    # cu_num_tokens [2,7,10]; arange [0,1,0,1,2,3,4,0,1,2]
    cu_num_tokens = np.cumsum(num_scheduled)
    arange = np.arange(cu_num_tokens[-1] if num_reqs else 0) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
    positions = num_computed[req_indices] + arange

    # token_indices = positions + state_row * M, into the flattened token table
    state_rows = idx_mapping[req_indices]
    token_indices = positions + state_rows * token_ids.shape[1]
    input_ids = token_ids.ravel()[token_indices]

    block_numbers = block_table[state_rows, positions // block_size].astype(np.int64)
    slot_mapping = block_numbers * block_size + positions % block_size

    query_start_loc = np.concatenate([[0], cu_num_tokens])
    seq_lens = num_computed + num_scheduled
    return {
        "idx_mapping": idx_mapping,
        "input_ids": input_ids,
        "positions": positions,
        "token_indices": token_indices,
        "slot_mapping": slot_mapping,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "block_table": block_table[idx_mapping],
        "logits_indices": query_start_loc[1:] - 1,
        "num_actual_tokens": int(query_start_loc[-1]),
        "num_reqs": num_reqs,
        "max_query_len": int(num_scheduled.max()) if num_reqs else 0,
        "max_seq_len": int(seq_lens.max()) if num_reqs else 0,
    }


def pad_reference(ref: dict, num_tokens_padded: int, num_reqs_padded: int) -> dict:
    """Lays out `prepare_reference` results in padded shapes with jaxprep's padding constants (and the
    error word of a valid batch, 0)."""
    num_tokens, num_reqs = ref["num_actual_tokens"], ref["num_reqs"]

    def pad(array, length, value):
        out = np.full((length,) + array.shape[1:], value, dtype=np.int64)
        out[: len(array)] = array
        return out

    return {
        "input_ids": pad(ref["input_ids"], num_tokens_padded, PAD_INPUT_ID),
        "positions": pad(ref["positions"], num_tokens_padded, PAD_POSITION),
        "slot_mapping": pad(ref["slot_mapping"], num_tokens_padded, PAD_SLOT_ID),
        "query_start_loc": pad(ref["query_start_loc"], num_reqs_padded + 1, num_tokens),
        "seq_lens": pad(ref["seq_lens"], num_reqs_padded, PAD_SEQ_LEN),
        "block_table": pad(ref["block_table"], num_reqs_padded, NULL_BLOCK_ID),
        "logits_indices": pad(ref["logits_indices"], num_reqs_padded, PAD_LOGITS_INDEX),
        "idx_mapping": pad(ref["idx_mapping"], num_reqs_padded, PAD_STATE_ROW),
        "num_actual_tokens": num_tokens,
        "num_reqs": num_reqs,
        "max_query_len": ref["max_query_len"],
        "max_seq_len": ref["max_seq_len"],
        "errors": 0,  # the reference takes valid batches only: no bound is broken
    }
