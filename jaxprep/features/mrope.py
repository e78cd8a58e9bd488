"""M-RoPE positions (docs/semantics.md#m-rope): ``[3, T_pad]`` positions for Qwen2-VL-style models.

Each request carries its prompt's positions (`BatchState.mrope_positions`, built at admission,
e.g. by `qwen2vl_prompt_positions`) and a delta. A scheduled token at position ``p`` reads column
``p`` of its prompt positions while ``p < prefill_len`` (vLLM V2 reads its prefill positions
the same way; the columns of a resumed request's recomputed outputs hold ``p + delta``); after
that every row is ``p + delta`` (vLLM ``MRotaryEmbedding.get_next_input_positions_tensor``). Text-only requests
have positions ``arange`` on every row and delta 0, so they equal the 1-D positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxprep._constants import MROPE_MISSING_POSITION, MROPE_POSITION_LIMIT, PAD_POSITION
from jaxprep._typing import Array, Bool, Int32
from jaxprep.bounds import InvalidBatchError
from jaxprep.features.config import MROPE_NUM_DIMS
from jaxprep.features.flags import MROPE_POSITION_MISSING
from jaxprep.features.record import Feature


def mrope_positions(prompt_positions: Int32[Array, "max_num_reqs 3 max_model_len"],
                    position_delta: Int32[Array, " max_num_reqs"], prefill_len: Int32[Array, " max_num_reqs"],
                    token_rows: Int32[Array, " num_tokens_padded"], positions: Int32[Array, " num_tokens_padded"],
                    is_real_token: Bool[Array, " num_tokens_padded"]):
    """``(positions [3, T_pad], error bits)``: the M-RoPE positions of the scheduled tokens; padded
    tokens `PAD_POSITION`, and so are (on bad input) tokens whose position would leave
    ``[0, MROPE_POSITION_LIMIT)``: a missing prompt position (-1), a negative or too large one, or a
    completion ``p + delta`` outside it, which sets `MROPE_POSITION_MISSING`.

    ```
    # P=9, delta=-2, positions [7, 8, 9, 10] -> table columns 7 and 8, then [7, 8] on every row
    ```
    """
    in_prompt = positions < prefill_len[token_rows]
    from_prompt = prompt_positions[token_rows, :, positions].T  # [3, T_pad]
    completion = positions + position_delta[token_rows]
    out = jnp.where(in_prompt[None, :], from_prompt, completion[None, :])
    bad = is_real_token & jnp.any((out < 0) | (out >= MROPE_POSITION_LIMIT), axis=0)
    errors = jnp.where(jnp.any(bad), jnp.int32(MROPE_POSITION_MISSING), 0)
    return jnp.where((is_real_token & ~bad)[None, :], out, PAD_POSITION), errors


def qwen2vl_prompt_positions(segments: Sequence, *, spatial_merge_size: int = 2,
                             tokens_per_second: float = 1.0) -> tuple[np.ndarray, int]:
    """Qwen2-VL prompt positions ``[3, P]`` (temporal, height, width) and the delta, on the host.

    ``segments`` in prompt order: an int ``L`` (a run of ``L`` text tokens), ``("image", (t, h, w))``
    or ``("video", (t, h, w), second_per_grid_t)`` with the grid in patches (vLLM
    ``image_grid_thw``); a feature has ``t * (h // m) * (w // m)`` tokens for merge size ``m``.
    Each segment starts one past the largest earlier position (0 first); text counts up on all
    rows, a feature lays out its merged grid in ``(t, h, w)`` order, with the temporal index
    scaled by ``second_per_grid_t * tokens_per_second`` for videos.
    ``delta = max(positions) + 1 - P``.

    ```
    # [2, ("image", (1, 4, 4)), 3], merge 2 -> T [0,1, 2,2,2,2, 4,5,6], H [0,1, 2,2,3,3, 4,5,6],
    #   W [0,1, 2,3,2,3, 4,5,6]; delta = 7 - 9 = -2
    ```
    """
    columns = []
    start = 0
    for segment in segments:
        if isinstance(segment, (int, np.integer)):
            block = np.broadcast_to(start + np.arange(int(segment)), (MROPE_NUM_DIMS, int(segment)))
        else:
            block = _feature_positions(segment, spatial_merge_size, tokens_per_second) + start
        columns.append(block)
        if block.shape[1]:
            start = int(block.max()) + 1
    positions = np.concatenate(columns, axis=1) if columns else np.zeros((MROPE_NUM_DIMS, 0), np.int64)
    delta = (int(positions.max()) + 1 if positions.size else 0) - positions.shape[1]
    return positions.astype(np.int32), delta


def _feature_positions(segment, spatial_merge_size: int, tokens_per_second: float) -> np.ndarray:
    """``[3, t*h'*w']`` grid indices of one image or video, before the start offset."""
    kind, (t, h, w) = segment[0], segment[1]
    if kind == "image":
        time_scale = 1.0
    elif kind == "video":
        time_scale = float(segment[2]) * tokens_per_second
    else:
        raise ValueError(f"M-RoPE segment kind {kind!r} must be 'image' or 'video'")
    if h % spatial_merge_size or w % spatial_merge_size:
        raise ValueError(f"{kind} grid {(t, h, w)} is not divisible by spatial_merge_size={spatial_merge_size}")
    grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(h // spatial_merge_size),
                                         np.arange(w // spatial_merge_size), indexing="ij")
    temporal = np.array([math.floor(i * time_scale) for i in grid_t.ravel()], np.int64)
    return np.stack([temporal, grid_h.ravel(), grid_w.ravel()])


def check_prompt_positions(table: np.ndarray, prompt, computed, scheduled, delta=None) -> None:
    """Host check: the prompt columns a step reads (``[C, min(C + S, P))``) are filled (>= 0) and below
    `MROPE_POSITION_LIMIT` on every row, and so are the completion positions ``p + delta`` of the
    tokens past the prompt."""
    columns = np.arange(table.shape[2])
    read = ((scheduled > 0)[:, None] & (columns[None, :] >= computed[:, None])
            & (columns[None, :] < np.minimum(computed + scheduled, prompt)[:, None]))
    missing = read & (table < 0).any(axis=1)
    if missing.any():
        row, column = (int(i[0]) for i in np.nonzero(missing))
        value = int(table[row, :, column].min())
        what = f"missing ({value})" if value == MROPE_MISSING_POSITION else f"negative ({value})"
        raise InvalidBatchError(f"mrope_positions[{row}, :, {column}] is {what}, but row {row} schedules prompt "
                                f"position {column}: fill its prompt positions (text-only: arange)")
    too_large = read & (table >= MROPE_POSITION_LIMIT).any(axis=1)
    if too_large.any():
        row, column = (int(i[0]) for i in np.nonzero(too_large))
        raise InvalidBatchError(f"mrope_positions[{row}, :, {column}] is {int(table[row, :, column].max())}, at or "
                                f"past MROPE_POSITION_LIMIT={MROPE_POSITION_LIMIT} (float32 rotary angles)")
    if delta is None:
        return
    first_completion = np.maximum(computed, prompt)  # the first scheduled position past the prompt
    last = computed + scheduled - 1
    # a row past max_model_len (the table's width) is the core check's to name (`jaxprep.validate`)
    outside = ((scheduled > 0) & (last >= prompt) & (last < table.shape[2])
               & ((first_completion + delta < 0) | (last + delta >= MROPE_POSITION_LIMIT)))
    if outside.any():
        row = int(np.flatnonzero(outside)[0])
        raise InvalidBatchError(f"mrope_position_delta at row {row} is {int(delta[row])}: the completion positions "
                                f"{int(first_completion[row])}..{int(last[row])} + delta leave "
                                f"[0, MROPE_POSITION_LIMIT={MROPE_POSITION_LIMIT})")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _empty_inputs(config) -> dict[str, np.ndarray]:
    rows, width = config.max_num_reqs, config.max_model_len
    return {"mrope_positions": np.full((rows, MROPE_NUM_DIMS, width), MROPE_MISSING_POSITION, np.int32),
            "mrope_position_delta": np.zeros((rows,), np.int32)}


def _check_values(host, computed, scheduled, config) -> None:
    check_prompt_positions(host["mrope_positions"], host["prefill_len"].astype(np.int64), computed, scheduled,
                           host["mrope_position_delta"].astype(np.int64))


def _metadata(build) -> None:
    state, layout = build.state, build.layout
    build.outputs["mrope_positions"], mrope_errors = mrope_positions(
        state.mrope_positions, state.mrope_position_delta, state.prefill_len, layout.token_rows, build.step.positions,
        layout.is_real_token)
    build.errors = build.errors | mrope_errors


FEATURE = Feature(
    name="mrope",
    is_on=lambda features: features.mrope,
    inputs=lambda features: {"mrope_positions": "mrope", "mrope_position_delta": "mrope"},
    empty_inputs=_empty_inputs,
    check_values=_check_values,
    messages=lambda config: {
        MROPE_POSITION_MISSING: "mrope_positions is missing (-1) or outside [0, MROPE_POSITION_LIMIT=2**24) at a "
                                "scheduled prompt position, or a completion position (position + "
                                "mrope_position_delta) leaves [0, 2**24)"},
    metadata=_metadata,
)
