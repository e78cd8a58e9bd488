"""A plain-torch paged attention that reads bridged metadata: a readable consumer, not a fast kernel.

It shows what each field of `TorchAttentionMetadata` is for:
- ``slot_mapping`` says where each token's K/V is written (``-1``: padded token, nothing written);
- ``block_table_tensor`` and ``seq_lens`` say where each request's cached K/V is read from;
- ``query_start_loc_cpu`` splits the flat token batch into requests (the host mirror, since a
  Python loop over requests needs host ints, as vLLM's CPU-side metadata builders do).

Cache layout: ``key_cache`` and ``value_cache`` are [num_blocks, block_size, num_kv_heads, head_size];
slot ``s`` is row ``s % block_size`` of block ``s // block_size``.
"""

from __future__ import annotations

import math

from jaxprep import PAD_SLOT_ID
from torch_bridge._torch import torch


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Writes token t's key/value ([num_tokens, num_kv_heads, head_size]) at slot ``slot_mapping[t]``.

    Padded tokens (slot -1) write nothing; -1 is masked out, never used as an index (it would wrap).

    ```
    # block_size 4, slot_mapping [5, 14, -1] -> block 1 row 1, block 3 row 2, skipped
    ```
    """
    written = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[written].long()
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key[written])
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value[written])


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, attn_metadata,
                    scale: float | None = None) -> torch.Tensor:
    """Causal attention of each request's queries over its paged K/V; [num_tokens_padded, heads, head_size].

    Request r's queries are tokens ``qsl[r]:qsl[r+1]``; its keys are the first ``seq_lens[r]``
    cached tokens of the blocks in ``block_table_tensor[r]``. Padded tokens' outputs are 0.
    """
    query_start_loc = attn_metadata.query_start_loc_cpu.tolist()
    seq_lens = attn_metadata.seq_lens_cpu.tolist()
    block_size = key_cache.shape[1]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    output = torch.zeros_like(query)
    for request in range(attn_metadata.num_reqs):
        start, end, seq_len = query_start_loc[request], query_start_loc[request + 1], seq_lens[request]
        # seq_len 6, block_size 4, row [3, 7, 0, ...] -> blocks [3, 7] -> cache rows of positions 0..5
        blocks = attn_metadata.block_table_tensor[request, :-(-seq_len // block_size)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len]
        values = value_cache[blocks].flatten(0, 1)[:seq_len]
        output[start:end] = causal_attention(query[start:end], keys, values, scale)
    return output


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of S queries over L >= S keys, causal and bottom-right aligned (docs/semantics.md#causal-mask).

    Query i sits at position L - S + i and sees keys 0 .. L - S + i.

    ```
    # S 2, L 5 -> query 0 sees keys 0..3, query 1 sees keys 0..4
    ```
    """
    num_queries, num_keys = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]  # grouped-query attention: kv head h serves query heads h*g..
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    query_positions = num_keys - num_queries + torch.arange(num_queries, device=query.device)
    visible = torch.arange(num_keys, device=query.device)[None, :] <= query_positions[:, None]  # [S, L]
    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)
