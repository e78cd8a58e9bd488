"""NumPy reference of the serving-state transitions, written for reading: the tests' oracle.

A state is a dict of host arrays with the keys of `ServingState.to_numpy()`.
"""

from __future__ import annotations

import numpy as np

from jaxprep._constants import NULL_BLOCK_ID, PAD_STATE_ROW
from jaxprep.serving.state import PAD_ROW


def empty_state(max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> dict[str, np.ndarray]:
    counters = ("num_computed_tokens", "num_scheduled_tokens", "num_tokens", "stop_len", "num_blocks",
                "num_draft_tokens")
    state = {name: np.zeros(max_num_reqs, np.int64) for name in counters}
    state["token_ids"] = np.zeros((max_num_reqs, max_model_len), np.int64)
    state["block_table"] = np.full((max_num_reqs, max_blocks_per_req), NULL_BLOCK_ID, np.int64)
    return state


def finish(state: dict, rows) -> dict:
    state = {name: value.copy() for name, value in state.items()}
    for row in rows:
        if row == PAD_ROW:
            continue
        for name in ("num_computed_tokens", "num_scheduled_tokens", "num_tokens", "stop_len", "num_blocks",
                     "num_draft_tokens"):
            state[name][row] = 0
        state["block_table"][row, :] = NULL_BLOCK_ID
    return state


def add(state: dict, payload) -> dict:
    state = {name: value.copy() for name, value in state.items()}
    for i, row in enumerate(payload.rows):
        if row == PAD_ROW:
            continue
        state["token_ids"][row, :] = payload.token_ids[i]
        state["block_table"][row, :] = payload.block_ids[i]
        state["num_tokens"][row] = payload.num_tokens[i]
        state["stop_len"][row] = payload.stop_len[i]
        state["num_computed_tokens"][row] = payload.num_computed_tokens[i]
        state["num_blocks"][row] = payload.num_blocks[i]
        state["num_scheduled_tokens"][row] = state["num_draft_tokens"][row] = 0
    return state


def append(state: dict, payload) -> dict:
    state = {name: value.copy() for name, value in state.items()}
    for row, block in zip(payload.rows, payload.block_ids):
        if row == PAD_ROW:
            continue
        state["block_table"][row, state["num_blocks"][row]] = block
        state["num_blocks"][row] += 1
    return state


def schedule(state: dict, payload) -> dict:
    state = {name: value.copy() for name, value in state.items()}
    state["num_scheduled_tokens"][:] = payload.num_scheduled_tokens
    state["num_draft_tokens"][:] = payload.num_draft_tokens
    for row, count in enumerate(payload.num_draft_tokens):
        start = state["num_tokens"][row]
        state["token_ids"][row, start: start + count] = payload.draft_token_ids[row, :count]
    return state


def record_sampled(state: dict, idx_mapping, sampled_token_ids, num_sampled) -> dict:
    state = {name: value.copy() for name, value in state.items()}
    for b, row in enumerate(idx_mapping):
        if row == PAD_STATE_ROW:
            continue
        computed, scheduled = state["num_computed_tokens"][row], state["num_scheduled_tokens"][row]
        num_tokens, drafts = state["num_tokens"][row], state["num_draft_tokens"][row]
        if computed + scheduled < num_tokens:  # a prefill chunk: its sample is discarded
            state["num_computed_tokens"][row] += scheduled
        else:
            n = num_sampled[b]
            state["num_computed_tokens"][row] += scheduled - (drafts + 1 - n)
            state["token_ids"][row, num_tokens: num_tokens + n] = sampled_token_ids[b, :n]
            state["num_tokens"][row] += n
        state["num_scheduled_tokens"][row] = state["num_draft_tokens"][row] = 0
    return state
