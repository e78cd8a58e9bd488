"""Random batches for property tests, built from one description used by hypothesis and by NumPy fuzzing.

`build_batch(config, draw)` asks ``draw(lo, hi)`` (inclusive) for every choice, so a hypothesis
strategy (which shrinks) and a seeded NumPy generator (which is fast) make the same kinds of batches:
holes (rows without work that still hold tokens and blocks), one request, one token, a full budget,
and sequences that end exactly at ``max_model_len``.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from jaxprep.config import PrepConfig, cdiv

MODES = ("mixed", "single_request", "full_budget", "model_len_boundary")
VOCAB = 50_000


def build_batch(config: PrepConfig, draw) -> dict[str, np.ndarray]:
    rows, max_len, budget = config.max_num_reqs, config.max_model_len, config.max_num_batched_tokens
    mode = MODES[draw(0, len(MODES) - 1)]
    only_row = draw(0, rows - 1) if mode == "single_request" else None
    computed = np.zeros(rows, np.int32)
    scheduled = np.zeros(rows, np.int32)
    remaining = budget
    for row in range(rows):
        computed[row] = draw(0, max_len - 1)
        active = row == only_row if only_row is not None else draw(0, 2) > 0
        most = min(max_len - computed[row], remaining)
        if not active or most < 1:
            continue
        take_most = mode in ("full_budget", "model_len_boundary") and draw(0, 1)
        scheduled[row] = most if take_most else draw(1, most)
        remaining -= int(scheduled[row])
    if scheduled.sum() == 0:
        row = draw(0, rows - 1)
        computed[row] = draw(0, max_len - 1)
        scheduled[row] = draw(1, min(max_len - computed[row], budget))
    return dict(token_ids=_token_ids(config, draw), block_table=_block_table(config, computed + scheduled, draw),
                num_computed_tokens=computed, num_scheduled_tokens=scheduled)


def _token_ids(config: PrepConfig, draw) -> np.ndarray:
    seed = draw(0, 2**31 - 1)
    return np.random.default_rng(seed).integers(0, VOCAB, (config.max_num_reqs, config.max_model_len), np.int32)


def _block_table(config: PrepConfig, seq_lens: np.ndarray, draw) -> np.ndarray:
    """Distinct block ids >= 1 for every column a row uses; 0 (null) past them."""
    seed = draw(0, 2**31 - 1)
    needed = [cdiv(int(n), config.block_size) for n in seq_lens]
    return allocate_blocks(config.max_num_reqs, config.max_blocks_per_req, needed,
                           min(config.max_block_id, 2 * sum(needed) + 1), seed)


def allocate_blocks(rows: int, width: int, needed, highest: int, seed: int) -> np.ndarray:
    """``needed[r]`` distinct random ids from ``[1, highest]`` at the start of row r; 0 (null) past them."""
    table = np.zeros((rows, width), np.int32)
    pool = np.random.default_rng(seed).permutation(np.arange(1, highest + 1))
    start = 0
    for row, count in enumerate(needed):
        table[row, :count] = pool[start:start + count]
        start += count
    return table


@st.composite
def batches(draw, config: PrepConfig) -> dict[str, np.ndarray]:
    return build_batch(config, lambda lo, hi: draw(st.integers(lo, hi)))


def numpy_batches(config: PrepConfig, seed: int):
    """An endless stream of random batches from one seed."""
    rng = np.random.default_rng(seed)
    while True:
        yield build_batch(config, lambda lo, hi: int(rng.integers(lo, hi + 1)))
