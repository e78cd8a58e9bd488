"""Random steps, their tpu-inference layout, and an attention case through the RPA v3 kernel's reference:
shared by tests/layouts/test_tpu_inference.py and the check against tpu-inference's own code
(`tests/support/tpu_inference_source.py`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep.config import cdiv
from jaxprep.layouts import tpu_inference as tpu
from jaxprep.reference.attention import paged_attention_reference
from support.batches import allocate_blocks
from support.tpu_inference_runner import TpuRunner, ref_ragged_paged_attention

SMALL = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=48, block_size=4, num_blocks=80)
"""Fewer rows than tpu-inference's MIN_NUM_SEQS: its arrays have 8 rows, one request rung."""
WIDE = PrepConfig(max_num_reqs=12, max_model_len=24, max_num_batched_tokens=40, block_size=4, num_blocks=90)
"""Request rungs 8 and 12; a budget that is not a power of two (token rungs 16, 32, 48)."""
CONFIGS = {"6-rows": SMALL, "12-rows": WIDE}
FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "request_distribution",
          "logits_indices")
"""What `TpuInferenceInputs` and the runner's ``_prepare_inputs`` both return (``padded_num_reqs`` apart)."""
KERNEL_INPUTS = ("seq_lens", "block_tables", "query_start_loc", "request_distribution")
"""The RPA v3 kernel's kv_lens, page_indices, cu_q_lens and distribution, in its argument order."""


def random_state(config: PrepConfig, rng) -> dict[str, np.ndarray]:
    """Rows that decode (one token), prefill (two or more), or have no work, in random order."""
    rows, max_len = config.max_num_reqs, config.max_model_len
    computed, scheduled = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    remaining = config.max_num_batched_tokens
    for row in range(rows):
        kind = rng.choice(["decode", "prefill", "idle"], p=[0.45, 0.4, 0.15])
        computed[row] = rng.integers(1 if kind == "decode" else 0, max_len - 1)
        most = min(max_len - computed[row], remaining)
        if kind == "decode" and most >= 1:
            scheduled[row] = 1
        elif kind == "prefill" and most >= 2:
            scheduled[row] = rng.integers(2, most + 1)
        remaining -= scheduled[row]
    if scheduled.sum() == 0:
        computed[0], scheduled[0] = 0, 3
    return fixed_state(config, computed, scheduled, int(rng.integers(2**31)))


def fixed_state(config: PrepConfig, computed, scheduled, seed: int = 0) -> dict[str, np.ndarray]:
    """Given counts: random tokens, and distinct blocks for the columns each row uses (0 past them)."""
    rng = np.random.default_rng(seed)
    computed, scheduled = np.array(computed, np.int32), np.array(scheduled, np.int32)
    needed = [cdiv(int(n), config.block_size) for n in computed + scheduled]
    return dict(token_ids=rng.integers(0, 50_000, (config.max_num_reqs, config.max_model_len), np.int32),
                block_table=allocate_blocks(config.max_num_reqs, config.max_blocks_per_req, needed,
                                            config.max_block_id, seed),
                num_computed_tokens=computed, num_scheduled_tokens=scheduled)


def runner_for(config: PrepConfig, arrays: dict[str, np.ndarray], rows=None) -> tuple[TpuRunner, dict]:
    """A fresh (transcribed) tpu-inference runner holding the rows with work in state-row order (its
    condensed persistent batch, request id = state row; ``rows``: another order), and each request's
    scheduled tokens."""
    runner = TpuRunner(config.max_num_reqs, config.max_model_len, config.max_num_batched_tokens, config.block_size)
    scheduled = {}
    for row in np.flatnonzero(arrays["num_scheduled_tokens"]) if rows is None else rows:
        runner.add_request(int(row), arrays["token_ids"][row], int(arrays["num_computed_tokens"][row]),
                           arrays["block_table"][row, :runner.max_num_blocks_per_req])
        scheduled[int(row)] = int(arrays["num_scheduled_tokens"][row])
    return runner, scheduled


def layout(config: PrepConfig, arrays: dict[str, np.ndarray], sizes: tuple[int, int] | None = None,
           bucket: int | None = None):
    """(jaxprep's step at ``bucket``, default the step's own; its tpu-inference layout at ``sizes``,
    default `tpu_inference_sizes`)."""
    scheduled = arrays["num_scheduled_tokens"]
    total, num_reqs = int(scheduled.sum()), int((scheduled > 0).sum())
    step = prepare_padded(BatchState.from_numpy(**arrays), config, bucket or config.bucket_for(total))
    return step, tpu.tpu_inference_layout(step, config, *(sizes or tpu.tpu_inference_sizes(config, total, num_reqs)))


def jaxprep_layout(config: PrepConfig, arrays: dict[str, np.ndarray]) -> dict:
    """The layout's fields as NumPy, by the runner's names (``req_ids``: the state rows in batch order)."""
    _, ours = layout(config, arrays, bucket=config.token_buckets[-1])
    fields = {name: np.asarray(getattr(ours, name)) for name in FIELDS}
    return dict(fields, padded_num_reqs=ours.padded_num_reqs, req_ids=np.asarray(ours.idx_mapping))


@dataclasses.dataclass
class AttentionCase:
    """One random step through the v3 kernel's (transcribed) reference, and jaxprep's oracle on jaxprep's step."""

    qkv: tuple  # queries [T, H, D], keys and values [T, K, D]: each real token of the layout, in its order
    kv: tuple  # keys, values alone
    cache: tuple  # K and V caches [slots, K, D] before the step (each request's context, garbage elsewhere)
    written: tuple  # the same after jaxprep's slot mapping writes the step's K and V
    v3_cache: np.ndarray  # `to_rpa_v3_cache` of ``cache``
    kernel_inputs: tuple  # the layout's KERNEL_INPUTS
    total: int
    sm_scale: float
    cache_shape_args: tuple  # get_kv_cache_shape's arguments
    reference_out: np.ndarray  # the transcribed reference [total, H, D]
    reference_cache: np.ndarray
    oracle_out: np.ndarray  # jaxprep's oracle on jaxprep's step, in the layout's token order


def attention_case(seed: int, config: PrepConfig = SMALL, heads: int = 4, kv_heads: int = 2,
                   head_dim: int = 8) -> AttentionCase:
    rng = np.random.default_rng(seed)
    table_shape = (config.max_num_reqs, config.max_model_len)
    q_of, k_of, v_of = (rng.standard_normal((*table_shape, n, head_dim)).astype(np.float32)
                        for n in (heads, kv_heads, kv_heads))  # the "model": (row, position) -> q, k, v
    arrays = random_state(config, rng)
    step, ours = layout(config, arrays)
    cache = [rng.standard_normal((config.num_blocks * config.block_size, kv_heads, head_dim)).astype(np.float32)
             for _ in range(2)]
    written = [c.copy() for c in cache]
    for row in np.flatnonzero(arrays["num_scheduled_tokens"]):
        computed = arrays["num_computed_tokens"][row]
        for p in range(computed + arrays["num_scheduled_tokens"][row]):
            slot = arrays["block_table"][row, p // config.block_size] * config.block_size + p % config.block_size
            for table in (written, cache) if p < computed else (written,):
                table[0][slot], table[1][slot] = k_of[row, p], v_of[row, p]
    total = int(ours.query_start_loc[-1])
    ends = np.asarray(ours.query_start_loc)[1:]
    rows = np.asarray(ours.idx_mapping)[np.searchsorted(ends, np.arange(total), side="right")]
    positions = np.asarray(ours.positions)[:total]
    qkv = tuple(x[rows, positions] for x in (q_of, k_of, v_of))
    v3_cache = np.asarray(tpu.to_rpa_v3_cache(jnp.asarray(cache[0]), jnp.asarray(cache[1]), config.block_size))
    kernel_inputs = tuple(np.asarray(getattr(ours, name)) for name in KERNEL_INPUTS)
    sm_scale = head_dim ** -0.5
    out, new_cache = ref_ragged_paged_attention(*qkv, v3_cache, *kernel_inputs, sm_scale=sm_scale)
    oracle = _jaxprep_attention(step, config, q_of, written)
    return AttentionCase(
        qkv=qkv, kv=qkv[1:], cache=tuple(cache), written=tuple(written), v3_cache=v3_cache,
        kernel_inputs=kernel_inputs, total=total, sm_scale=sm_scale,
        cache_shape_args=(config.num_blocks, config.block_size, kv_heads, head_dim, jnp.float32),
        reference_out=out, reference_cache=new_cache,
        oracle_out=np.stack([oracle[int(r), int(p)] for r, p in zip(rows, positions, strict=True)]))


def _jaxprep_attention(step, config: PrepConfig, q_of, cache) -> dict:
    """jaxprep's attention oracle on jaxprep's step, keyed by (state row, position)."""
    meta = step.attn_metadata
    total = int(meta.num_actual_tokens)
    ends = np.asarray(meta.query_start_loc)[1:]
    rows = np.asarray(step.idx_mapping)[np.searchsorted(ends, np.arange(total), side="right")]
    positions = np.asarray(step.positions)
    q = np.zeros((step.num_tokens_padded, *q_of.shape[2:]), np.float32)
    q[:total] = q_of[rows, positions[:total]]
    out = paged_attention_reference(q, *cache, query_start_loc=np.asarray(meta.query_start_loc),
                                    seq_lens=np.asarray(meta.seq_lens), positions=positions,
                                    block_table=np.asarray(meta.block_table), num_actual_tokens=total,
                                    block_size=config.block_size)
    return {(int(rows[t]), int(positions[t])): out[t] for t in range(total)}
