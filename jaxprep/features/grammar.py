"""Structured outputs: which grammar-bitmask row masks which logits row (docs/semantics.md#structured-outputs).

The grammar (xgrammar, on the host) hands each step a bitmask ``[G * stride, ceil(V / 32)]`` int32:
request ``g`` of its list owns rows ``[g * stride, (g + 1) * stride)``, row ``g * stride + i``
masking the request's ``i``-th logits row (``stride = 1 + num_speculative_tokens``). A request's
place ``g`` in that list is `BatchState.grammar_index` (-1: no bitmask rows this step; vLLM's
scheduler lists neither requests without a grammar nor prefill chunks).

`FeatureConfig.structured_outputs` adds `GrammarMetadata` to the step; `apply_grammar_bitmask`
then masks the logits inside the same jitted computation (bit 0 -> ``-inf``), and
`grammar_invalid_drafts` flags logits rows whose draft met a permissive row
(`vllm/v1/worker/gpu/structured_outputs.py`).
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._constants import INT32_MAX, NO_GRAMMAR
from jaxprep._ragged import counts_per_target, take_rows
from jaxprep._typing import Array, Int32, StepArray
from jaxprep.bounds import InvalidBatchError, check_row_bound
from jaxprep.features.flags import GRAMMAR_INDEX_INVALID
from jaxprep.features.logits_indirection import LogitsIndirection
from jaxprep.features.record import Feature

BITS_PER_WORD = 32


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class GrammarMetadata:
    """Bitmask rows per logits row (`StepInputs.grammar`), the rows of `LogitsIndirection`."""

    bitmask_rows: Int32[StepArray, " num_logits_padded"]  # g * stride + i; NO_GRAMMAR: untouched (and pad)
    mapping: Int32[StepArray, " num_reqs_padded_times_stride"]  # vLLM's: bitmask row -> b * stride + i; pad -1
    row_grammar_index: Int32[StepArray, " num_logits_padded"]  # g of the row's request; NO_GRAMMAR: none, pad
    local_pos: Int32[StepArray, " num_logits_padded"]  # i: the row's place in its request; pad 0


def grammar_metadata(state_grammar_index: Int32[Array, " max_num_reqs"], idx_mapping: Int32[Array, " num_reqs_padded"],
                     logits: LogitsIndirection, stride: int) -> GrammarMetadata:
    """`BatchState.grammar_index` read through the step's rows -> `GrammarMetadata`.

    ``idx_mapping`` and ``logits.expanded_idx_mapping`` name state rows (pad -1, read as NO_GRAMMAR).

    ```
    # running example: g per batch row [0, 2, 1, -1], n [3, 2, 1, 1], stride 3
    #   mapping [0,1,2, 6,7,8, 3,4,5]; bitmask_rows [0,1,2, 6,7, 3, -1]
    ```
    """
    grammar_index = take_rows(state_grammar_index, idx_mapping, fill_value=NO_GRAMMAR)  # per batch row
    row_g = take_rows(state_grammar_index, logits.expanded_idx_mapping, fill_value=NO_GRAMMAR)  # per logits row
    local_pos = logits.expanded_local_pos
    num_reqs_padded = grammar_index.shape[0]
    has_rows = grammar_index >= 0
    # vLLM's mapping: entry g * stride + i names logits row (b, i) of the request at batch row b
    size = num_reqs_padded * stride
    offsets = jnp.arange(stride, dtype=jnp.int32)[None, :]
    block = jnp.where(has_rows & (grammar_index < num_reqs_padded), grammar_index, num_reqs_padded)
    targets = (block[:, None] * stride + offsets).reshape(-1)  # padding rows write past the end
    values = (jnp.arange(num_reqs_padded, dtype=jnp.int32)[:, None] * stride + offsets).reshape(-1)
    mapping = jnp.full((size + stride,), NO_GRAMMAR, jnp.int32).at[targets].set(values, mode="promise_in_bounds")
    return GrammarMetadata(bitmask_rows=jnp.where(row_g >= 0, row_g * stride + local_pos, NO_GRAMMAR),
                           mapping=mapping[:size], row_grammar_index=row_g, local_pos=local_pos)


def apply_grammar_bitmask_body(logits: Array, bitmask: Int32[Array, "num_masks words"], grammar: GrammarMetadata):
    """``logits [num_logits_padded, V]`` with ``-inf`` where a row's bitmask bit is 0.

    Rows whose ``bitmask_rows`` is NO_GRAMMAR (no grammar, a padded row) or past the bitmask's
    rows are untouched. Bit ``v % 32`` of word ``v // 32`` allows token ``v``.

    ```
    # word 0b...0101, V 3 -> allowed [T, F, T] -> logits [x0, -inf, x2]
    ```
    """
    vocab = logits.shape[-1]
    num_masks, words = bitmask.shape
    if words * BITS_PER_WORD < vocab:
        raise ValueError(f"grammar bitmask has {words} words per row, fewer than ceil(vocab_size={vocab} / 32)")
    rows = grammar.bitmask_rows
    applied = (rows >= 0) & (rows < num_masks)
    row_words = jnp.where(applied[:, None], bitmask[jnp.clip(rows, 0, num_masks - 1)], -1)  # -1: all allowed
    shifts = jnp.arange(BITS_PER_WORD, dtype=jnp.int32)
    bits = (row_words[:, :, None] >> shifts[None, None, :]) & 1
    allowed = bits.reshape(rows.shape[0], words * BITS_PER_WORD)[:, :vocab] == 1
    return jnp.where(allowed, logits, -jnp.inf)


def grammar_invalid_drafts_body(grammar: GrammarMetadata, num_acceptable_drafts: Int32[Array, " g"] | None):
    """``(invalid [num_logits_padded], any_invalid)``: rows whose draft was checked against a permissive row.

    A grammar request accepts drafts up to ``num_acceptable_drafts[g]`` (0 for all when None);
    row ``i`` of it is invalid when ``i`` exceeds that limit; rows without a grammar never are.
    vLLM returns None exactly when ``any_invalid`` is False.

    ```
    # limits [1, 0, 0] per g, rows (g, i) (0,0..2) (2,0..1) (1,0) (-,0) -> [F,F,T, F,T, F, F]
    ```
    """
    g = grammar.row_grammar_index
    if num_acceptable_drafts is None:
        limit = jnp.zeros_like(g)
    else:
        limit = take_rows(num_acceptable_drafts.astype(jnp.int32), g, fill_value=0)
    invalid = grammar.local_pos > jnp.where(g >= 0, limit, INT32_MAX)
    return invalid, jnp.any(invalid)


@jax.jit
def apply_grammar_bitmask(logits: Array, bitmask: Int32[Array, "num_masks words"], grammar: GrammarMetadata):
    """`apply_grammar_bitmask_body`, jitted: ``logits`` with ``-inf`` where a row's bitmask bit is 0.
    Inside a larger jit, call the body to fuse it."""
    return apply_grammar_bitmask_body(logits, bitmask, grammar)


@jax.jit
def grammar_invalid_drafts(grammar: GrammarMetadata, num_acceptable_drafts: Int32[Array, " g"] | None):
    """`grammar_invalid_drafts_body`, jitted: ``(invalid [num_logits_padded], any_invalid)``, the rows whose
    draft was checked against a permissive row."""
    return grammar_invalid_drafts_body(grammar, num_acceptable_drafts)


def check_grammar_index(index, scheduled) -> None:
    """Host check: the scheduled rows with bitmask rows number them ``0..G-1``, each once."""
    rows = len(index)
    check_row_bound((index < NO_GRAMMAR) | (index >= rows), "grammar_index", index,
                    f"[{NO_GRAMMAR}, max_num_reqs={rows})", relation="is outside")
    used = sorted(int(g) for g in index[(scheduled > 0) & (index >= 0)])
    if used != list(range(len(used))):
        raise InvalidBatchError(f"grammar_index of the scheduled rows must number their bitmask row blocks "
                                f"0..G-1 once each (G = {len(used)}), got {used}")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

def _bad_grammar_index(index, in_batch):
    """Rows outside ``[-1, R)``; scheduled rows whose block is taken twice or past ``G - 1``
    (`grammar.check_grammar_index`: the G scheduled rows with blocks number them 0..G-1 once each)."""
    rows = index.shape[0]
    outside = (index < NO_GRAMMAR) | (index >= rows)
    claimed = in_batch & (index >= 0) & ~outside
    num_blocks = jnp.sum(claimed, dtype=jnp.int32)
    return outside | (claimed & ((counts_per_target(index, claimed, rows) > 1) | (index >= num_blocks)))


def _metadata(build) -> None:
    build.outputs["grammar"] = grammar_metadata(build.state.grammar_index, build.step.idx_mapping, build.logits,
                                                1 + build.config.features.num_speculative_tokens)


FEATURE = Feature(
    name="grammar",
    is_on=lambda features: features.structured_outputs,
    inputs=lambda features: {"grammar_index": "structured_outputs"},
    empty_inputs=lambda config: {"grammar_index": np.full((config.max_num_reqs,), NO_GRAMMAR, np.int32)},
    check_values=lambda host, computed, scheduled, config: check_grammar_index(
        host["grammar_index"].astype(np.int64), scheduled),
    row_flags=lambda state, config, in_batch: [
        (GRAMMAR_INDEX_INVALID, _bad_grammar_index(state.grammar_index, in_batch))],
    messages=lambda config: {
        GRAMMAR_INDEX_INVALID: f"grammar_index is outside [{NO_GRAMMAR}, max_num_reqs={config.max_num_reqs}), or "
                               f"the scheduled rows do not number their bitmask blocks 0..G-1 once each"},
    metadata=_metadata,
)
