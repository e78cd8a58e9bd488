"""Launch 1 of the fused step, `rows_kernel`: the batch rows, their order, and every per-request output.

Grid (1,) in state-row order: one program holds every state row's counts in one block of
``next_pow2(R)`` lanes and scans them (``tl.cumsum``). Grid (cdiv(R, row_block),) under a batch
order (`FeatureConfig.batch_order`, V2's sort or decode-first): program p ranks state rows
``[p * row_block, (p + 1) * row_block)`` against every state row, chunk by chunk, by their sort key
(a stable sort written as counts: a row's batch row is the number of rows that sort before it), so
no program waits on another; program 0 writes the step's totals and the padded rows.

Per batch row it writes ``idx_mapping``, ``query_start_loc``, ``seq_lens``, ``logits_indices`` and,
when on, the spec-decode counts (``num_draft_tokens``, ``cu_num_draft_tokens``,
``cu_num_sampled_tokens``, ``bonus_logits_indices``) and V2's ``cu_num_logits`` and
``num_draft_tokens_per_req``; then the 0-d counts and maxima and the error bits of the counts. A row
that breaks a row-level bound is dropped from the batch (its scheduled count taken as 0; over the
bucket every row is), as `jaxprep.validate.flag_rows` drops it on the XLA path (both take the bounds
of `jaxprep.bounds.core_row_flags`). It zeroes the token kernel's error scratch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxprep._constants import INT32_MIN, PAD_LOGITS_INDEX, PAD_NUM_DRAFT_TOKENS, PAD_SEQ_LEN, PAD_STATE_ROW
from jaxprep.bounds import OVER_BUCKET, core_row_flags
from jaxprep.features.spec_decode import draft_row_flags
from jaxprep.kernels.common import TOKEN_FLAGS, Sizes, any_lane, pow2

NOT_IN_BATCH = 3
"""Primary sort key of a row without work: after every real request (`jaxprep.features.reorder`)."""


def inputs(sizes: Sizes) -> tuple[str, ...]:
    return ("num_computed_tokens", "num_scheduled_tokens") + (("num_draft_tokens",) if sizes.spec_decode else ())


def outputs(sizes: Sizes) -> dict[str, jax.ShapeDtypeStruct]:
    """Every output by name (int32); the 0-d ones are (1,), reshaped by the wrapper."""
    rp = sizes.num_reqs_padded
    shapes = dict(query_start_loc=(rp + 1,), seq_lens=(rp,), idx_mapping=(rp,), logits_indices=(rp,), num_reqs=(1,),
                  num_actual_tokens=(1,), max_query_len=(1,), max_seq_len=(1,), errors=(1,),
                  seen=(len(TOKEN_FLAGS),))
    if sizes.spec_decode:
        shapes.update(num_draft_tokens_out=(rp,), cu_num_draft_tokens=(rp,), cu_num_sampled_tokens=(rp,),
                      bonus_logits_indices=(rp,), max_spec_len=(1,))
    if sizes.indirection:
        shapes.update(cu_num_logits=(rp + 1,), num_draft_tokens_per_req=(rp,))
    return {name: jax.ShapeDtypeStruct(shape, jnp.int32) for name, shape in shapes.items()}


class Rows(NamedTuple):
    """State rows ``lanes`` as the step sees them: flagged rows (and, over the bucket, every row) dropped."""

    lanes: jax.Array  # state row of each lane
    in_table: jax.Array  # lane < R
    computed: jax.Array
    scheduled: jax.Array  # 0 for a dropped row
    drafts: jax.Array  # D of a row with work, else 0
    has_work: jax.Array
    errors: jax.Array  # the error bits of these rows' counts (0-d), OVER_BUCKET apart


def rows_kernel(refs: dict, *, sizes: Sizes):
    """Grid (`Sizes.num_row_programs`,): see the module docstring."""
    over = _over_bucket(refs, sizes)
    if sizes.order is None:
        every = _rows_at(refs, 0, pow2(sizes.num_rows), sizes, over)
        # S [0, 3, 0, 2] -> has_work [0,1,0,1] -> counts [0,1,1,2], ends [0,3,3,5] -> batch rows [-,0,-,1]
        rank = jnp.cumsum(every.has_work.astype(jnp.int32)) - 1
        _write_batch_rows(refs, every, rank, jnp.cumsum(every.scheduled), jnp.cumsum(every.drafts), sizes)
        _write_totals(refs, over, sizes, every)
        return
    pl.when(pl.program_id(0) == 0)(functools.partial(_write_totals, refs, over, sizes))
    block = _rows_at(refs, pl.program_id(0) * sizes.row_block, sizes.row_block, sizes, over)
    _write_batch_rows(refs, block, *_ranks(refs, block, over, sizes), sizes)


def _rows_at(refs, start, count: int, sizes: Sizes, over) -> Rows:
    """State rows ``[start, start + count)`` (``count`` a power of two; lanes past R read 0), with the
    error bits of their counts (`_row_flags`); a flagged row, and every row when ``over``, is dropped."""
    lanes = start + jnp.arange(count, dtype=jnp.int32)
    in_table = lanes < sizes.num_rows
    window = pl.ds(start, count)
    requested = plgpu.load(refs["num_scheduled_tokens"].at[window], mask=in_table, other=0)
    computed = plgpu.load(refs["num_computed_tokens"].at[window], mask=in_table, other=0)
    drafts = (plgpu.load(refs["num_draft_tokens"].at[window], mask=in_table, other=0) if sizes.spec_decode
              else jnp.zeros_like(requested))
    flags = _row_flags(computed, requested, drafts, in_table, sizes)
    dropped = functools.reduce(jnp.logical_or, [mask for _, mask in flags]) | (over > 0)
    errors = functools.reduce(jnp.bitwise_or, [any_lane(mask) * bit for bit, mask in flags])
    scheduled = jnp.where(dropped, 0, requested)
    has_work = in_table & (scheduled > 0)
    return Rows(lanes, in_table, computed, scheduled, jnp.where(has_work, drafts, 0), has_work, errors)


def _row_flags(computed, scheduled, drafts, in_table, sizes: Sizes) -> list[tuple[int, jax.Array]]:
    """``(bit, rows that break its bound)``: the XLA path's row bounds (`jaxprep.bounds.core_row_flags`, and
    `jaxprep.features.spec_decode.draft_row_flags` with spec decode) over the lanes inside the table;
    OVER_BUCKET is `_over_bucket`'s.

    ```
    # computed [3, -1, 30], scheduled [2, 1, 4], M 32 -> NEGATIVE_COUNT [0,1,0], PAST_MAX_MODEL_LEN [0,0,1]
    ```
    """
    flags = core_row_flags(computed, scheduled, sizes.max_model_len)
    if sizes.spec_decode:
        flags += draft_row_flags(drafts, scheduled, sizes.num_speculative_tokens)
    return [(bit, in_table & mask) for bit, mask in flags]


def _over_bucket(refs, sizes: Sizes):
    """1 if the scheduled total exceeds T: the counts clipped to [0, T + 1] sum past T exactly when the
    true total does (no int32 wrap); every program computes it (it decides which rows are dropped)."""
    lanes = jnp.arange(pow2(sizes.num_rows), dtype=jnp.int32)
    requested = plgpu.load(refs["num_scheduled_tokens"].at[pl.ds(0, lanes.size)], mask=lanes < sizes.num_rows,
                           other=0)
    clipped_total = jnp.sum(jnp.clip(requested, 0, sizes.num_tokens_padded + 1))
    return (clipped_total > sizes.num_tokens_padded).astype(jnp.int32)


def _ranks(refs, block: Rows, over, sizes: Sizes):
    """``(rank, inclusive token end, inclusive draft end)`` of each row of ``block`` in the batch order:
    how many rows sort before it, and the tokens and drafts of those rows and itself. Chunks of
    `Sizes.row_block` rows are compared against the block in turn ([row_block, row_block] per step).

    ```
    # keys [5, 2, 5, 9(no work)], S [3, 1, 2, 0], ascending ties -> ranks [1, 0, 2, 3], ends [4, 1, 6, 6]
    ```
    """
    key, tie = _sort_key(block, sizes)
    width = sizes.row_block

    def compare_chunk(chunk, carry):
        rank, ends, drafts = carry
        other = _rows_at(refs, chunk * width, width, sizes, over)
        other_key, other_tie = _sort_key(other, sizes)
        lower, equal = other_key[None, :] < key[:, None], other_key[None, :] == key[:, None]
        before = other.in_table[None, :] & (lower | (equal & (other_tie[None, :] < tie[:, None])))
        upto = before | (other.lanes[None, :] == block.lanes[:, None])
        return (rank + jnp.sum(before.astype(jnp.int32), axis=1),
                ends + jnp.sum(jnp.where(upto, other.scheduled[None, :], 0), axis=1),
                drafts + jnp.sum(jnp.where(upto, other.drafts[None, :], 0), axis=1))

    zeros = jnp.zeros(block.lanes.shape, jnp.int32)
    return jax.lax.fori_loop(0, -(-sizes.num_rows // width), compare_chunk, (zeros, zeros, zeros))


def _sort_key(rows: Rows, sizes: Sizes):
    """``(key, tie)``: rows sort by ascending key, then ascending tie; `jaxprep.features.reorder.reordered_rows`
    as one integer per row.

    - "decode_first": key 0 for a decode (S == 1 + D), 1 for the rest, NOT_IN_BATCH without work;
    - "v2": V2's ``(not has_drafts, S != 1 + K, S)`` as ``(primary * 2 + (S != 1 + K)) * (T + 1) + S``
      (S <= T on a row with work; at most 8 (T + 1), checked by the wrapper to fit int32);
    - ties by ascending state row, or descending under ``runner="v2"`` (V2's slots: arrival order).
    ```
    # v2, K 1, T 8: S [2, 5, 1], D [1, 0, 0] -> primary [0, 1, 1], S != 2 [0, 1, 1] -> keys [2, 32, 28]
    ```
    """
    scheduled, drafts, has_work = rows.scheduled, rows.drafts, rows.has_work
    if sizes.order == "decode_first":
        key = jnp.where(has_work, jnp.where(scheduled == 1 + drafts, 0, 1), NOT_IN_BATCH)
    else:
        primary = jnp.where(has_work, jnp.where(drafts > 0, 0, 1), NOT_IN_BATCH)
        secondary = (scheduled != 1 + sizes.num_speculative_tokens).astype(jnp.int32)
        key = (primary * 2 + secondary) * (sizes.num_tokens_padded + 1) + scheduled
    tie = (sizes.num_rows - 1 - rows.lanes) if sizes.descending_ties else rows.lanes
    return key, tie


def _write_batch_rows(refs, rows: Rows, rank, ends, draft_ends, sizes: Sizes):
    """Scatters each row with work to batch row ``rank``: rows past the bucket's batch (none once the
    bucket check holds: each row schedules a token) and rows without work store nothing.

    ```
    # rank [-, 0, -, 1], ends [0, 3, 3, 5], computed [_, 4, _, 7], scheduled [0, 3, 0, 2]
    #   -> idx_mapping [1, 3], query_start_loc [0, 3, 5], seq_lens [7, 9], logits_indices [2, 4]
    ```
    """
    in_batch = rows.has_work & (rank < sizes.num_reqs_padded)
    batch_row = jnp.where(in_batch, rank, sizes.num_reqs_padded)
    sampled_ends = draft_ends + rank + 1  # every batch row samples its drafts and one bonus token

    def put(name, values, shift=0):
        plgpu.store(refs[name].at[batch_row + shift], values, mask=in_batch)

    put("idx_mapping", rows.lanes)
    put("query_start_loc", ends, shift=1)
    put("seq_lens", rows.computed + rows.scheduled)
    put("logits_indices", ends - 1)
    if sizes.spec_decode:
        put("num_draft_tokens_out", rows.drafts)
        put("cu_num_draft_tokens", draft_ends)
        put("cu_num_sampled_tokens", sampled_ends)
        put("bonus_logits_indices", sampled_ends - 1)
    if sizes.indirection:
        put("cu_num_logits", sampled_ends, shift=1)
        put("num_draft_tokens_per_req", rows.drafts)


def _write_totals(refs, over, sizes: Sizes, every: Rows | None = None):
    """The 0-d outputs, the error word, the padded batch rows [num_reqs, Rp) and the zeroed scratch, from
    ``every`` state row (read here if not given). Every row with work is in the batch (at most
    min(T, R) of them once the bucket check holds)."""
    if every is None:
        every = _rows_at(refs, 0, pow2(sizes.num_rows), sizes, over)
    num_reqs = jnp.minimum(jnp.sum(every.has_work.astype(jnp.int32)), sizes.num_reqs_padded)
    total = jnp.sum(every.scheduled)
    total_drafts = jnp.sum(every.drafts)
    refs["num_reqs"][0] = num_reqs
    refs["num_actual_tokens"][0] = total
    refs["max_query_len"][0] = jnp.max(jnp.where(every.in_table, every.scheduled, INT32_MIN))
    seq_lens = jnp.where(every.has_work, every.computed + every.scheduled, 0)
    refs["max_seq_len"][0] = jnp.max(jnp.where(every.in_table, seq_lens, INT32_MIN))
    refs["errors"][0] = every.errors | over * OVER_BUCKET
    refs["seen"][...] = jnp.zeros(refs["seen"].shape, jnp.int32)
    if sizes.spec_decode:
        refs["max_spec_len"][0] = jnp.max(every.drafts)
    _pad_rows(refs, num_reqs, total, total_drafts, sizes)


def _pad_rows(refs, num_reqs, total, total_drafts, sizes: Sizes):
    """Batch rows [num_reqs, Rp) get their pad values; a cumulative array's leading 0 and its tail the
    total. Disjoint from the rows `_write_batch_rows` writes, so no two lanes store to one address.

    ```
    # num_reqs 2, Rp 4, total 5 -> query_start_loc [0, _, _, 5, 5], idx_mapping [_, _, -1, -1]
    ```
    """
    rows = jnp.arange(pow2(sizes.num_reqs_padded + 1), dtype=jnp.int32)
    padded = (rows >= num_reqs) & (rows < sizes.num_reqs_padded)
    tail = (rows == 0) | ((rows > num_reqs) & (rows <= sizes.num_reqs_padded))  # of a [Rp + 1] array
    window = pl.ds(0, rows.size)
    total_sampled = total_drafts + num_reqs

    def fill(name, value, mask=padded):
        plgpu.store(refs[name].at[window], jnp.broadcast_to(value, rows.shape).astype(jnp.int32), mask=mask)

    fill("idx_mapping", PAD_STATE_ROW)
    fill("seq_lens", PAD_SEQ_LEN)
    fill("logits_indices", PAD_LOGITS_INDEX)
    fill("query_start_loc", jnp.where(rows == 0, 0, total), mask=tail)
    if sizes.spec_decode:
        fill("num_draft_tokens_out", 0)
        fill("cu_num_draft_tokens", total_drafts)
        fill("cu_num_sampled_tokens", total_sampled)
        fill("bonus_logits_indices", PAD_LOGITS_INDEX)
    if sizes.indirection:
        fill("cu_num_logits", jnp.where(rows == 0, 0, total_sampled), mask=tail)
        fill("num_draft_tokens_per_req", PAD_NUM_DRAFT_TOKENS)
