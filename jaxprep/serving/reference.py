"""NumPy reference of the serving-state transitions, written for reading: the tests' oracle.

A state is a dict of host arrays with the keys of `ServingState.to_numpy()` (``extra_block_tables``
a tuple of tables), plus ``_table_blocks`` [rows, tables], the blocks each table of a row holds
(what the host mirror counts; keys starting with ``_`` are the reference's own). The payloads are
the host objects of `jaxprep.serving.state`; each function returns a new state and leaves its
argument as it was.
"""

from __future__ import annotations

import copy

import numpy as np

from jaxprep._constants import MROPE_MISSING_POSITION, NO_GRAMMAR, NO_LORA_ID, NULL_BLOCK_ID, PAD_STATE_ROW
from jaxprep.serving.state import PAD_ROW

COUNTERS = ("num_computed_tokens", "num_scheduled_tokens", "num_tokens", "stop_len", "num_blocks", "num_draft_tokens")


def empty_state(max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> dict[str, np.ndarray]:
    """The plain state (no feature): zero counters, zero tokens, null blocks."""
    state = {name: np.zeros(max_num_reqs, np.int64) for name in COUNTERS}
    state["token_ids"] = np.zeros((max_num_reqs, max_model_len), np.int64)
    state["block_table"] = np.full((max_num_reqs, max_blocks_per_req), NULL_BLOCK_ID, np.int64)
    return state


def _copy(state: dict) -> dict:
    state = copy.deepcopy(state)
    if "_table_blocks" not in state:
        state["_table_blocks"] = np.zeros((len(state["num_tokens"]), len(_table_keys(state))), np.int64)
    return state


def _table_keys(state: dict) -> list[tuple[str, int | None]]:
    """(key, index in the tuple) of every block table, in `table_names` order."""
    extra = len(state.get("extra_block_tables", ()))
    keys = [("block_table", None)] + [("extra_block_tables", g) for g in range(extra)]
    return keys + ([("mamba_block_table", None)] if "mamba_block_table" in state else [])


def _table(state: dict, t: int) -> np.ndarray:
    key, g = _table_keys(state)[t]
    return state[key] if g is None else state[key][g]


def _set_if(state: dict, name: str, row: int, value) -> None:
    if name in state:
        state[name][row] = value


def _clear_row(state: dict, row: int) -> None:
    for t in range(len(_table_keys(state))):
        _table(state, t)[row] = NULL_BLOCK_ID
    for name in COUNTERS + ("prefill_len", "mamba_checkpoint_offsets"):
        _set_if(state, name, row, 0)
    state["_table_blocks"][row] = 0
    _set_if(state, "num_accepted_tokens", row, 1)
    _set_if(state, "grammar_index", row, NO_GRAMMAR)
    _set_if(state, "lora_ids", row, NO_LORA_ID)


def finish(state: dict, rows) -> dict:
    state = _copy(state)
    for row in rows:
        if row != PAD_ROW:
            _clear_row(state, int(row))
    return state


def _write_tables(state: dict, row: int, tables) -> None:
    for t, ids in enumerate(tables):
        _table(state, t)[row, : len(ids)] = ids
        state["_table_blocks"][row, t] = len(ids)
    state["num_blocks"][row] = len(tables[0])


def add(state: dict, payload) -> dict:
    """Each entry: the row cleared, then its tokens, blocks, counters and feature values written."""
    state = _copy(state)
    for entry in payload.entries:
        row, n = entry.row, len(entry.token_ids)
        _clear_row(state, row)
        state["token_ids"][row, :n] = entry.token_ids
        _write_tables(state, row, entry.block_ids)
        state["num_tokens"][row], state["stop_len"][row] = n, entry.stop_len
        state["num_computed_tokens"][row] = entry.num_computed_tokens
        _set_if(state, "prefill_len", row, entry.prefill_len)
        _set_if(state, "lora_ids", row, entry.lora_id)
        if "mrope_positions" in state:
            state["mrope_positions"][row] = MROPE_MISSING_POSITION
            state["mrope_position_delta"][row] = entry.mrope_position_delta
            if entry.mrope_positions is not None:
                state["mrope_positions"][row, :, : entry.mrope_positions.shape[1]] = entry.mrope_positions
        if "is_token_ids" in state:
            state["is_token_ids"][row] = True
            state["prompt_embeds_start"][row] = entry.prompt_embeds_start
            if entry.is_token_ids is not None:
                state["is_token_ids"][row, : len(entry.is_token_ids)] = entry.is_token_ids
        if "output_bin_counts" in state:
            _admit_sampling(state, row, entry)
    return state


def _admit_sampling(state: dict, row: int, entry) -> None:
    """vLLM V2 ``Sampler.add_request``: the parameters, the prompt's bit mask, the outputs' counts."""
    values = entry.sampling
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        state[name][row] = np.float32(values[name])
    for name in ("top_k", "seeds", "seeds_set"):
        state[name][row] = values[name]
    vocab, prompt_len = state["output_bin_counts"].shape[1], values["prompt_len"]
    state["output_bin_counts"][row] = 0
    state["prompt_bin_mask"][row] = 0
    bits = np.zeros(state["prompt_bin_mask"].shape[1] * 32, bool)
    for position, token in enumerate(entry.token_ids):
        if 0 <= token < vocab:
            if position < prompt_len:
                bits[token] = True
            else:
                state["output_bin_counts"][row, token] += 1
    words = (bits.reshape(-1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    state["prompt_bin_mask"][row] = words.astype(np.uint32).view(np.int32)


def resume(state: dict, payload) -> dict:
    """Each entry: num_computed_tokens set; tokens (and num_tokens, prefill_len) and blocks replaced where given."""
    state = _copy(state)
    for entry in payload.entries:
        row = entry.row
        if not entry.unverified_drafts:  # else the device's own count stays (drafts still being verified)
            state["num_computed_tokens"][row] = entry.num_computed_tokens
        state["num_scheduled_tokens"][row] = state["num_draft_tokens"][row] = 0
        if entry.token_ids is not None:
            state["token_ids"][row, : len(entry.token_ids)] = entry.token_ids
            state["num_tokens"][row] = len(entry.token_ids)
        if entry.prefill_len is not None:
            _set_if(state, "prefill_len", row, entry.prefill_len)
        if entry.block_ids is not None:
            for t in range(len(_table_keys(state))):
                _table(state, t)[row] = NULL_BLOCK_ID
            _write_tables(state, row, entry.block_ids)
    return state


def append(state: dict, payload) -> dict:
    """Each segment's ids after the table's last allocated column (counted per table)."""
    state = _copy(state)
    for row, table, ids in payload.segments:
        column = int(state["_table_blocks"][row, table])
        _table(state, table)[row, column: column + len(ids)] = ids
        state["_table_blocks"][row, table] += len(ids)
        if table == 0:
            state["num_blocks"][row] += len(ids)
    return state


def lora_slots(state: dict, slots) -> dict:
    state = _copy(state)
    if slots is not None:
        state["lora_slots"][:] = slots
    return state


def schedule(state: dict, payload) -> dict:
    state = _copy(state)
    state["num_scheduled_tokens"][:] = payload.num_scheduled_tokens
    state["num_draft_tokens"][:] = payload.num_draft_tokens
    if "grammar_index" in state:
        state["grammar_index"][:] = payload.grammar_index
    for row, count in enumerate(payload.num_draft_tokens):
        start = state["num_tokens"][row]
        state["token_ids"][row, start: start + count] = payload.draft_token_ids[row, :count]
    return state


def apply_updates(state: dict, updates) -> dict:
    """finish, add, resume, append, lora_slots, schedule (the schedule only if there is one)."""
    state = finish(state, updates.finish.rows)
    state = append(resume(add(state, updates.add), updates.resume), updates.append)
    state = lora_slots(state, updates.lora_slots)
    return state if updates.schedule is None else schedule(state, updates.schedule)


def record_sampled(state: dict, idx_mapping, sampled_token_ids, num_sampled) -> dict:
    state = _copy(state)
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
            _set_if(state, "num_accepted_tokens", row, n)
            if "output_bin_counts" in state:
                for token in sampled_token_ids[b, :n]:
                    state["output_bin_counts"][row, token] += 1
        state["num_scheduled_tokens"][row] = state["num_draft_tokens"][row] = 0
    return state
