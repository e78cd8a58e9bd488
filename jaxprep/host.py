"""Prepared steps fetched to host memory in one transfer.

`prepare_padded` returns 12 device arrays; fetching them one by one costs about 1 µs each on
the CPU backend, more than the preparation itself at small batches. `prepare_to_host` computes
the same step in one executable that packs every int32 field except the block table into one
buffer, fetches it once, and hands out NumPy views of it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._expect import expect_bucket, expect_state_and_config
from jaxprep.config import PrepConfig
from jaxprep.metadata import AttentionMetadata, StepInputs
from jaxprep.prepare import prepare_step
from jaxprep.state import BatchState

# packed fields in buffer order: (name, length as a function of (tokens, requests) padded)
_PACKED_FIELDS = (
    ("input_ids", lambda t, r: t),
    ("positions", lambda t, r: t),
    ("slot_mapping", lambda t, r: t),
    ("query_start_loc", lambda t, r: r + 1),
    ("seq_lens", lambda t, r: r),
    ("logits_indices", lambda t, r: r),
    ("idx_mapping", lambda t, r: r),
    ("num_actual_tokens", lambda t, r: 1),
    ("num_reqs", lambda t, r: 1),
    ("max_query_len", lambda t, r: 1),
    ("max_seq_len", lambda t, r: 1),
    ("errors", lambda t, r: 1),
)
_SCALAR_FIELDS = frozenset({"num_actual_tokens", "num_reqs", "max_query_len", "max_seq_len", "errors"})


@functools.lru_cache(maxsize=None)
def packed_offsets(num_tokens_padded: int, num_reqs_padded: int) -> tuple[int, ...]:
    """Start of each packed field, plus the total length.

    # 8 tokens, 3 requests -> input_ids 0, positions 8, slot_mapping 16, query_start_loc 24, ... , total 44
    """
    offsets = [0]
    for _, length in _PACKED_FIELDS:
        offsets.append(offsets[-1] + length(num_tokens_padded, num_reqs_padded))
    return tuple(offsets)


def _flat_fields(step: StepInputs) -> dict:
    meta = step.attn_metadata
    return {
        "input_ids": step.input_ids, "positions": step.positions, "slot_mapping": meta.slot_mapping,
        "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
        "logits_indices": step.logits_indices, "idx_mapping": step.idx_mapping,
        "num_actual_tokens": meta.num_actual_tokens, "num_reqs": meta.num_reqs,
        "max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len, "errors": step.errors,
    }


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded"))
def prepare_packed(state: BatchState, config: PrepConfig, num_tokens_padded: int):
    """`prepare_step` with its int32 fields packed: returns (packed words, gathered block table)."""
    step = prepare_step(state, config, num_tokens_padded)
    fields = _flat_fields(step)
    words = jnp.concatenate([jnp.ravel(fields[name]) for name, _ in _PACKED_FIELDS])
    return words, step.attn_metadata.block_table


def unpack_host(words: np.ndarray, block_table: np.ndarray, num_tokens_padded: int) -> StepInputs:
    """A `StepInputs` of NumPy views into the fetched buffer (scalars as 0-d arrays)."""
    views = {name: words[piece] for name, piece in _packed_slices(num_tokens_padded, block_table.shape[0])}
    meta = AttentionMetadata(
        query_start_loc=views["query_start_loc"], seq_lens=views["seq_lens"], slot_mapping=views["slot_mapping"],
        block_table=block_table, num_actual_tokens=views["num_actual_tokens"], num_reqs=views["num_reqs"],
        max_query_len=views["max_query_len"], max_seq_len=views["max_seq_len"])
    return StepInputs(input_ids=views["input_ids"], positions=views["positions"],
                      logits_indices=views["logits_indices"], idx_mapping=views["idx_mapping"],
                      attn_metadata=meta, errors=views["errors"], num_tokens_padded=num_tokens_padded)


@functools.lru_cache(maxsize=None)
def _packed_slices(num_tokens_padded: int, num_reqs_padded: int) -> tuple[tuple[str, object], ...]:
    """(name, index) of every packed field: a slice, or ``(start, ...)`` for a 0-d view of a scalar."""
    offsets = packed_offsets(num_tokens_padded, num_reqs_padded)
    pieces = []
    for i, (name, _) in enumerate(_PACKED_FIELDS):
        scalar = name in _SCALAR_FIELDS
        pieces.append((name, (offsets[i], Ellipsis) if scalar else slice(offsets[i], offsets[i + 1])))
    return tuple(pieces)


def prepare_to_host(state: BatchState, config: PrepConfig, num_tokens_padded: int) -> StepInputs:
    """`prepare_padded`'s step as host NumPy arrays, fetched in two transfers instead of twelve."""
    expect_state_and_config("prepare_to_host", state, config)
    expect_bucket("prepare_to_host", num_tokens_padded, optional=False)
    words, block_table = prepare_packed(state, config, num_tokens_padded)
    return unpack_host(np.asarray(words), np.asarray(block_table), num_tokens_padded)
