"""NumPy reference of the per-token features (docs/semantics.md#prompt-embeddings, #m-rope, #ascend-masks), for reading:
M-RoPE positions, prompt embeddings and row masks.

Loops over tokens and requests, written from the descriptions in docs/semantics.md rather than from the jitted
formulas (M-RoPE by vLLM V1's prompt/completion split). The oracle of the feature tests.
"""

from __future__ import annotations

import math

import numpy as np


def mrope_reference(prompt_positions, deltas, prefill_len, num_computed, num_scheduled) -> np.ndarray:
    """vLLM V1 ``_calc_mrope_positions`` (docs/semantics.md#m-rope) over the batch rows: ``[3, N]``.

    ``prompt_positions[r]`` is the ``[3, >= P]`` table of batch row r.
    """
    columns = []
    for table, delta, prompt, computed, scheduled in zip(prompt_positions, deltas, prefill_len,
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
    """Qwen2-VL ``get_mrope_input_positions`` as docs/semantics.md#m-rope states it: ``st`` + text run ``L`` + grid
    index."""
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
