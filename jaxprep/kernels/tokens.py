"""Launch 2 of the fused step, `tokens_kernel`: tokens, logits rows, draft rows and block-table rows.

Grid (max(token blocks, Rp),), TB = `Sizes.token_block`. Program p does, where it has one:

- token block p (tokens ``[p * TB, (p + 1) * TB)``): each token's batch row by a binary search
  over ``query_start_loc``, then positions, input ids, slot mapping, the block-id error bits and
  V2's ``is_padding``;
- logits-row block p (spec decode or V2's indirection; L_pad <= T rows, so no more blocks than
  tokens): each row's batch row by a binary search over the sampled ends, then its token
  (``logits_indices``), slot, place in its request, position and input id;
- draft-row block p (spec decode; D_pad <= T): each draft's batch row, the logits row that
  verifies it and its token id;
- block-table row p: batch row ``p``'s block-table row (the null block for a padded row) with its
  ids outside the cache nulled (`jaxprep.bounds.safe_block_table`).

Every read index is clamped into its array before the read. The error word and its scratch are the
row kernel's outputs, aliased: this kernel only adds bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxprep._constants import (
    NULL_BLOCK_ID,
    PAD_INPUT_ID,
    PAD_LOCAL_POS,
    PAD_LOGITS_INDEX,
    PAD_POSITION,
    PAD_SLOT_ID,
    PAD_STATE_ROW,
)
from jaxprep.bounds import BLOCK_ID_OUT_OF_RANGE
from jaxprep.kernels.common import (
    COLUMN_BLOCK,
    TOKEN_FLAGS,
    Sizes,
    add_error_bit,
    add_error_bits,
    any_lane,
    batch_row_of,
    pow2,
)

ERROR_ALIASES = {"errors_in": "errors", "seen_in": "seen"}
"""Inputs of this kernel that are its outputs too (the row kernel's error word and scratch)."""


def inputs(sizes: Sizes) -> tuple[str, ...]:
    names = ("token_ids", "block_table", "num_computed_tokens", "idx_mapping", "query_start_loc", "seq_lens",
             "num_actual_tokens")
    if sizes.logits_rows:
        names += ("logits_ends",)  # cu_num_logits (V2) or cu_num_sampled_tokens: see `logits_ends_first`
    if sizes.spec_decode:
        names += ("cu_num_draft_tokens",)
    return names + tuple(ERROR_ALIASES)


def outputs(sizes: Sizes) -> dict[str, jax.ShapeDtypeStruct]:
    """Every output by name: int32, but V2's ``is_padding`` (bool)."""
    t, rp = sizes.num_tokens_padded, sizes.num_reqs_padded
    shapes = dict(input_ids=(t,), positions=(t,), slot_mapping=(t,), tables=(rp, sizes.width), errors=(1,),
                  seen=(len(TOKEN_FLAGS),))
    logits, drafts = (sizes.num_logits_padded,), (sizes.num_drafts_padded,)
    if sizes.spec_decode:
        shapes.update(spec_logits_indices=logits, target_logits_indices=drafts, draft_token_ids=drafts)
    if sizes.indirection:
        shapes.update(indirection_logits_indices=logits, expanded_idx_mapping=logits, expanded_local_pos=logits,
                      logits_pos=logits, logits_input_ids=logits, is_padding=(t,))
    return {name: jax.ShapeDtypeStruct(shape, jnp.bool_ if name == "is_padding" else jnp.int32)
            for name, shape in shapes.items()}


def logits_ends_first(sizes: Sizes) -> int:
    """Where batch row 0's end lies in ``logits_ends``: 1 in ``cu_num_logits`` (leading 0), else 0."""
    return 1 if sizes.indirection else 0


def tokens_kernel(refs: dict, *, sizes: Sizes):
    """Grid (max(`Sizes.num_token_blocks`, Rp),): see the module docstring."""
    program = pl.program_id(0)
    pl.when(program < sizes.num_token_blocks)(functools.partial(_prepare_tokens, program, refs, sizes))
    if sizes.logits_rows:
        num_blocks = -(-sizes.num_logits_padded // sizes.token_block)
        pl.when(program < num_blocks)(functools.partial(_logits_rows, program, refs, sizes))
    if sizes.spec_decode:
        num_blocks = -(-sizes.num_drafts_padded // sizes.token_block)
        pl.when(program < num_blocks)(functools.partial(_draft_rows, program, refs, sizes))
    pl.when(program < sizes.num_reqs_padded)(functools.partial(_copy_block_table_row, program, refs, sizes))


def _state_rows(refs, batch_rows, sizes: Sizes):
    """The state row of each of ``batch_rows``, clamped into the table (a padded batch row, -1, reads row 0)."""
    return jnp.clip(refs["idx_mapping"][batch_rows], 0, sizes.num_rows - 1)


def _token_ids(refs, rows, positions, sizes: Sizes):
    """``token_ids[rows, positions]``, the positions clamped into the table (bad input reads in bounds)."""
    return refs["token_ids"][rows, jnp.clip(positions, 0, sizes.max_model_len - 1)]


def _model_input_ids(token_ids, sizes: Sizes):
    """The model's input ids: with spec decode vLLM's -1 placeholder drafts clamp to `PAD_INPUT_ID`
    (`jaxprep.features.async_tokens.clamp_placeholders`)."""
    return jnp.maximum(token_ids, PAD_INPUT_ID) if sizes.spec_decode else token_ids


def _prepare_tokens(program, refs, sizes: Sizes):
    """Positions, input ids and slots of one token block; the formulas of `jaxprep.prepare.prepare_body`.

    ```
    # B=2, owner row's computed 3, its first token t=4: tokens [4, 5] -> positions [3, 4]
    #   -> block columns [1, 2] -> slots [blocks[1] * 2 + 1, blocks[2] * 2 + 0]
    ```
    """
    start = program * sizes.token_block
    tokens = start + jnp.arange(sizes.token_block, dtype=jnp.int32)
    in_bucket = tokens < sizes.num_tokens_padded
    is_real = in_bucket & (tokens < refs["num_actual_tokens"][0])
    owner = batch_row_of(tokens, refs["query_start_loc"], 1, sizes.num_reqs_padded)
    rows = _state_rows(refs, owner, sizes)
    positions = jnp.where(is_real, _position(refs, rows, owner, tokens), PAD_POSITION)
    token_ids = _token_ids(refs, rows, positions, sizes)
    blocks = refs["block_table"][rows, jnp.clip(positions // sizes.block_size, 0, sizes.width - 1)]
    writable = is_real & (blocks > NULL_BLOCK_ID) & (blocks <= sizes.max_block_id)
    slots = jnp.where(writable, blocks * sizes.block_size + positions % sizes.block_size, PAD_SLOT_ID)
    window = pl.ds(start, sizes.token_block)
    plgpu.store(refs["positions"].at[window], positions, mask=in_bucket)
    input_ids = _model_input_ids(jnp.where(is_real, token_ids, PAD_INPUT_ID), sizes)
    plgpu.store(refs["input_ids"].at[window], input_ids, mask=in_bucket)
    plgpu.store(refs["slot_mapping"].at[window], slots, mask=in_bucket)
    if sizes.indirection:
        plgpu.store(refs["is_padding"].at[window], ~is_real, mask=in_bucket)
    out_of_range = is_real & ((blocks < NULL_BLOCK_ID) | (blocks > sizes.max_block_id))
    null = is_real & (blocks == NULL_BLOCK_ID)
    add_error_bits(refs["errors"], refs["seen"], [any_lane(out_of_range), any_lane(null)])


def _position(refs, rows, batch_rows, tokens):
    """Position of token t of batch row b (state row r): ``computed[r] + (t - query_start_loc[b])``."""
    return refs["num_computed_tokens"][rows] + (tokens - refs["query_start_loc"][batch_rows])


def _ends_before(ends_ref, batch_rows, first: int):
    """The end of the batch row before each of ``batch_rows`` in an inclusive-ends array (0 before row 0)."""
    previous = ends_ref[first + jnp.maximum(batch_rows - 1, 0)]
    return jnp.where(batch_rows > 0, previous, 0)


def _logits_rows(program, refs, sizes: Sizes):
    """Logits rows ``[p * TB, (p + 1) * TB)``: batch row b samples its last ``n = D + 1`` tokens, row
    ``j`` picks token ``qsl[b + 1] - n + (j - start_b)`` (`jaxprep.features.logits_indirection`,
    `jaxprep.features.spec_decode.spec_decode_metadata`).

    ```
    # qsl [0, 3, 5, 6], D [2, 1, 0], ends [3, 5, 6] -> rows [0,0,0, 1,1, 2], local [0,1,2, 0,1, 0]
    #   -> tokens [0,1,2, 3,4, 5]
    ```
    """
    first, rp = logits_ends_first(sizes), sizes.num_reqs_padded
    ends = refs["logits_ends"]
    start = program * sizes.token_block
    logit_rows = start + jnp.arange(sizes.token_block, dtype=jnp.int32)
    in_range = logit_rows < sizes.num_logits_padded
    is_real = in_range & (logit_rows < ends[first + rp - 1])
    owner = batch_row_of(logit_rows, ends, first, rp)
    row_start = _ends_before(ends, owner, first)
    local = logit_rows - row_start
    tokens = refs["query_start_loc"][owner + 1] - (ends[first + owner] - row_start) + local
    window = pl.ds(start, sizes.token_block)

    def put(name, values, pad):
        plgpu.store(refs[name].at[window], jnp.where(is_real, values, pad), mask=in_range)

    if sizes.spec_decode:
        put("spec_logits_indices", tokens, PAD_LOGITS_INDEX)
    if sizes.indirection:
        rows = _state_rows(refs, owner, sizes)
        positions = _position(refs, rows, owner, tokens)
        put("indirection_logits_indices", tokens, PAD_LOGITS_INDEX)
        put("expanded_idx_mapping", refs["idx_mapping"][owner], PAD_STATE_ROW)
        put("expanded_local_pos", local, PAD_LOCAL_POS)
        put("logits_pos", positions, PAD_POSITION)
        put("logits_input_ids", _model_input_ids(_token_ids(refs, rows, positions, sizes), sizes), PAD_INPUT_ID)


def _draft_rows(program, refs, sizes: Sizes):
    """Draft rows ``[p * TB, (p + 1) * TB)``: draft k of batch row b (its ``k - draft_start_b``-th) is
    verified by logits row ``sampled_start_b + (k - draft_start_b) = k + b`` (each row before b adds
    one bonus row), and is the token after that row's: position ``computed + S - D + (k - draft_start_b)``.
    Its id is read before any clamp (`jaxprep.features.spec_decode`).

    ```
    # D [3, 0, 2] -> draft ends [3, 3, 5]: drafts [0,1,2, 3,4] of rows [0,0,0, 2,2] -> target [0,1,2, 5,6]
    ```
    """
    cu_drafts, rp = refs["cu_num_draft_tokens"], sizes.num_reqs_padded
    start = program * sizes.token_block
    draft_rows = start + jnp.arange(sizes.token_block, dtype=jnp.int32)
    in_range = draft_rows < sizes.num_drafts_padded
    is_real = in_range & (draft_rows < cu_drafts[rp - 1])
    owner = batch_row_of(draft_rows, cu_drafts, 0, rp)
    draft_start = _ends_before(cu_drafts, owner, 0)
    qsl = refs["query_start_loc"]
    num_scheduled, num_drafts = qsl[owner + 1] - qsl[owner], cu_drafts[owner] - draft_start
    rows = _state_rows(refs, owner, sizes)
    positions = refs["num_computed_tokens"][rows] + num_scheduled - num_drafts + (draft_rows - draft_start)
    token_ids = _token_ids(refs, rows, positions, sizes)
    window = pl.ds(start, sizes.token_block)
    plgpu.store(refs["target_logits_indices"].at[window], jnp.where(is_real, draft_rows + owner, PAD_LOGITS_INDEX),
                mask=in_range)
    plgpu.store(refs["draft_token_ids"].at[window], jnp.where(is_real, token_ids, PAD_INPUT_ID), mask=in_range)


def _copy_block_table_row(batch_row, refs, sizes: Sizes):
    """tables[b] = block_table[idx_mapping[b]] with every id outside ``[0, max_block_id]`` nulled, and
    BLOCK_ID_OUT_OF_RANGE if such an id lies in a column the request uses (`safe_block_table`);
    a padded row (-1) gets the null block.

    ```
    # B 4, seq_lens[b] 9, max_block_id 39, row [1, 2, 77, 55] -> columns used 0..2 -> [1, 2, 0, 0], bit set
    ```
    """
    row = refs["idx_mapping"][batch_row]
    read_row = jnp.clip(row, 0, sizes.num_rows - 1)
    seq_len = refs["seq_lens"][batch_row]  # a padded row's is 0: no column used
    block = min(COLUMN_BLOCK, pow2(sizes.width))
    for first in range(0, sizes.width, block):
        columns = pl.ds(first, block)
        column = first + jnp.arange(block, dtype=jnp.int32)
        in_row = column < sizes.width
        values = plgpu.load(refs["block_table"].at[read_row, columns], mask=in_row, other=NULL_BLOCK_ID)
        outside = (values < NULL_BLOCK_ID) | (values > sizes.max_block_id)
        kept = (row >= 0) & ~outside
        plgpu.store(refs["tables"].at[batch_row, columns], jnp.where(kept, values, NULL_BLOCK_ID), mask=in_row)
        # column c holds positions [c * B, (c + 1) * B): used when c * B < seq_len (W * B fits int32)
        used_outside = in_row & outside & (column * sizes.block_size < seq_len)
        pl.when(any_lane(used_outside) > 0)(
            functools.partial(add_error_bit, refs["errors"], refs["seen"], TOKEN_FLAGS.index(BLOCK_ID_OUT_OF_RANGE)))
