"""The plain step (`jaxprep.prepare.prepare_body` with every feature off) as two Pallas launches.

On an NVIDIA GPU a step's host time is its launch count (~6.5 µs per kernel launch, BENCHMARKS.md);
XLA's plain step is 16-20 kernels there. These two Triton kernels compute its outputs, with the
same padding: the work vLLM's model runner V2 spreads over five kernels
(`vllm/v1/worker/gpu/input_batch.py`, `vllm/v1/worker/gpu/block_table.py`) and a host prefix sum:

- launch 1, `_rows_kernel`, grid (1,): one program holds every state row's counts in one block of
  ``next_pow2(max_num_reqs)`` lanes, scans them and writes the per-request outputs:
  ``idx_mapping``, ``query_start_loc``, ``seq_lens``, ``logits_indices``, the 0-d counts and
  maxima, and the error bits of the counts. A row that breaks a bound of the counts is dropped
  from the batch (its scheduled count taken as 0; over the bucket every row is), as
  `jaxprep.validate.flag_rows` drops it on the XLA path. It zeroes the token kernel's error scratch.
- launch 2, `_tokens_kernel`, grid (max(token blocks, num_reqs_padded),): program ``p``
  prepares tokens ``[p * TB, (p + 1) * TB)`` (each token's batch row by a binary search over
  ``query_start_loc``, then positions, input ids, slot mapping and the block-id error bits), and
  copies batch row ``p``'s block-table row (the null block for a padded row) with its ids outside
  the cache nulled (`jaxprep.features.flags.safe_block_table`).

Its XLA twin is `xla_twin` (the jnp step, ``PrepConfig.kernel="xla"``); the tests run both on the
same batches, the kernels in Pallas' interpreter on CPU. Every read index is clamped into its
array before the read, so bad input on the unchecked path reads in bounds, and every output equals
the XLA path's bit for bit, bad input included (tests/core/test_fast_path_errors.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxprep._constants import (
    NULL_BLOCK_ID,
    PAD_INPUT_ID,
    PAD_LOGITS_INDEX,
    PAD_POSITION,
    PAD_SEQ_LEN,
    PAD_SLOT_ID,
    PAD_STATE_ROW,
)
from jaxprep.metadata import AttentionMetadata, StepInputs
from jaxprep.validate import BLOCK_ID_OUT_OF_RANGE, NEGATIVE_COUNT, NULL_BLOCK, OVER_BUCKET, PAST_MAX_MODEL_LEN

TOKEN_BLOCK = 128
"""Tokens per program of the token kernel; a bucket below 512 tokens is split into 4 programs."""
MIN_TOKEN_PROGRAMS = 4
COLUMN_BLOCK = 256
"""Block-table columns one program copies per iteration."""
INT32_MIN = -(2**31)
TOKEN_FLAGS = (BLOCK_ID_OUT_OF_RANGE, NULL_BLOCK)
"""The error bits the token kernel sets; the row kernel sets the others."""
COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=1)


def _pow2(n: int) -> int:
    """Smallest power of two >= n (Triton blocks have power-of-two sizes). # 5 -> 8, 8 -> 8, 1 -> 1"""
    return 1 << max(0, (n - 1).bit_length())


def _any(mask) -> jax.Array:
    """1 if any lane of ``mask`` is set, else 0 (int32: Triton reduces with max, not or)."""
    return jnp.max(mask.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The static sizes both kernels are specialised to."""

    num_rows: int  # R = max_num_reqs, rows of the state tables
    max_model_len: int  # M, the token table's width
    width: int  # W, the block table's width
    num_tokens_padded: int  # T
    num_reqs_padded: int  # Rp = min(T, R)
    block_size: int  # B
    max_block_id: int

    @property
    def token_block(self) -> int:
        """Tokens per program: T / MIN_TOKEN_PROGRAMS rounded up to a power of 2, at most TOKEN_BLOCK.

        ```
        # T 16 -> 4, T 256 -> 64, T 8192 -> 128
        ```
        """
        return min(TOKEN_BLOCK, _pow2(-(-self.num_tokens_padded // MIN_TOKEN_PROGRAMS)))

    @property
    def num_token_blocks(self) -> int:
        return -(-self.num_tokens_padded // self.token_block)


# --- launch 1: the request rows -----------------------------------------------------------------

def _rows_kernel(computed_ref, scheduled_ref, qsl_ref, seq_lens_ref, idx_ref, logits_ref, num_reqs_ref,
                 num_actual_ref, max_query_ref, max_seq_ref, errors_ref, seen_ref, *, sizes: Sizes):
    """One program: the state rows in one block of lanes, scanned; batch row b = b-th row with work.

    ```
    # scheduled [0, 3, 0, 2], computed [_, 4, _, 7] -> has_work [0,1,0,1] -> counts [0,1,1,2],
    #   ends [0,3,3,5] -> batch rows [-,0,-,1]: idx_mapping [1, 3], query_start_loc [0, 3, 5],
    #   seq_lens [7, 9], logits_indices [2, 4]; padded rows: -1, the total 5, 0, 0
    ```
    """
    lanes = jnp.arange(_pow2(sizes.num_rows), dtype=jnp.int32)
    in_table = lanes < sizes.num_rows
    requested = plgpu.load(scheduled_ref.at[pl.ds(0, lanes.size)], mask=in_table, other=0)
    computed = plgpu.load(computed_ref.at[pl.ds(0, lanes.size)], mask=in_table, other=0)
    errors, dropped = _row_flags(computed, requested, in_table, sizes)
    scheduled = jnp.where(dropped, 0, requested)  # a flagged row leaves the batch (`flag_rows`)
    has_work = in_table & (scheduled > 0)
    counts = jnp.cumsum(has_work.astype(jnp.int32))
    ends = jnp.cumsum(scheduled)
    total = jnp.sum(scheduled)
    num_reqs = jnp.minimum(jnp.sum(has_work.astype(jnp.int32)), sizes.num_reqs_padded)
    # rows past the bucket's batch (bad input only) and rows without work point past the outputs
    in_batch = has_work & (counts <= sizes.num_reqs_padded)
    batch_row = jnp.where(in_batch, counts - 1, sizes.num_reqs_padded)
    plgpu.store(idx_ref.at[batch_row], lanes, mask=in_batch)
    plgpu.store(qsl_ref.at[batch_row + 1], ends, mask=in_batch)
    plgpu.store(seq_lens_ref.at[batch_row], computed + scheduled, mask=in_batch)
    plgpu.store(logits_ref.at[batch_row], ends - 1, mask=in_batch)
    _pad_rows(qsl_ref, seq_lens_ref, idx_ref, logits_ref, num_reqs, total, sizes)
    num_reqs_ref[0] = num_reqs
    num_actual_ref[0] = total
    max_query_ref[0] = jnp.max(jnp.where(in_table, scheduled, INT32_MIN))
    max_seq_ref[0] = jnp.max(jnp.where(in_table, jnp.where(has_work, computed + scheduled, 0), INT32_MIN))
    errors_ref[0] = errors
    seen_ref[...] = jnp.zeros(seen_ref.shape, jnp.int32)


def _pad_rows(qsl_ref, seq_lens_ref, idx_ref, logits_ref, num_reqs, total, sizes: Sizes):
    """Batch rows [num_reqs, Rp) get their pad values; query_start_loc[0] = 0, its tail the total.
    Disjoint from the rows the scan wrote, so no two lanes store to one address."""
    rows = jnp.arange(_pow2(sizes.num_reqs_padded + 1), dtype=jnp.int32)
    padded = (rows >= num_reqs) & (rows < sizes.num_reqs_padded)
    window = pl.ds(0, rows.size)
    plgpu.store(idx_ref.at[window], jnp.full(rows.shape, PAD_STATE_ROW, jnp.int32), mask=padded)
    plgpu.store(seq_lens_ref.at[window], jnp.full(rows.shape, PAD_SEQ_LEN, jnp.int32), mask=padded)
    plgpu.store(logits_ref.at[window], jnp.full(rows.shape, PAD_LOGITS_INDEX, jnp.int32), mask=padded)
    qsl_tail = (rows == 0) | ((rows > num_reqs) & (rows <= sizes.num_reqs_padded))
    plgpu.store(qsl_ref.at[window], jnp.where(rows == 0, 0, total), mask=qsl_tail)


def _row_flags(computed, scheduled, in_table, sizes: Sizes):
    """``(error bits of the counts, rows to drop)``: `jaxprep.validate.flag_rows` of the plain step.

    A row breaking a row-level bound is dropped (its scheduled count taken as 0); over the bucket
    every row is. The block-id bits are the token kernel's.

    ```
    # computed [3, -1, 30], scheduled [2, 1, 4], M 32, T 16 -> NEGATIVE_COUNT | PAST_MAX_MODEL_LEN,
    #   dropped [0, 1, 1]
    ```
    """
    negative = in_table & ((computed < 0) | (scheduled < 0))
    # scheduled > M - computed: no overflow for computed >= 0 (a negative one is flagged above)
    too_long = in_table & (scheduled > sizes.max_model_len - computed)
    # the total of counts clipped to [0, T + 1] exceeds T exactly when the true total does
    clipped_total = jnp.sum(jnp.where(in_table, jnp.clip(scheduled, 0, sizes.num_tokens_padded + 1), 0))
    over = (clipped_total > sizes.num_tokens_padded).astype(jnp.int32)
    word = _any(negative) * NEGATIVE_COUNT | _any(too_long) * PAST_MAX_MODEL_LEN | over * OVER_BUCKET
    return word, negative | too_long | (over > 0)


# --- launch 2: the tokens and the block-table rows ---------------------------------------------

def _tokens_kernel(token_ids_ref, block_table_ref, computed_ref, idx_ref, qsl_ref, seq_lens_ref, num_actual_ref,
                   _errors_in, _seen_in, input_ids_ref, positions_ref, slots_ref, tables_ref, errors_ref, seen_ref, *,
                   sizes: Sizes):
    """Program p: token block p (if there is one), then batch row p's block-table row (if there is one).
    The error word and its scratch are the row kernel's outputs, aliased: this kernel only adds bits."""
    program = pl.program_id(0)

    @pl.when(program < sizes.num_token_blocks)
    def _():
        _prepare_tokens(program, token_ids_ref, block_table_ref, computed_ref, idx_ref, qsl_ref, num_actual_ref,
                        input_ids_ref, positions_ref, slots_ref, errors_ref, seen_ref, sizes)

    @pl.when(program < sizes.num_reqs_padded)
    def _():
        _copy_block_table_row(program, block_table_ref, idx_ref, seq_lens_ref, tables_ref, errors_ref, seen_ref,
                              sizes)


def _owner(tokens, qsl_ref, sizes: Sizes):
    """Batch row of each token: the number of request ends ``query_start_loc[b + 1] <= t``, by binary
    search, clipped to the last row (as `jaxprep._ragged.token_request_index`).

    ```
    # query_start_loc [0, 2, 7, 10, 10], tokens [0, 1, 2, 6, 7, 9, 10, 11] -> [0, 0, 1, 1, 2, 2, 3, 3]
    ```
    """
    low = jnp.zeros(tokens.shape, jnp.int32)
    high = jnp.full(tokens.shape, sizes.num_reqs_padded, jnp.int32)
    for _ in range(sizes.num_reqs_padded.bit_length()):  # Rp + 1 answers: ceil(log2(Rp + 1)) halvings
        middle = jnp.minimum((low + high) // 2, sizes.num_reqs_padded - 1)
        active = low < high
        right = active & (qsl_ref[middle + 1] <= tokens)
        low = jnp.where(right, middle + 1, low)
        high = jnp.where(active & ~right, middle, high)
    return jnp.minimum(low, sizes.num_reqs_padded - 1)


def _prepare_tokens(program, token_ids_ref, block_table_ref, computed_ref, idx_ref, qsl_ref, num_actual_ref,
                    input_ids_ref, positions_ref, slots_ref, errors_ref, seen_ref, sizes: Sizes):
    """Positions, input ids and slots of one token block; the same formulas as `jaxprep.prepare.prepare_body`.

    ```
    # B=2, owner row's computed 3, its first token t=4: tokens [4, 5] -> positions [3, 4]
    #   -> block columns [1, 2] -> slots [blocks[1] * 2 + 1, blocks[2] * 2 + 0]
    ```
    """
    start = program * sizes.token_block
    tokens = start + jnp.arange(sizes.token_block, dtype=jnp.int32)
    in_bucket = tokens < sizes.num_tokens_padded
    is_real = in_bucket & (tokens < num_actual_ref[0])
    owner = _owner(tokens, qsl_ref, sizes)
    rows = jnp.clip(idx_ref[owner], 0, sizes.num_rows - 1)  # a padded batch row (-1) reads row 0
    positions = jnp.where(is_real, computed_ref[rows] + (tokens - qsl_ref[owner]), PAD_POSITION)
    token_ids = token_ids_ref[rows, jnp.clip(positions, 0, sizes.max_model_len - 1)]
    blocks = block_table_ref[rows, jnp.clip(positions // sizes.block_size, 0, sizes.width - 1)]
    writable = is_real & (blocks > NULL_BLOCK_ID) & (blocks <= sizes.max_block_id)
    slots = jnp.where(writable, blocks * sizes.block_size + positions % sizes.block_size, PAD_SLOT_ID)
    window = pl.ds(start, sizes.token_block)
    plgpu.store(positions_ref.at[window], positions, mask=in_bucket)
    plgpu.store(input_ids_ref.at[window], jnp.where(is_real, token_ids, PAD_INPUT_ID), mask=in_bucket)
    plgpu.store(slots_ref.at[window], slots, mask=in_bucket)
    out_of_range = is_real & ((blocks < NULL_BLOCK_ID) | (blocks > sizes.max_block_id))
    _add_error_bits(errors_ref, seen_ref, [_any(out_of_range), _any(is_real & (blocks == NULL_BLOCK_ID))])


def _add_error_bits(errors_ref, seen_ref, flagged):
    """ORs bit k into the error word once: the first program to raise ``seen[k]`` from 0 adds it.

    Triton's atomic or has no interpreter rule; max and add do, and this needs only them.
    """
    for k, (bit, flag) in enumerate(zip(TOKEN_FLAGS, flagged)):
        pl.when(flag > 0)(functools.partial(_add_error_bit, errors_ref, seen_ref, k, bit))


def _add_error_bit(errors_ref, seen_ref, k: int, bit: int):
    before = plgpu.atomic_max(seen_ref, (jnp.int32(k),), jnp.int32(1))
    plgpu.atomic_add(errors_ref, (jnp.int32(0),), jnp.where(before == 0, jnp.int32(bit), jnp.int32(0)))


def _copy_block_table_row(batch_row, block_table_ref, idx_ref, seq_lens_ref, tables_ref, errors_ref, seen_ref,
                          sizes: Sizes):
    """tables[b] = block_table[idx_mapping[b]] with every id outside ``[0, max_block_id]`` nulled, and
    BLOCK_ID_OUT_OF_RANGE if such an id lies in a column the request uses (`safe_block_table`);
    a padded row (-1) gets the null block.

    ```
    # B 4, seq_lens[b] 9, max_block_id 39, row [1, 2, 77, 55] -> columns used 0..2 -> [1, 2, 0, 0], bit set
    ```
    """
    row = idx_ref[batch_row]
    read_row = jnp.clip(row, 0, sizes.num_rows - 1)
    seq_len = seq_lens_ref[batch_row]  # a padded row's is 0: no column used
    block = min(COLUMN_BLOCK, _pow2(sizes.width))
    for first in range(0, sizes.width, block):
        columns = pl.ds(first, block)
        column = first + jnp.arange(block, dtype=jnp.int32)
        in_row = column < sizes.width
        values = plgpu.load(block_table_ref.at[read_row, columns], mask=in_row, other=NULL_BLOCK_ID)
        outside = (values < NULL_BLOCK_ID) | (values > sizes.max_block_id)
        kept = (row >= 0) & ~outside
        plgpu.store(tables_ref.at[batch_row, columns], jnp.where(kept, values, NULL_BLOCK_ID), mask=in_row)
        # column c holds positions [c * B, (c + 1) * B): used when c * B < seq_len (W * B fits int32)
        used_outside = in_row & outside & (column * sizes.block_size < seq_len)
        pl.when(_any(used_outside) > 0)(
            functools.partial(_add_error_bit, errors_ref, seen_ref, TOKEN_FLAGS.index(BLOCK_ID_OUT_OF_RANGE),
                              BLOCK_ID_OUT_OF_RANGE))


# --- the wrapper --------------------------------------------------------------------------------

def _int32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def fused_step(state, config, num_tokens_padded: int, *, interpret: bool) -> StepInputs:
    """The plain step as the two kernels (``interpret``: Pallas' interpreter, any backend)."""
    sizes = Sizes(num_rows=config.max_num_reqs, max_model_len=config.max_model_len,
                  width=state.block_table.shape[1], num_tokens_padded=num_tokens_padded,
                  num_reqs_padded=config.num_reqs_padded(num_tokens_padded), block_size=config.block_size,
                  max_block_id=config.max_block_id)
    rp = sizes.num_reqs_padded
    call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=COMPILER_PARAMS)
    qsl, seq_lens, idx_mapping, logits_indices, num_reqs, num_actual, max_query, max_seq, errors, seen = call(
        functools.partial(_rows_kernel, sizes=sizes), name="jaxprep_prepare_rows", grid=(1,),
        out_shape=(_int32(rp + 1), _int32(rp), _int32(rp), _int32(rp), *[_int32(1)] * 5, _int32(len(TOKEN_FLAGS))),
    )(state.num_computed_tokens, state.num_scheduled_tokens)
    input_ids, positions, slot_mapping, block_table, errors, _ = call(
        functools.partial(_tokens_kernel, sizes=sizes), name="jaxprep_prepare_tokens",
        grid=(max(sizes.num_token_blocks, rp),), input_output_aliases={7: 4, 8: 5},
        out_shape=(*[_int32(num_tokens_padded)] * 3, _int32(rp, sizes.width), _int32(1), _int32(len(TOKEN_FLAGS))),
    )(state.token_ids, state.block_table, state.num_computed_tokens, idx_mapping, qsl, seq_lens, num_actual, errors,
      seen)
    scalar = functools.partial(jnp.reshape, shape=())
    return StepInputs(
        input_ids=input_ids, positions=positions, logits_indices=logits_indices, idx_mapping=idx_mapping,
        attn_metadata=AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=slot_mapping, block_table=block_table,
            num_actual_tokens=scalar(num_actual), num_reqs=scalar(num_reqs), max_query_len=scalar(max_query),
            max_seq_len=scalar(max_seq)),
        errors=scalar(errors), num_tokens_padded=num_tokens_padded)


# --- the choice of path -------------------------------------------------------------------------

def xla_twin(state, config, num_tokens_padded: int) -> StepInputs:
    """The same step on XLA: `jaxprep.prepare.prepare_body` with ``kernel="xla"``."""
    from jaxprep.prepare import prepare_body  # the twin lives there; imported late (no cycle)

    return prepare_body(state, dataclasses.replace(config, kernel="xla"), num_tokens_padded)


def plain_step(state, config, num_tokens_padded: int) -> StepInputs:
    """The step as ``config.kernel`` picks it, resolved when lowering (`jax.lax.platform_dependent`):

    - ``"pallas"``: the Triton kernels on CUDA, the same kernels in Pallas' interpreter elsewhere;
    - ``"auto"``: the Triton kernels on CUDA, `xla_twin` elsewhere (CPU, TPU).
    """
    compiled = functools.partial(fused_step, config=config, num_tokens_padded=num_tokens_padded, interpret=False)
    if config.kernel == "pallas":
        other = functools.partial(fused_step, config=config, num_tokens_padded=num_tokens_padded, interpret=True)
    else:
        other = functools.partial(xla_twin, config=config, num_tokens_padded=num_tokens_padded)
    return jax.lax.platform_dependent(state, cuda=compiled, default=other)
