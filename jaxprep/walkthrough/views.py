"""What a step looks like as small arrays: token-table cells, KV-cache slots, the attention pattern.

Shared by the terminal tables (`jaxprep.walkthrough.text`) and the pictures (`jaxprep.walkthrough.plotting`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep.walkthrough.record import NO_REQUEST, StepRecord

# token-table cell states
EMPTY, CACHED, SCHEDULED, WAITING = 0, 1, 2, 3
CELL_NAMES = {EMPTY: "empty", CACHED: "KV cached", SCHEDULED: "scheduled now", WAITING: "known, not yet scheduled"}

# attention-pattern entries
HIDDEN, CACHED_KEY, NEW_KEY = 0, 1, 2


def token_table_states(record: StepRecord) -> np.ndarray:
    """[max_num_reqs, max_model_len] cell states of the token table as the step reads it.

    ```
    # computed 5, scheduled 3, known tokens 8 (M 12) -> [C C C C C S S S . . . .]
    # computed 0, scheduled 5, known tokens 8        -> [S S S S S W W W . . . .]
    ```
    """
    positions = np.arange(record.config.max_model_len)[None, :]
    computed, scheduled = record.computed[:, None], record.scheduled[:, None]
    known = np.maximum(record.num_tokens, record.computed + record.scheduled)[:, None]
    states = np.where(positions < computed, CACHED,
                      np.where(positions < computed + scheduled, SCHEDULED,
                               np.where(positions < known, WAITING, EMPTY)))
    return np.where(record.request_ids[:, None] >= 0, states, EMPTY)


@dataclasses.dataclass(frozen=True)
class KVCacheView:
    """The KV cache after the step wrote its tokens, one entry per slot ``[num_blocks, block_size]``."""

    request: np.ndarray  # request whose K/V the slot holds; NO_REQUEST: free
    position: np.ndarray  # that token's position; NO_REQUEST: free
    new: np.ndarray  # bool: written by this step (its slot is in slot_mapping)

    @property
    def num_used(self) -> int:
        return int((self.request >= 0).sum())


def kv_cache_view(record: StepRecord) -> KVCacheView:
    """Slots of every request's positions ``0 .. computed + scheduled - 1`` (docs/semantics.md#slot-mapping).

    ```
    # B 2, row [4, 5, 6, 8], computed 5, scheduled 3 -> p5 in block 6 slot 1 (slot 13), p6 -> slot 16
    ```
    """
    block_size, table = record.config.block_size, record.state["block_table"]
    num_blocks = record.config.num_blocks or int(table.max()) + 1
    request = np.full((num_blocks, block_size), NO_REQUEST)
    position, new = np.full_like(request, NO_REQUEST), np.zeros(request.shape, bool)
    for row in np.flatnonzero(record.request_ids >= 0):
        computed = int(record.computed[row])
        for p in range(computed + int(record.scheduled[row])):
            block, offset = int(table[row, p // block_size]), p % block_size
            request[block, offset] = record.request_ids[row]
            position[block, offset], new[block, offset] = p, p >= computed
    return KVCacheView(request=request, position=position, new=new)


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """Which keys each query token of the step attends to (docs/semantics.md#causal-mask), keys grouped by request."""

    pattern: np.ndarray  # [num_actual_tokens, num_keys] HIDDEN / CACHED_KEY / NEW_KEY
    key_requests: np.ndarray  # [num_keys] request of each key
    key_positions: np.ndarray  # [num_keys] position of each key inside its request
    query_requests: np.ndarray  # [num_actual_tokens]
    query_positions: np.ndarray  # [num_actual_tokens]


def attention_pattern(record: StepRecord) -> AttentionPattern:
    """From ``query_start_loc``, ``seq_lens`` and ``positions``: query t of request r sees keys
    ``j <= positions[t]`` of r only (bottom-right aligned causal); keys ``j >= seq_len - S`` are new.

    ```
    # seq_lens [4, 3, 8], S [1, 1, 3]: keys r0 p0..3, r1 p0..2, r2 p0..7 (15 keys);
    # r2's query at p6 sees r2's keys p0..4 (cached) and p5..6 (new), and nothing of r0 or r1
    ```
    """
    qsl, seq_lens = record.unpadded("query_start_loc"), record.unpadded("seq_lens")
    positions = record.unpadded("positions")
    requests = record.request_ids[record.batch_rows]
    key_requests = np.repeat(requests, seq_lens)
    key_positions = np.concatenate([np.arange(n) for n in seq_lens]) if len(seq_lens) else np.zeros(0, int)
    key_new = key_positions >= np.repeat(seq_lens - np.diff(qsl), seq_lens)
    query_requests = np.repeat(requests, np.diff(qsl))
    visible = (query_requests[:, None] == key_requests[None, :]) & (key_positions[None, :] <= positions[:, None])
    pattern = np.where(visible, np.where(key_new, NEW_KEY, CACHED_KEY)[None, :], HIDDEN)
    return AttentionPattern(pattern=pattern, key_requests=key_requests, key_positions=key_positions,
                            query_requests=query_requests, query_positions=positions)
