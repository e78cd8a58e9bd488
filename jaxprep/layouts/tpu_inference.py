"""A prepared step in tpu-inference's layout: its runner's model inputs and its RPA v3 kernel's arrays.

tpu-inference 0.32.0 prepares a step on the host (`tpu_inference/runner/tpu_runner.py::TPUModelRunner._prepare_inputs`)
after moving decodes to the front of its persistent batch
(`tpu_inference/runner/persistent_batch_manager.py::PersistentBatchManager._reorder_batch`). `tpu_inference_layout`
computes the same arrays on the device from a jaxprep step, field for field and in the same order:

| field here | tpu-inference's runner | RPA v3 kernel argument |
|---|---|---|
| ``input_ids`` | ``input_ids`` | (the model's) |
| ``positions`` | ``positions``, ``AttentionMetadata.input_positions`` | |
| ``query_start_loc`` | ``AttentionMetadata.query_start_loc`` | ``cu_q_lens`` |
| ``seq_lens`` | ``AttentionMetadata.seq_lens`` | ``kv_lens`` |
| ``block_tables`` | ``AttentionMetadata.block_tables`` (flat) | ``page_indices`` |
| ``request_distribution`` | ``AttentionMetadata.request_distribution`` | ``distribution`` |
| ``logits_indices`` | ``logits_indices`` | |
| ``padded_num_reqs`` (static) | ``AttentionMetadata.padded_num_reqs`` | |

Sizes are tpu-inference's, not jaxprep's: attention arrays have ``max(max_num_reqs, 8)`` rows
(``MIN_NUM_SEQS``) whatever the batch, ``block_tables`` holds ``cdiv(max_model_len, block_size)`` pages
per row, ``input_ids`` / ``positions`` are padded to its token ladder and ``logits_indices`` to its
request ladder (`tpu_inference_sizes` picks both rungs on the host; -1 pads ``logits_indices``).
The batch is jaxprep's batch (the rows with work in state-row order: tpu-inference's condensed
persistent batch) reordered by tpu-inference's two-pointer swap (`two_pointer_order`), which is not
stable. The plain step only: no speculative decoding, batch order or DCP (DIVERGENCES.md, "TPU layout").

`to_rpa_v3_cache` builds the kernel's packed 5-D KV cache from jaxprep's slot-major K and V caches
(`tpu_inference/kernels/ragged_paged_attention/v3/kernel.py::get_kv_cache_shape`, ``merge_kv``); the
kernel then takes the step's per-token K and V and writes them into that cache itself.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp

from jaxprep._constants import NULL_BLOCK_ID, PAD_INPUT_ID, PAD_POSITION, PAD_SEQ_LEN, PAD_STATE_ROW
from jaxprep._ragged import prefix_sum, stack, token_request_index
from jaxprep._typing import Array, Bool, Int32, StepArray
from jaxprep.bounds import OVER_BUCKET
from jaxprep.config import PrepConfig, cdiv
from jaxprep.metadata import StepInputs

MIN_NUM_SEQS = 8
"""tpu-inference's smallest request count (`tpu_inference/runner/utils.py`): the attention arrays
have ``max(max_num_reqs, MIN_NUM_SEQS)`` rows, and its request ladder starts here."""
MIN_TOKEN_BUCKET = 16
"""tpu-inference's smallest token bucket (``envs.MIN_TOKEN_BUCKET``; one rank with a KV packing of at
most 4 keeps it)."""
PAD_LOGITS_INDEX = -1
"""tpu-inference's ``logits_indices`` pad (``logits_indices_cpu[_num_reqs:] = -1``)."""
HEAD_DIM_ALIGNMENT = 128
"""The RPA v3 cache's last axis: the head dim padded to the TPU's lane width."""


@jax.tree_util.register_dataclass
@typing.no_type_check  # JAX rebuilds pytrees with non-array leaves (ShapeDtypeStruct, ArgInfo)
@dataclasses.dataclass(frozen=True)
class TpuInferenceInputs:
    """One step as tpu-inference's runner hands it to its model (dp 1, one KV-cache group)."""

    input_ids: Int32[StepArray, " num_tokens_padded"]  # tokens in tpu-inference's batch order; pad: 0
    positions: Int32[StepArray, " num_tokens_padded"]  # pad: 0 (tpu-inference: a stale host buffer)
    query_start_loc: Int32[StepArray, " max_num_seqs_plus_1"]  # cu_q_lens; pad: repeats the total
    seq_lens: Int32[StepArray, " max_num_seqs"]  # kv_lens; pad: 0
    block_tables: Int32[StepArray, " max_num_seqs_x_pages_per_seq"]  # page_indices, row-major; pad: 0
    request_distribution: Int32[StepArray, " 3"]  # [decode_end, prefill_end, num_reqs] = [d, d, n]
    logits_indices: Int32[StepArray, " num_reqs_padded"]  # last token of each request; pad: -1
    idx_mapping: Int32[StepArray, " max_num_seqs"]  # jaxprep's: state row of each batch row; pad: -1
    errors: Int32[StepArray, ""]  # the step's error word, plus OVER_BUCKET when the sizes cannot hold it
    num_tokens_padded: int = dataclasses.field(metadata=dict(static=True))
    num_reqs_padded: int = dataclasses.field(metadata=dict(static=True))
    padded_num_reqs: int = dataclasses.field(metadata=dict(static=True))  # the attention rung: max_num_reqs


# --- sizes: tpu-inference's ladders (tpu_inference/runner/utils.py), on the host -------------------

def max_num_seqs(config: PrepConfig) -> int:
    """Rows of tpu-inference's attention arrays: ``max(max_num_reqs, MIN_NUM_SEQS)`` (`TPUModelRunner._init_inputs`)."""
    return max(config.max_num_reqs, MIN_NUM_SEQS)


def token_paddings(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of two from 16 below the budget, and the budget rounded up to 16 (``build_token_paddings``).

    ```
    # 100 -> (16, 32, 64, 112); 64 -> (16, 32, 64); 10 -> (16,)
    ```
    """
    budget = cdiv(max_num_batched_tokens, MIN_TOKEN_BUCKET) * MIN_TOKEN_BUCKET
    powers = [MIN_TOKEN_BUCKET << i for i in range(budget.bit_length()) if MIN_TOKEN_BUCKET << i <= budget]
    return tuple(sorted(set(powers) | {budget}))


def request_paddings(config: PrepConfig) -> tuple[int, ...]:
    """Powers of two from 8 below the row count, and the row count (``get_req_paddings``).

    ```
    # 36 rows -> (8, 16, 32, 36); 3 rows -> (8,)
    ```
    """
    rows = max_num_seqs(config)
    return tuple(sorted({MIN_NUM_SEQS << i for i in range(rows.bit_length()) if MIN_NUM_SEQS << i < rows} | {rows}))


def tpu_inference_sizes(config: PrepConfig, num_scheduled_tokens: int, num_reqs: int) -> tuple[int, int]:
    """``(num_tokens_padded, num_reqs_padded)`` of a step with these totals: the first rungs of
    `token_paddings` and `request_paddings` that hold them (``get_padded_token_len``)."""
    tokens, requests = token_paddings(config.max_num_batched_tokens), request_paddings(config)
    if not 0 < num_scheduled_tokens <= tokens[-1] or not 0 < num_reqs <= requests[-1]:
        raise ValueError(f"num_scheduled_tokens={num_scheduled_tokens} must lie in [1, {tokens[-1]}] and "
                         f"num_reqs={num_reqs} in [1, {requests[-1]}] (tpu-inference's top rungs)")
    return (tokens[bisect.bisect_left(tokens, num_scheduled_tokens)],
            requests[bisect.bisect_left(requests, num_reqs)])


# --- the layout, on the device ---------------------------------------------------------------------

def two_pointer_order(is_decode: Bool[Array, " n"], num_reqs: Int32[Array, ""]) -> Int32[Array, " n"]:
    """The batch row that each row of tpu-inference's order takes, after ``_reorder_batch``.

    Its two pointers swap the k-th prefill from the left with the k-th decode from the right while
    the prefill lies left of the decode: so, with d decodes, the k-th prefill among rows [0, d) and
    the k-th decode (from the right) among rows [d, n) trade places and every other row stays.

    ```
    # [P0, D1, P2, D3]: d 2, prefill row 0 <-> decode row 3 -> [3, 1, 2, 0] ([D3, D1, P2, P0], not stable)
    # [D0, P1, P2, D3, D4]: d 3, prefills [1, 2] <-> decodes [4, 3] -> [0, 4, 3, 2, 1]
    ```
    """
    n = is_decode.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    is_decode = is_decode & (rows < num_reqs)
    num_decodes = jnp.sum(is_decode, dtype=jnp.int32)
    prefill_ahead = (rows < num_decodes) & ~is_decode  # rows < d hold no padding
    decode_behind = (rows >= num_decodes) & is_decode
    counts = prefix_sum(stack([prefill_ahead, decode_behind]).astype(jnp.int32), 2 * n)
    prefill_rank = counts[0] - 1  # k-th from the left
    decode_rank = counts[1, -1] - counts[1]  # k-th from the right
    # scatter each misplaced row under its rank (everything else into the spare slot n), then pair ranks
    prefill_at = jnp.zeros(n + 1, jnp.int32).at[jnp.where(prefill_ahead, prefill_rank, n)].set(rows)
    decode_at = jnp.zeros(n + 1, jnp.int32).at[jnp.where(decode_behind, decode_rank, n)].set(rows)
    return jnp.where(prefill_ahead, decode_at[jnp.clip(prefill_rank, 0, n)],
                     jnp.where(decode_behind, prefill_at[jnp.clip(decode_rank, 0, n)], rows))


def _check_static(config: PrepConfig, num_tokens_padded: int, num_reqs_padded: int) -> None:
    """Raises at trace time: a feature that changes the step's fields, or a size outside tpu-inference's ladders."""
    if not 1 <= num_reqs_padded <= max_num_seqs(config) or num_tokens_padded < 1:
        raise ValueError(f"tpu_inference_layout: num_tokens_padded={num_tokens_padded} must be >= 1 and "
                         f"num_reqs_padded={num_reqs_padded} in [1, {max_num_seqs(config)}] (tpu_inference_sizes)")
    features = config.features
    for name, value, plain in (("batch_order", features.batch_order, None),
                               ("spec_decode", features.spec_decode, False),
                               ("dcp_world_size", features.dcp_world_size, 1)):
        if value != plain:
            raise ValueError(f"tpu_inference_layout: FeatureConfig.{name}={value!r} must be {plain!r} (the layout "
                             "takes the plain step, in state-row order)")


def _pad(x: Array, size: int, value: int) -> Array:
    """``x`` padded along axis 0 to ``size`` rows of ``value``."""
    return jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def tpu_inference_layout_body(step: StepInputs, config: PrepConfig, num_tokens_padded: int,
                              num_reqs_padded: int) -> TpuInferenceInputs:
    """The traced body of `tpu_inference_layout` (no jit of its own)."""
    _check_static(config, num_tokens_padded, num_reqs_padded)
    rows, pages = max_num_seqs(config), config.min_blocks_per_req
    meta = step.attn_metadata
    qsl = meta.query_start_loc  # [R + 1], R = jaxprep's num_reqs_padded <= max_num_reqs
    total, num_reqs = meta.num_actual_tokens, meta.num_reqs
    # a step these sizes cannot hold is flagged and emptied: every index stays in bounds
    too_big = (total > num_tokens_padded) | (num_reqs > num_reqs_padded)
    num_reqs, total = jnp.where(too_big, 0, num_reqs), jnp.where(too_big, 0, total)
    batch_rows = jnp.arange(qsl.shape[0] - 1, dtype=jnp.int32)
    scheduled = jnp.where(batch_rows < num_reqs, qsl[1:] - qsl[:-1], 0)
    order = two_pointer_order(scheduled == 1, num_reqs)  # a decode: one scheduled token (max_decode_tokens 1)
    kept = batch_rows < num_reqs
    new_scheduled = scheduled[order]
    ends = prefix_sum(new_scheduled, max(config.max_num_batched_tokens, 1))
    # token t of new row b comes from token qsl[order[b]] + (t - start[b]) of the step
    # S [3, 1] -> order [1, 0] -> S' [1, 3], ends [1, 4]; shift [3 - 0, 0 - 1] -> tokens [3, 0, 1, 2]
    shift = qsl[:-1][order] - (ends - new_scheduled)
    token_rows = token_request_index(ends, num_tokens_padded)
    tokens = jnp.arange(num_tokens_padded, dtype=jnp.int32)
    source = jnp.clip(tokens + shift[token_rows], 0, step.input_ids.shape[0] - 1)
    is_real_token = tokens < total
    input_ids = jnp.where(is_real_token, step.input_ids[source], PAD_INPUT_ID)
    positions = jnp.where(is_real_token, step.positions[source], PAD_POSITION)
    padded_ends = jnp.where(jnp.arange(rows) < num_reqs, _pad(ends, rows, 0), total)  # the tail repeats the total
    block_rows = jnp.where(kept[:, None], meta.block_table[order, :pages], NULL_BLOCK_ID)
    num_decodes = jnp.sum(kept & (new_scheduled == 1), dtype=jnp.int32)
    logits_rows = jnp.arange(num_reqs_padded, dtype=jnp.int32)
    return TpuInferenceInputs(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=jnp.pad(padded_ends, (1, 0)),
        seq_lens=_pad(jnp.where(kept, meta.seq_lens[order], PAD_SEQ_LEN), rows, PAD_SEQ_LEN),
        block_tables=_pad(block_rows, rows, NULL_BLOCK_ID).reshape(-1),
        request_distribution=jnp.stack([num_decodes, num_decodes, num_reqs]),
        logits_indices=jnp.where(logits_rows < num_reqs, padded_ends[:num_reqs_padded] - 1, PAD_LOGITS_INDEX),
        idx_mapping=_pad(jnp.where(kept, step.idx_mapping[order], PAD_STATE_ROW), rows, PAD_STATE_ROW),
        errors=step.errors | jnp.where(too_big, jnp.int32(OVER_BUCKET), 0),
        num_tokens_padded=num_tokens_padded,
        num_reqs_padded=num_reqs_padded,
        padded_num_reqs=config.max_num_reqs,
    )


@functools.partial(jax.jit, static_argnames=("config", "num_tokens_padded", "num_reqs_padded"))
def tpu_inference_layout(step: StepInputs, config: PrepConfig, num_tokens_padded: int,
                         num_reqs_padded: int) -> TpuInferenceInputs:
    """A jaxprep step (``prepare_padded(state, config, T)``, plain, state-row order) as tpu-inference
    0.32.0's runner prepares it (`TpuInferenceInputs`), padded to its ``num_tokens_padded`` tokens and
    ``num_reqs_padded`` logits rows (`tpu_inference_sizes`). One executable per (config, both rungs);
    `tpu_inference_layout_body` is its traced body."""
    return tpu_inference_layout_body(step, config, num_tokens_padded, num_reqs_padded)


# --- the RPA v3 kernel's KV cache ------------------------------------------------------------------

def kv_packing(dtype) -> int:
    """Values per 32-bit word (``get_dtype_packing``): float32 1, bfloat16 2, 8-bit 4."""
    return 32 // (jnp.dtype(dtype).itemsize * 8)


def rpa_v3_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype) -> tuple[int, int, int, int, int]:
    """``[pages, page_size, 2K / packing, packing, head_dim]``, 2K padded to the packing and the head
    dim to 128 (``get_kv_cache_shape``).

    ```
    # 12 blocks of 4, K 2, D 64, bfloat16 -> (12, 4, 2, 2, 128)
    ```
    """
    packing = kv_packing(dtype)
    return (num_blocks, block_size, cdiv(2 * num_kv_heads, packing), packing,
            cdiv(head_dim, HEAD_DIM_ALIGNMENT) * HEAD_DIM_ALIGNMENT)


@functools.partial(jax.jit, static_argnames=("block_size",))
def to_rpa_v3_cache(k_cache: Array, v_cache: Array, block_size: int) -> Array:
    """One layer's slot-major K and V caches ``[num_blocks * B, K, D]`` (compute dtype: bit-cast a
    uint16-held bf16 cache first, `jaxprep._typing.as_compute`) -> the v3 cache (`rpa_v3_cache_shape`):
    K and V interleaved by head, as ``merge_kv`` packs the kernel's new tokens, zero padded.

    ```
    # K heads [k0, k1], V heads [v0, v1] -> combined heads [k0, v0, k1, v1]; bf16: words [[k0, v0], [k1, v1]]
    ```
    """
    num_slots, num_kv_heads, head_dim = k_cache.shape
    shape = rpa_v3_cache_shape(num_slots // block_size, block_size, num_kv_heads, head_dim, k_cache.dtype)
    combined = jnp.stack([k_cache, v_cache], axis=2).reshape(num_slots, 2 * num_kv_heads, head_dim)
    combined = jnp.pad(combined, ((0, 0), (0, shape[2] * shape[3] - 2 * num_kv_heads), (0, shape[4] - head_dim)))
    return combined.reshape(shape)
