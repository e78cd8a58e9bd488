"""NumPy reference of the per-token features (SPEC §2.10-§2.14, PEERS §2.3), for reading.

Loops over tokens and requests, written from SPEC's descriptions rather than from the jitted
formulas where a more direct description exists (DCP by dealing chunks out to ranks, M-RoPE by
vLLM V1's prompt/completion split). The oracle of the feature tests.
"""

from __future__ import annotations

import math

import numpy as np

from jaxprep._constants import NULL_BLOCK_ID, PAD_SLOT_ID


def kernel_block_table_reference(block_table, k: int) -> np.ndarray:
    """SPEC §2.12 ``kernel_bt[r, c*k + j] = BT[r, c] * k + j``; the null block stays null (DIVERGENCES.md)."""
    block_table = np.asarray(block_table, np.int64)
    rows, width = block_table.shape
    out = np.zeros((rows, width * k), np.int64)
    for r in range(rows):
        for c in range(width):
            for j in range(k):
                block = block_table[r, c]
                out[r, c * k + j] = NULL_BLOCK_ID if block == NULL_BLOCK_ID else block * k + j
    return out


def sliding_window_reference(block_table, num_computed, sliding_window: int, block_size: int) -> np.ndarray:
    """SPEC §2.14 (vLLM V2): columns ``< max(C - (window - 1), 0) // B`` read the null block."""
    out = np.array(block_table, np.int64)
    for r, computed in enumerate(num_computed):
        out[r, : max(int(computed) - (sliding_window - 1), 0) // block_size] = NULL_BLOCK_ID
    return out


def _dcp_owner_and_local_offset(position: int, block_size: int, world: int, interleave: int) -> tuple[int, int, int]:
    """Deals the tokens of a virtual block (``B * W`` tokens) to the ranks, ``interleave`` at a time.

    Returns (virtual block index, owning rank, index of the token among that rank's tokens of the block).
    """
    span = block_size * world
    virtual_block, offset = divmod(position, span)
    owners = [(o // interleave) % world for o in range(span)]
    owner = owners[offset]
    local = sum(1 for o in range(offset) if owners[o] == owner)
    return virtual_block, owner, local


def dcp_slot_mapping_reference(positions, token_rows, block_table, block_size: int, world: int, rank: int,
                               interleave: int) -> np.ndarray:
    """SPEC §2.13: slot of each token on ``rank``, -1 for tokens another rank stores."""
    slots = []
    for position, row in zip(positions, token_rows):
        virtual_block, owner, local = _dcp_owner_and_local_offset(int(position), block_size, world, interleave)
        slots.append(block_table[row][virtual_block] * block_size + local if owner == rank else PAD_SLOT_ID)
    return np.array(slots, np.int64)


def dcp_local_seq_lens_reference(seq_lens, block_size: int, world: int, rank: int, interleave: int) -> np.ndarray:
    """Tokens of each sequence that ``rank`` stores."""
    return np.array([sum(1 for p in range(int(n)) if _dcp_owner_and_local_offset(p, block_size, world, interleave)[1]
                         == rank) for n in seq_lens], np.int64)


def mrope_reference(prompt_positions, deltas, num_prompt_tokens, num_computed, num_scheduled) -> np.ndarray:
    """vLLM V1 ``_calc_mrope_positions`` (SPEC §2.11) over the batch rows: ``[3, N]``.

    ``prompt_positions[r]`` is the ``[3, >= P]`` table of batch row r.
    """
    columns = []
    for table, delta, prompt, computed, scheduled in zip(prompt_positions, deltas, num_prompt_tokens,
                                                         num_computed, num_scheduled):
        table = np.asarray(table)
        prompt_part = max(0, prompt - computed) if computed + scheduled > prompt else scheduled
        completion = scheduled - prompt_part
        columns.append(table[:, computed: computed + prompt_part])
        next_positions = delta + computed + prompt_part + np.arange(completion)
        columns.append(np.broadcast_to(next_positions, (table.shape[0], completion)))
    return np.concatenate(columns, axis=1).astype(np.int64)


def qwen2vl_positions_reference(segments, spatial_merge_size: int = 2,
                                tokens_per_second: float = 1.0) -> tuple[np.ndarray, int]:
    """Qwen2-VL ``get_mrope_input_positions`` as SPEC §2.11 states it: ``st`` + text run ``L`` + grid index."""
    rows = [[], [], []]
    st = 0
    pending_text = 0
    for segment in list(segments) + [None]:
        if isinstance(segment, int):
            pending_text += segment
            continue
        text_len = pending_text
        for row in rows:
            row.extend(st + i for i in range(text_len))
        pending_text = 0
        if segment is None:
            break
        kind, (t, h, w) = segment[0], segment[1]
        t_factor = 1.0 if kind == "image" else float(segment[2]) * tokens_per_second
        for i_t in range(t):
            for i_h in range(h // spatial_merge_size):
                for i_w in range(w // spatial_merge_size):
                    rows[0].append(math.floor(i_t * t_factor) + text_len + st)
                    rows[1].append(i_h + text_len + st)
                    rows[2].append(i_w + text_len + st)
        st = max(max(r) for r in rows) + 1
    positions = np.array(rows, np.int64)
    delta = (int(positions.max()) + 1 if positions.size else 0) - positions.shape[1]
    return positions, delta


def prompt_embeds_reference(is_token_ids, prompt_embeds_start, token_rows, positions) -> tuple[np.ndarray, np.ndarray]:
    """Per token: is it a token id, and if not, which pool row holds its embedding (0 otherwise)."""
    flags, indices = [], []
    for row, position in zip(token_rows, positions):
        is_token = bool(is_token_ids[row][position])
        flags.append(is_token)
        indices.append(0 if is_token else int(prompt_embeds_start[row]) + int(position))
    return np.array(flags, bool), np.array(indices, np.int64)


def row_mask_reference(positions, columns: int) -> np.ndarray:
    """Row t masks (True) every KV position after token t's position."""
    return np.array([[j > p for j in range(columns)] for p in positions], bool)
