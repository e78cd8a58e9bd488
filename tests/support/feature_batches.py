"""Random batches with feature inputs for the feature tests, and a runner for eager and jit steps.

`build_feature_batch(config, draw, ...)` asks ``draw(lo, hi)`` (inclusive) for every choice, so a
hypothesis strategy (`feature_batches`) shrinks it. Rows are decodes (``S == 1 + D``), prefill
chunks or anything in between; some rows hold tokens but have no work.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from hypothesis import strategies as st

from jaxprep import BatchState, prepare_inputs, validate
from jaxprep.config import cdiv
from support.batches import allocate_blocks

VOCAB = 50_000
RUN_MODES = ("jit", "eager")
KERNEL_MODES = (*RUN_MODES, "pallas")
"""`RUN_MODES` and the fused Pallas step (``PrepConfig.kernel="pallas"``, Pallas' interpreter on CPU), for
tests whose features the kernels cover (spec decode, the batch orders, V2's logits rows)."""


def run_step(arrays: dict, config, mode: str, num_tokens_padded: int | None = None):
    """Validates and prepares ``arrays`` under jit, op by op (``mode="eager"``, `jax.disable_jit`), or
    under jit on the fused kernels (``mode="pallas"``)."""
    if mode == "pallas":
        config = dataclasses.replace(config, kernel="pallas")
    state = BatchState.from_numpy(**arrays)
    validate(state, config)
    bucket = num_tokens_padded or config.bucket_for(int(np.sum(arrays["num_scheduled_tokens"])))
    if mode == "eager":
        with jax.disable_jit():
            return prepare_inputs(state, config, bucket)
    return prepare_inputs(state, config, bucket)


def build_feature_batch(config, draw, *, max_drafts: int = 0) -> dict[str, np.ndarray]:
    """Core tables plus ``num_draft_tokens`` (if ``max_drafts``) and ``prefill_len``."""
    rows, max_len = config.max_num_reqs, config.max_model_len
    computed, scheduled, drafts = (np.zeros(rows, np.int32) for _ in range(3))
    remaining = config.max_num_batched_tokens
    for row in range(rows):
        drafts[row] = draw(0, max_drafts) if max_drafts else 0
        computed[row] = draw(0, max_len - 1 - drafts[row])
        most = min(max_len - computed[row], remaining)
        if draw(0, 2) == 0 or most < drafts[row] + 1:
            continue
        kind = draw(0, 2)  # 0: decode, 1: chunk of up to 8 tokens, 2: anything that fits
        least = drafts[row] + 1
        scheduled[row] = least if kind == 0 else draw(least, min(most, least + 7) if kind == 1 else most)
        remaining -= int(scheduled[row])
    if scheduled.sum() == 0:
        row = draw(0, rows - 1)
        drafts[row], computed[row] = 0, draw(0, max_len - 1)
        scheduled[row] = draw(1, min(max_len - computed[row], config.max_num_batched_tokens))
    seq_lens = computed + scheduled
    arrays = dict(token_ids=token_table(config, draw(0, 2**31 - 1)),
                  block_table=block_table(config.max_num_reqs, config.max_blocks_per_req, seq_lens,
                                          config.block_size, draw(0, 2**31 - 1)),
                  num_computed_tokens=computed, num_scheduled_tokens=scheduled,
                  prefill_len=np.array([draw(0, max_len) for _ in range(rows)], np.int32))
    if max_drafts:
        arrays["num_draft_tokens"] = drafts
    return arrays


def token_table(config, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, (config.max_num_reqs, config.max_model_len), np.int32)


def block_table(rows: int, width: int, seq_lens, block_size: int, seed: int, tokens_per_column: int | None = None):
    """Distinct block ids >= 1 for every column a row uses; 0 (null) past them."""
    needed = [cdiv(int(n), tokens_per_column or block_size) for n in seq_lens]
    return allocate_blocks(rows, width, needed, 4 * sum(needed) + 1, seed)


@st.composite
def feature_batches(draw, config, **kwargs) -> dict[str, np.ndarray]:
    return build_feature_batch(config, lambda lo, hi: draw(st.integers(int(lo), int(hi))), **kwargs)


def pad(values, length: int, fill) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``length`` entries."""
    values = np.asarray(values)
    out = np.full((length,) + values.shape[1:], fill, dtype=np.int64 if values.dtype != bool else bool)
    out[: len(values)] = values
    return out


def batch_rows(arrays: dict) -> np.ndarray:
    """State rows of the batch in row order."""
    return np.flatnonzero(np.asarray(arrays["num_scheduled_tokens"]) > 0)

