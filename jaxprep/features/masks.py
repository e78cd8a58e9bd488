"""Attention masks for Ascend-style kernels (docs/semantics.md#ascend-masks), only on request
(`FeatureConfig.attn_mask`).

The masks mark *masked* entries (vllm-ascend's convention: ``triu(1)`` is 1 above the diagonal).
Memory of each form, with ``C = FeatureConfig.mask_kv_len or max_model_len`` columns:

| form | shape | bytes | when built |
|---|---|---|---|
| ``None`` | | 0 | JAX / RPA kernels mask from ``query_start_loc`` and ``seq_lens`` |
| ``"compressed"`` | ``[2048, 2048]`` int8 | 4 MiB, once per process | first use (`compressed_causal_mask`) |
| ``"rows_bool"`` | ``[T_pad, C]`` bool | ``T_pad * C`` per step | every step, inside the jit |
| ``"rows_additive"`` | ``[T_pad, C]`` fp16/bf16/fp32 | ``T_pad * C * 2`` (or 4) per step | every step, inside the jit |

Row masks are bounded by the token bucket times the columns, never ``max_model_len ** 2``:
2048 tokens x 32k columns is 64 MiB as bool, 128 MiB as fp16. The compressed mask is one
constant: `prepare_inputs` attaches the cached device array (a jit output would be a fresh
4 MiB copy every step), while `prepare_padded` leaves ``attn_mask`` None in that mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep._typing import Array, Bool, Int32
from jaxprep.bounds import check_row_bound
from jaxprep.features.flags import ROW_MASK_TOO_NARROW
from jaxprep.features.record import Feature

COMPRESSED_MASK_SIZE = 2048
"""Side of the compressed causal mask that FIA ``sparse_mode=3`` maps real positions onto."""

BF16_MASK_VALUE = -10000.0
"""Additive mask value for bf16 (vllm-ascend's ``mask_scale_factor``); other dtypes use ``finfo.min``."""


@functools.cache
def compressed_causal_mask(device: jax.Device | None = None) -> jax.Array:
    """The constant ``[2048, 2048]`` int8 ``triu(1)`` mask (1 = masked), built once per device."""
    mask = np.triu(np.ones((COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE), np.int8), k=1)
    return jax.device_put(mask, device)


def mask_value(dtype_name: str) -> float:
    """The additive value of a masked entry: ``finfo(dtype).min``, or -10000 for bf16; never -inf."""
    if dtype_name == "bfloat16":
        return BF16_MASK_VALUE
    return float(jnp.finfo(jnp.dtype(dtype_name)).min)


def row_mask_bool(positions: Int32[Array, " num_tokens_padded"], columns: int) -> Bool[Array, "num_tokens_padded C"]:
    """Row ``t`` masks the KV positions after token ``t``'s own position (causal within its request).

    Padded tokens have position 0, so they see KV position 0 only (no all-masked row).

    ```
    # positions [5, 6, 7], 9 columns -> row 0 [F,F,F,F,F,F,T,T,T], row 2 [F x 8, T]
    ```
    """
    kv_positions = jnp.arange(columns, dtype=jnp.int32)
    return kv_positions[None, :] > positions[:, None]


def row_mask_additive(positions: Int32[Array, " num_tokens_padded"], columns: int,
                      dtype_name: str) -> Array:
    """`row_mask_bool` as an additive mask: 0 where visible, `mask_value` where masked."""
    dtype = jnp.dtype(dtype_name)
    masked = row_mask_bool(positions, columns)
    return jnp.where(masked, jnp.asarray(mask_value(dtype_name), dtype), jnp.asarray(0, dtype))


def attn_mask(positions: Int32[Array, " num_tokens_padded"], form: str, columns: int, dtype_name: str):
    """The jitted part of `FeatureConfig.attn_mask`: a row mask, or None for the compressed constant."""
    if form == "rows_bool":
        return row_mask_bool(positions, columns)
    if form == "rows_additive":
        return row_mask_additive(positions, columns, dtype_name)
    return None


def check_row_mask_columns(computed, scheduled, columns: int) -> None:
    """Host check: every row with work fits the row mask's ``columns`` (``mask_kv_len``)."""
    seq_lens = np.where(scheduled > 0, computed + scheduled, 0)
    check_row_bound(seq_lens > columns, "num_computed_tokens + num_scheduled_tokens", seq_lens,
                    f"the row mask's FeatureConfig.mask_kv_len={columns} columns")


# --- the record (jaxprep.features.registry) -----------------------------------------------------

ROW_MODES = ("rows_bool", "rows_additive")
"""The ``attn_mask`` modes with a row per token, bounded by ``FeatureConfig.mask_kv_len`` columns."""


def _check_values(host, computed, scheduled, config) -> None:
    if config.features.attn_mask in ROW_MODES:
        check_row_mask_columns(computed, scheduled, config.features.mask_columns(config))


def _row_flags(state, config, in_batch) -> list:
    if config.features.attn_mask not in ROW_MODES:
        return []
    # S > columns - C: no int32 wrap for C >= 0 (a negative C is flagged by the core bits)
    return [(ROW_MASK_TOO_NARROW, in_batch & (state.num_scheduled_tokens > config.features.mask_columns(config)
                                              - state.num_computed_tokens))]


def _metadata(build) -> None:
    features = build.config.features
    build.outputs["attn_mask"] = attn_mask(build.step.positions, features.attn_mask,
                                           features.mask_columns(build.config), features.attn_mask_dtype)


FEATURE = Feature(
    name="masks",
    is_on=lambda features: features.attn_mask is not None,
    check_values=_check_values,
    row_flags=_row_flags,
    messages=lambda config: {
        ROW_MASK_TOO_NARROW: f"num_computed_tokens + num_scheduled_tokens of a scheduled row exceeds the row "
                             f"mask's FeatureConfig.mask_kv_len={config.features.mask_columns(config)} columns"},
    metadata=_metadata,
)
