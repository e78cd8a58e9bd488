"""NumPy oracle of paged attention: each real token's softmax over its request's context, one token at a time.

Token t of batch row r (``query_start_loc[r] <= t < query_start_loc[r + 1]``, t < ``num_actual_tokens``)
attends to context positions j < min(positions[t] + 1, seq_lens[r]); position j lives at slot
block_table[r, j // B] * B + j % B. Query head h reads KV head h // (H / K) (transformers'
``repeat_kv``). Padded tokens output zeros. This is what a paged-attention backend computes from
vLLM's ``CommonAttentionMetadata`` (`vllm/v1/attention/backends/flash_attn.py::FlashAttentionImpl.forward`).
"""

from __future__ import annotations

import numpy as np


def causal_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Softmax attention of one token q [H, D] over keys, values [S, K, D] (all visible), float64."""
    num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    out = np.zeros((num_heads, head_dim))
    for h in range(num_heads):
        scores = keys[:, h // group, :].astype(np.float64) @ q[h].astype(np.float64) / np.sqrt(head_dim)
        weights = np.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ values[:, h // group, :].astype(np.float64)
    return out


def paged_attention_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, *, query_start_loc,
                              seq_lens, positions, block_table, num_actual_tokens: int,
                              block_size: int) -> np.ndarray:
    """Attention output [T, H, D] of every token of q [T, H, D] over one layer's cache [num_slots, K, D]."""
    out = np.zeros(q.shape)
    for row in range(len(seq_lens)):
        for t in range(int(query_start_loc[row]), min(int(query_start_loc[row + 1]), num_actual_tokens)):
            context = np.arange(min(int(positions[t]) + 1, int(seq_lens[row])))
            slots = block_table[row, context // block_size] * block_size + context % block_size
            out[t] = causal_attention(q[t], k_cache[slots], v_cache[slots])
    return out
