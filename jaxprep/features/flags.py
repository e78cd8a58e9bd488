"""The bits of the error word (`StepInputs.errors`), core and feature inputs, computed inside the step.

`jaxprep.validate` checks a state on the host and names the field, the row and the bound; a
serving loop that skips it still gets every bound here, one bit per bound, at the cost of a few
elementwise ops over the state rows and one reduction for all of them (`jaxprep.validate.flag_rows`).
Each bound mirrors a host check of the feature's own module (``spec_decode.check_drafts``,
``lora.check_lora_inputs``, ...), on the same rows, so a state that passes `jaxprep.validate` sets
no bit.

Row-level bounds come back as ``(bit, bad rows)``: a flagged row leaves the step's batch (its
tokens and request row become padding), so nothing a bad row drives is read or written. Token-level
bounds (a KV group's block of a scheduled token, an M-RoPE position) are flagged where the token is
known (`kv_groups`, `mrope`): the token gets its padding values there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import EMPTY_LORA_SLOT, INT32_MAX, NO_GRAMMAR, NO_LORA_ID, NO_PREV_ROW, NULL_BLOCK_ID
from jaxprep._ragged import max_of_blocks, on_cpu_else
from jaxprep._typing import Array, Bool, Int32

# the core tables (messages in jaxprep.validate.error_messages)
NEGATIVE_COUNT = 1 << 0
PAST_MAX_MODEL_LEN = 1 << 1
BLOCK_ID_OUT_OF_RANGE = 1 << 2
NULL_BLOCK = 1 << 3
OVER_BUCKET = 1 << 4
# the feature inputs
KV_GROUP_BLOCK_OUT_OF_RANGE = 1 << 5
KV_GROUP_NULL_BLOCK = 1 << 6
PREV_BATCH_ROW_OUT_OF_RANGE = 1 << 7
DRAFTS_OUT_OF_RANGE = 1 << 8
DRAFTS_PAST_SCHEDULED = 1 << 9
LORA_ID_NOT_LOADED = 1 << 10
LORA_SLOTS_INVALID = 1 << 11
MROPE_POSITION_MISSING = 1 << 12
PREFILL_LEN_OUT_OF_RANGE = 1 << 13
PROMPT_EMBEDS_START_OUT_OF_RANGE = 1 << 14
TEMPERATURE_OUT_OF_RANGE = 1 << 15
TOP_K_OUT_OF_RANGE = 1 << 16
TOP_P_OUT_OF_RANGE = 1 << 17
MIN_P_OUT_OF_RANGE = 1 << 18
REPETITION_PENALTY_OUT_OF_RANGE = 1 << 19
FREQUENCY_PENALTY_NOT_FINITE = 1 << 20
PRESENCE_PENALTY_NOT_FINITE = 1 << 21
MAMBA_STATE_BLOCK_INVALID = 1 << 22
NUM_ACCEPTED_TOKENS_OUT_OF_RANGE = 1 << 23
MAMBA_CHECKPOINT_OUT_OF_RANGE = 1 << 24
GRAMMAR_INDEX_INVALID = 1 << 25
ROW_MASK_TOO_NARROW = 1 << 26


def token_flags(blocks: Int32[Array, " num_tokens_padded"], is_real_token: Bool[Array, " num_tokens_padded"],
                null: int):
    """``null`` if a scheduled token's block (``blocks``: each token's block in its table) is the null block.

    A scheduled token's block id outside the cache needs no check of its own: the token's column is
    one its request uses (position < seq_len), so `safe_block_table` sets the out-of-range bit for it.
    """
    return jnp.where(jnp.any(is_real_token & (blocks == NULL_BLOCK_ID)), jnp.int32(null), 0)


def safe_block_table(table: Int32[Array, "max_num_reqs W"], rows: Int32[Array, " num_reqs_padded"],
                     row_seq_lens: Int32[Array, " max_num_reqs"], tokens_per_column: int, max_block_id: int, bit: int):
    """``(batch table, bits)``: ``table``'s batch rows (``rows``; the null block for a padded row) with every
    id outside ``[0, max_block_id]`` nulled (the kernel reads only blocks that exist), and ``bit`` if such
    an id lies in a column a request uses. ``row_seq_lens``: each state row's sequence length if it is in
    the batch, else 0.

    ```
    # B 4, seq_lens [9], max_block_id 39, row [1, 2, 77, 55] -> columns used 0..2 -> [1, 2, 0, 0], bit set
    ```
    """
    last = table.shape[0] - 1
    gathered = table.at[jnp.clip(rows, 0, last)].get(mode="promise_in_bounds")
    kept = ((rows >= 0) & (rows <= last))[:, None] & (_as_unsigned(gathered) <= max_block_id)
    flag = _used_ids_outside(table, row_seq_lens, tokens_per_column, max_block_id)
    return jnp.where(kept, gathered, NULL_BLOCK_ID), jnp.where(flag, jnp.int32(bit), 0)


def _as_unsigned(ids):
    """int32 ids as uint32: a negative id becomes >= 2**31, above every max_block_id."""
    return jax.lax.bitcast_convert_type(ids, jnp.uint32)


def _used_ids_outside(table: Int32[Array, "max_num_reqs W"], row_seq_lens: Int32[Array, " max_num_reqs"],
                      tokens_per_column: int, max_block_id: int) -> Bool[Array, ""]:
    """Whether an id outside ``[0, max_block_id]`` lies in a column a state row uses (``row_seq_lens``:
    0 for a row outside the batch): the maximum of the used ids as uint32 (a negative id lies above
    every bound) exceeds ``max_block_id``. A pass over the state's table, apart from the batch's
    gather (XLA:CPU shares no pass between a reduction and another output).

    On XLA:CPU that pass is the cost (compute bound while the table sits in cache): the maximum of
    every id comes first, half the work of masking each id by its column, and the used ids are
    read only when it is above ``max_block_id``; a table whose unused entries are ids too (vLLM's
    zeros, a finished request's stale ids) never pays the second pass. Elsewhere the masked pass
    alone (a conditional costs a GPU a device-to-host sync).

    ```
    # B 4, seq_lens [9, 0], max_block_id 39, rows [[1, 2, 77, 55], [-1, 0, 0, 0]] -> used ids [1, 2, 77] -> set
    ```
    """
    masked = functools.partial(used_ids_outside_masked, tokens_per_column=tokens_per_column,
                               max_block_id=max_block_id)

    def cpu(table, row_seq_lens):  # no id outside the pool anywhere: none in a used column either
        outside_anywhere = max_of_blocks(lambda start, stop: _as_unsigned(table[:, start:stop]),
                                         table.shape[1]) > max_block_id
        return jax.lax.cond(outside_anywhere, lambda outside, *rows: masked(*rows), lambda outside, *_: outside,
                            outside_anywhere, table, row_seq_lens)  # the false branch answers False

    return on_cpu_else(cpu, masked, table, row_seq_lens)


def used_ids_outside_masked(table: Int32[Array, "max_num_reqs W"], row_seq_lens: Int32[Array, " max_num_reqs"],
                            tokens_per_column: int, max_block_id: int) -> Bool[Array, ""]:
    """`_used_ids_outside` in one pass: each id masked by its column (0, a valid id, where unused)."""
    # column c holds positions [c * B, (c + 1) * B): used when c * B < seq_len, i.e. c < cdiv(seq_len, B)
    columns_used = -(-row_seq_lens // tokens_per_column)[:, None]

    def used_ids(start, stop):
        column = jax.lax.broadcasted_iota(jnp.int32, (1, stop - start), 1) + start
        return jnp.where(column < columns_used, _as_unsigned(table[:, start:stop]), jnp.uint32(0))

    return max_of_blocks(used_ids, table.shape[1]) > max_block_id


def feature_messages(config) -> dict[int, str]:
    """What each feature bit means: the field and the bound, as `jaxprep.validate` names them."""
    k, rows, m = config.features.num_speculative_tokens, config.max_num_reqs, config.max_model_len
    vocab = config.features.sampling.vocab_size if config.features.sampling is not None else "V"
    return {
        KV_GROUP_BLOCK_OUT_OF_RANGE: "extra_block_tables holds a block id outside [0, the group's max_block_id] "
                                     "in a column a request uses (KVCacheGroupSpec.num_blocks)",
        KV_GROUP_NULL_BLOCK: f"extra_block_tables: a scheduled token's block is the null block {NULL_BLOCK_ID}",
        PREV_BATCH_ROW_OUT_OF_RANGE: f"prev_batch_rows is outside [{NO_PREV_ROW}, max_num_reqs={rows}), or two "
                                     f"scheduled rows claim one last-step batch row",
        DRAFTS_OUT_OF_RANGE: f"num_draft_tokens is outside [0, num_speculative_tokens={k}]",
        DRAFTS_PAST_SCHEDULED: "num_scheduled_tokens is below num_draft_tokens + 1 on a scheduled row",
        LORA_ID_NOT_LOADED: f"lora_ids of a scheduled row is below {NO_LORA_ID}, or no slot (or two slots) of "
                            f"lora_slots holds it",
        LORA_SLOTS_INVALID: f"lora_slots holds a value that is neither {EMPTY_LORA_SLOT} (empty) nor an adapter "
                            f"id >= 1, or one adapter in two slots",
        MROPE_POSITION_MISSING: "mrope_positions is missing (-1) or outside [0, MROPE_POSITION_LIMIT=2**24) at a "
                                "scheduled prompt position, or a completion position (position + "
                                "mrope_position_delta) leaves [0, 2**24)",
        PREFILL_LEN_OUT_OF_RANGE: f"prefill_len is outside [0, max_model_len={m}]",
        PROMPT_EMBEDS_START_OUT_OF_RANGE: f"prompt_embeds_start of a scheduled row is outside "
                                          f"[0, {INT32_MAX - m}] (INT32_MAX - max_model_len: int32 pool rows)",
        TEMPERATURE_OUT_OF_RANGE: "temperature is not finite and >= 0",
        TOP_K_OUT_OF_RANGE: f"top_k is not in [1, vocab_size={vocab}]",
        TOP_P_OUT_OF_RANGE: "top_p is not in (0, 1]",
        MIN_P_OUT_OF_RANGE: "min_p is not in [0, 1]",
        REPETITION_PENALTY_OUT_OF_RANGE: "repetition_penalty is not finite and > 0",
        FREQUENCY_PENALTY_NOT_FINITE: "frequency_penalty is not finite",
        PRESENCE_PENALTY_NOT_FINITE: "presence_penalty is not finite",
        MAMBA_STATE_BLOCK_INVALID: f"mamba_block_table: a state block a scheduled row reads is outside "
                                   f"[0, max_block_id={config.max_block_id}], or its current one is the null block "
                                   f"{NULL_BLOCK_ID}",
        NUM_ACCEPTED_TOKENS_OUT_OF_RANGE: f"num_accepted_tokens of a scheduled row is outside "
                                          f"[1, 1 + num_speculative_tokens={1 + k}]",
        MAMBA_CHECKPOINT_OUT_OF_RANGE: "mamba_checkpoint_offsets of a scheduled row is outside "
                                       "[0, num_scheduled_tokens)",
        ROW_MASK_TOO_NARROW: f"num_computed_tokens + num_scheduled_tokens of a scheduled row exceeds the row "
                             f"mask's FeatureConfig.mask_kv_len={config.features.mask_columns(config)} columns",
        GRAMMAR_INDEX_INVALID: f"grammar_index is outside [{NO_GRAMMAR}, max_num_reqs={rows}), or the scheduled "
                               f"rows do not number their bitmask blocks 0..G-1 once each",
    }


def feature_row_flags(state, config) -> list[tuple[int, Bool[Array, " max_num_reqs"]]]:
    """``(bit, rows that break its bound)`` for every row-level bound of the features that are on."""
    features = config.features
    scheduled = state.num_scheduled_tokens
    in_batch = scheduled > 0
    flags = []
    if features.spec_decode:
        drafts = state.num_draft_tokens
        # S < D + 1 written as S - 1 < D: no int32 wrap for D near 2**31 (S >= 1 on a scheduled row)
        flags += [(DRAFTS_OUT_OF_RANGE, (drafts < 0) | (in_batch & (drafts > features.num_speculative_tokens))),
                  (DRAFTS_PAST_SCHEDULED, in_batch & (scheduled - 1 < drafts))]
    if features.discard_request_mask or features.mrope or features.drafter or features.hybrid:
        flags.append((PREFILL_LEN_OUT_OF_RANGE, (state.prefill_len < 0) | (state.prefill_len > config.max_model_len)))
    if features.prompt_embeds:
        start = state.prompt_embeds_start
        flags.append((PROMPT_EMBEDS_START_OUT_OF_RANGE,
                      in_batch & ((start < 0) | (start > INT32_MAX - config.max_model_len))))
    if features.async_tokens:
        flags.append((PREV_BATCH_ROW_OUT_OF_RANGE, _bad_prev_batch_rows(state.prev_batch_rows, in_batch)))
    if features.lora is not None:
        flags.append((LORA_ID_NOT_LOADED, _unloaded_adapters(state.lora_ids, state.lora_slots, in_batch)))
    if features.sampling is not None:
        flags += _sampling_flags(state, features.sampling.vocab_size)
    if features.hybrid is not None:
        flags += _hybrid_flags(state, config, in_batch)
    if features.structured_outputs:
        flags.append((GRAMMAR_INDEX_INVALID, _bad_grammar_index(state.grammar_index, in_batch)))
    if features.attn_mask in ("rows_bool", "rows_additive"):
        # S > columns - C: no int32 wrap for C >= 0 (a negative C is flagged by the core bits)
        flags.append((ROW_MASK_TOO_NARROW, in_batch & (scheduled > features.mask_columns(config)
                                                       - state.num_computed_tokens)))
    return flags


def feature_state_flags(state, config) -> list[tuple[int, Bool[Array, ""]]]:
    """``(bit, flag)`` for bounds that belong to no state row (the LoRA slots)."""
    if config.features.lora is None:
        return []
    slots = state.lora_slots
    # one adapter in two slots: a pair (i < j) of equal ids >= 1
    pairs = (slots[:, None] == slots[None, :]) & (slots[:, None] > NO_LORA_ID) & np.triu(
        np.ones((slots.shape[0],) * 2, bool), 1)
    return [(LORA_SLOTS_INVALID, jnp.any((slots < EMPTY_LORA_SLOT) | (slots == NO_LORA_ID)) | jnp.any(pairs))]


def _counts_per_target(targets, claimed, size: int):
    """How many claimed entries name each target in [0, size); unclaimed ones write a spare entry.

    ```
    # targets [2, 0, 2, 5], claimed [T, T, T, F], size 4 -> counts [1, 0, 2, 0] -> per entry [2, 1, 2, 0]
    ```
    """
    index = jnp.where(claimed, jnp.clip(targets, 0, size - 1), size)
    counts = jnp.zeros((size + 1,), jnp.int32).at[index].add(1, mode="promise_in_bounds")
    return jnp.where(claimed, counts[index], 0)


def _bad_prev_batch_rows(prev, in_batch):
    """Rows outside ``[-1, R)``, and scheduled rows that share a last-step row
    (`async_tokens.check_prev_batch_rows`)."""
    rows = prev.shape[0]
    outside = (prev < NO_PREV_ROW) | (prev >= rows)
    claimed = in_batch & (prev >= 0) & ~outside
    return outside | (_counts_per_target(prev, claimed, rows) > 1)


def _unloaded_adapters(lora_ids, lora_slots, in_batch):
    """Scheduled rows whose adapter id is negative, or held by no slot or by two (`lora.check_lora_inputs`).

    ```
    # slots [3, -1, 7, 3], ids [7, 0, 3, 9, -2] -> matches [1, -, 2, 0, -] -> bad [F, F, T, T, T]
    ```
    """
    matches = jnp.sum(lora_ids[:, None] == lora_slots[None, :], axis=1, dtype=jnp.int32)
    return in_batch & ((lora_ids < NO_LORA_ID) | ((lora_ids > NO_LORA_ID) & (matches != 1)))


FLOAT32_ONE_BITS = int(np.float32(1).view(np.int32))
FLOAT32_INF_BITS = int(np.float32(np.inf).view(np.int32))
FLOAT32_MINUS_ZERO_BITS = int(np.float32(-0.0).view(np.int32))


def _sampling_flags(state, vocab_size: int) -> list:
    """The bounds of `sampling.check_parameter_bounds`, on every row, compared on the float32 bit
    patterns: exact on every backend, subnormals included (XLA:CPU and GPUs may flush them to 0 in
    float compares, NumPy does not). For x >= +0 the int32 patterns order as the floats do; NaN
    patterns lie above the infinity's; -0.0 is the one negative pattern equal to 0.

    ```
    # top_p 1e-45 (bits 1) -> > 0: kept; min_p -1e-45 (bits -2**31 + 1) -> below 0: flagged
    ```
    """
    def bits(name):
        return jax.lax.bitcast_convert_type(getattr(state, name), jnp.int32)

    def non_negative_finite(b):  # [+0, inf) or -0.0
        return ((b >= 0) & (b < FLOAT32_INF_BITS)) | (b == FLOAT32_MINUS_ZERO_BITS)

    def finite(b):
        return (b & INT32_MAX) < FLOAT32_INF_BITS

    top_p, min_p = bits("top_p"), bits("min_p")
    return [
        (TEMPERATURE_OUT_OF_RANGE, ~non_negative_finite(bits("temperature"))),
        (TOP_K_OUT_OF_RANGE, (state.top_k < 1) | (state.top_k > vocab_size)),
        (TOP_P_OUT_OF_RANGE, ~((top_p > 0) & (top_p <= FLOAT32_ONE_BITS))),
        (MIN_P_OUT_OF_RANGE, ~((min_p == FLOAT32_MINUS_ZERO_BITS) | ((min_p >= 0) & (min_p <= FLOAT32_ONE_BITS)))),
        (REPETITION_PENALTY_OUT_OF_RANGE, ~((bits("repetition_penalty") > 0)
                                            & (bits("repetition_penalty") < FLOAT32_INF_BITS))),
        (FREQUENCY_PENALTY_NOT_FINITE, ~finite(bits("frequency_penalty"))),
        (PRESENCE_PENALTY_NOT_FINITE, ~finite(bits("presence_penalty"))),
    ]


def _hybrid_flags(state, config, in_batch) -> list:
    """The bounds of `hybrid.check_hybrid_values`: the state blocks a row reads, accepted counts, checkpoints."""
    hybrid, k = config.features.hybrid, config.features.num_speculative_tokens
    computed, scheduled, table = state.num_computed_tokens, state.num_scheduled_tokens, state.mamba_block_table
    first = jnp.zeros_like(computed)
    if hybrid.mode == "align":
        # C 30, S 4, B 16 -> the block of position 33: column 2
        first = jnp.clip(computed + jnp.maximum(scheduled - 1, 0), 0, INT32_MAX - 1) // hybrid.block_size
    columns = jnp.clip(first[:, None] + jnp.arange(hybrid.num_state_columns, dtype=jnp.int32)[None, :],
                       0, table.shape[1] - 1)
    read = jnp.take_along_axis(table, columns, axis=1, mode="promise_in_bounds")
    outside = jnp.any((read < 0) | (read > config.max_block_id), axis=1)
    flags = [(MAMBA_STATE_BLOCK_INVALID, in_batch & (outside | (read[:, 0] == NULL_BLOCK_ID)))]
    if k > 0:
        accepted = state.num_accepted_tokens
        flags.append((NUM_ACCEPTED_TOKENS_OUT_OF_RANGE, in_batch & ((accepted < 1) | (accepted > 1 + k))))
    if hybrid.checkpoints:
        offsets = state.mamba_checkpoint_offsets
        flags.append((MAMBA_CHECKPOINT_OUT_OF_RANGE,
                      in_batch & ((offsets < 0) | ((offsets > 0) & (offsets >= scheduled)))))
    return flags


def _bad_grammar_index(index, in_batch):
    """Rows outside ``[-1, R)``; scheduled rows whose block is taken twice or past ``G - 1``
    (`grammar.check_grammar_index`: the G scheduled rows with blocks number them 0..G-1 once each)."""
    rows = index.shape[0]
    outside = (index < NO_GRAMMAR) | (index >= rows)
    claimed = in_batch & (index >= 0) & ~outside
    num_blocks = jnp.sum(claimed, dtype=jnp.int32)
    return outside | (claimed & ((_counts_per_target(index, claimed, rows) > 1) | (index >= num_blocks)))
