"""The former paged attention, kept as a cross-check and a memory control: every query token gathers
K/V for all ``max_model_len`` positions of its row, then one masked softmax.

Its cost is tokens x ``max_model_len`` per layer whatever the real lengths (a 256-token step at
``max_model_len`` 8192 needed 16 GiB of temporaries); `jaxprep.attention.paged_attention` replaces it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprep._ragged import token_request_index
from jaxprep._typing import as_compute
from jaxprep.metadata import StepInputs

HIGHEST = jax.lax.Precision.HIGHEST
MASKED = -1e30


def paged_context(inputs: StepInputs, block_size: int, max_model_len: int):
    """Cache slot of every context position of every query token, and which of them it may see.

    Context position j of batch row b lives at slot block_table[b, j // B] * B + j % B; token t of
    row b sees j <= positions[t] (causal) and j < seq_lens[b]; padded tokens see nothing.

    ```
    # B 2, block_table row [4, 9, 0..], position 2 -> slots [8, 9, 18, 19, ..], mask [1, 1, 1, 0, ..]
    ```
    """
    meta = inputs.attn_metadata
    num_columns = -(-max_model_len // block_size)
    table = meta.block_table[:, :num_columns]  # [R_pad, cdiv(M, B)]
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    row_slots = (table[:, :, None] * block_size + offsets[None, None, :]).reshape(table.shape[0], -1)
    token_row = token_request_index(meta.query_start_loc[1:], inputs.num_tokens_padded)
    is_real = jnp.arange(inputs.num_tokens_padded, dtype=jnp.int32) < meta.num_actual_tokens
    context = jnp.arange(row_slots.shape[1], dtype=jnp.int32)[None, :]
    mask = ((context <= inputs.positions[:, None]) & (context < meta.seq_lens[token_row][:, None])
            & is_real[:, None])
    return row_slots[token_row], mask


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [T, H, D] over per-query keys k, v [T, S, K, D] where mask [T, S]:
    [T, H, D]. Query head h reads KV head h // (H / K). A fully masked token averages its values."""
    tokens, num_heads, head_dim = q.shape
    groups = q.reshape(tokens, k.shape[2], num_heads // k.shape[2], head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", groups, k, precision=HIGHEST) * (head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None, :], scores, MASKED)
    out = jnp.einsum("tkgs,tskd->tkgd", jax.nn.softmax(scores, axis=-1), v, precision=HIGHEST)
    return out.reshape(tokens, num_heads, head_dim)


def gather_all_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: StepInputs, *,
                         block_size: int, max_model_len: int) -> jax.Array:
    """Attention [T, H, D] of q [T, H, D] over one layer's cache [num_slots, K, D], reading all
    ``max_model_len`` context slots of every token's row."""
    slots, mask = paged_context(inputs, block_size, max_model_len)
    return masked_attention(q, as_compute(k_cache[slots], q.dtype), as_compute(v_cache[slots], q.dtype), mask)
