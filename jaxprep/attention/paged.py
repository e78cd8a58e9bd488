"""Paged attention in plain XLA whose cost follows the pages a request holds (flash-decoding style).

Every query token t reads only its own row's KV blocks, and only the first ``kv_lens[t]`` positions
of them, in a loop over chunks of ``blocks_per_chunk`` blocks with a running max and sum (online
softmax, float32 accumulation). A request's tokens go in query tiles (up to `MAX_QUERY_TILE` tokens
of one request) that share each gathered chunk. The loop's trip count is dynamic: the batch's longest
context in chunks, so a step's time grows with the real context and its memory is O(tokens x chunk),
whatever ``max_model_len`` is. Shapes are static (one executable per bucket); a padded token (past
``num_actual_tokens``, slot -1) has ``kv_lens`` 0, lies in no tile and outputs zeros.

The metadata read, all integer: ``query_start_loc`` (token -> batch row), ``positions`` and
``seq_lens`` (how many keys a token sees: ``min(position + 1, seq_lens[row])``, causal within the
chunk), ``block_table`` (where those keys live), ``num_actual_tokens`` (which tokens are real).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxprep._ragged import token_request_index
from jaxprep._typing import Array, Int32, as_compute
from jaxprep.metadata import StepInputs

HIGHEST = jax.lax.Precision.HIGHEST
MASKED = -1e30
"""Score of a masked key: finite, so a token that has seen no key yet keeps a finite running max."""


def token_kv_lens(inputs: StepInputs) -> tuple[Int32[Array, " num_tokens_padded"], Int32[Array, " num_tokens_padded"]]:
    """``(token_row, kv_lens)``: each token's batch row and the number of keys it attends to.

    A real token at ``positions[t]`` of row r sees keys 0..positions[t] that exist: ``min(positions[t] + 1,
    seq_lens[r])``; a padded token sees none.

    ```
    # query_start_loc [0, 3, 4], positions [5, 6, 7, 2, 0, 0], seq_lens [8, 3], 4 real tokens
    #   -> token_row [0, 0, 0, 1, 1, 1], kv_lens [6, 7, 8, 3, 0, 0]
    ```
    """
    meta = inputs.attn_metadata
    num_tokens = inputs.num_tokens_padded
    token_row = token_request_index(meta.query_start_loc[1:], num_tokens)
    is_real = jnp.arange(num_tokens, dtype=jnp.int32) < meta.num_actual_tokens
    kv_lens = jnp.minimum(inputs.positions + 1, meta.seq_lens[token_row])
    return token_row, jnp.where(is_real, jnp.maximum(kv_lens, 0), 0)


def chunk_slots(block_table: Int32[Array, "num_reqs_padded max_blocks_per_req"],
                tile_row: Int32[Array, " num_tiles"], chunk: Int32[Array, ""], *, block_size: int,
                blocks_per_chunk: int, num_blocks: int) -> Int32[Array, "num_tiles chunk_len"]:
    """Cache slots of chunk ``chunk`` of every tile's row: block_table columns chunk * C .. chunk * C + C - 1,
    each expanded to its ``block_size`` slots (only [num_tiles, C] of the table is read, whatever its
    width). Columns and block ids are clamped: every read is in bounds.

    ```
    # B 2, C 2, a tile's row [4, 9, 7, 0, ..], chunk 1 -> blocks [7, 0] -> slots [14, 15, 0, 1]
    ```
    """
    columns = chunk * blocks_per_chunk + jnp.arange(blocks_per_chunk, dtype=jnp.int32)
    columns = jnp.minimum(columns, block_table.shape[1] - 1)
    blocks = jnp.clip(block_table[tile_row[:, None], columns[None, :]], 0, num_blocks - 1)  # [N, C]
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    return (blocks[:, :, None] * block_size + offsets[None, None, :]).reshape(blocks.shape[0], -1)


MAX_QUERY_TILE = 16
"""Largest query tile: the queries of one request that share each gathered KV chunk."""


def default_query_tile(num_tokens_padded: int, num_reqs_padded: int) -> int:
    """Tokens per tile for a bucket: 1 when the bucket has a row per token (decode-sized: every token its own
    tile), else the bucket's tokens per row, at most `MAX_QUERY_TILE`.

    ```
    # T 8, R_pad 8 -> 1; T 256, R_pad 1 -> 16; T 256, R_pad 64 -> 4
    ```
    """
    return max(1, min(MAX_QUERY_TILE, num_tokens_padded // num_reqs_padded))


def query_tiles(inputs: StepInputs, tile: int) -> tuple[Int32[Array, " num_tiles"], Int32[Array, " num_tiles"],
                                                        Int32[Array, " num_tiles"]]:
    """``(tile_row, tile_start, tile_len)``: each request's real tokens cut into tiles of ``tile`` tokens.

    ``cdiv(T, tile) + R_pad`` tiles bound every batch (sum over rows of cdiv(q_len, tile) <= T / tile + R);
    the unused ones have ``tile_len`` 0. With ``tile`` 1, tile t is token t.

    ```
    # query_start_loc [0, 5, 6, 6], 6 real tokens, tile 4 -> tiles per row [2, 1, 0]
    #   -> tile_row [0, 0, 1, ...], tile_start [0, 4, 5, ...], tile_len [4, 1, 1, 0, ...]
    ```
    """
    meta = inputs.attn_metadata
    num_tokens = inputs.num_tokens_padded
    if tile == 1:
        token_row, _ = token_kv_lens(inputs)
        tokens = jnp.arange(num_tokens, dtype=jnp.int32)
        return token_row, tokens, (tokens < meta.num_actual_tokens).astype(jnp.int32)
    starts = meta.query_start_loc[:-1]
    ends = jnp.clip(meta.query_start_loc[1:], starts, meta.num_actual_tokens)
    tiles_per_row = (jnp.maximum(ends - starts, 0) + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_per_row, dtype=jnp.int32)
    num_tiles = -(-num_tokens // tile) + starts.shape[0]
    tile_row = token_request_index(tile_ends, num_tiles)
    local = jnp.arange(num_tiles, dtype=jnp.int32) - (tile_ends - tiles_per_row)[tile_row]
    tile_start = starts[tile_row] + local * tile
    return tile_row, tile_start, jnp.clip(ends[tile_row] - tile_start, 0, tile)


def online_softmax_step(carry, scores: jax.Array, values: jax.Array, valid: jax.Array):
    """One chunk of the running softmax: carry (max [N, K, G, Q], sum [N, K, G, Q], acc [N, K, G, Q, D]) ->
    the same, with the chunk's keys where ``valid`` [N, Q, S] folded in; scores [N, K, G, Q, S], values
    [N, S, K, D]. Masked keys add exactly 0."""
    running_max, running_sum, acc = carry
    valid = valid[:, None, None]
    scores = jnp.where(valid, scores, MASKED)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    probs = jnp.where(valid, jnp.exp(scores - new_max[..., None]), 0.0)
    correction = jnp.exp(running_max - new_max)
    acc = acc * correction[..., None] + jnp.einsum("nkgqs,nskd->nkgqd", probs, values, precision=HIGHEST)
    return new_max, running_sum * correction + probs.sum(axis=-1), acc


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    """What every layer's attention reads of a step, computed once per step, before the layer loop
    (`paged_plan`): each query tile's batch row, tokens and key counts, and the step's longest context."""

    tile_row: Int32[Array, " num_tiles"]
    tokens: Int32[Array, "num_tiles tile"]  # num_tokens_padded: no token (past the tile's length)
    tile_kv_lens: Int32[Array, "num_tiles tile"]  # keys each token sees (0: no token)
    num_chunks: Int32[Array, ""]  # the batch's longest context, in chunks of block_size * blocks_per_chunk
    block_table: Int32[Array, "num_reqs_padded max_blocks_per_req"]


jax.tree_util.register_dataclass(PagedPlan, data_fields=["tile_row", "tokens", "tile_kv_lens", "num_chunks",
                                                         "block_table"], meta_fields=[])


def paged_plan(inputs: StepInputs, *, block_size: int, blocks_per_chunk: int = 1,
               query_tile: int | None = None) -> PagedPlan:
    """The query tiles of ``inputs`` (`query_tiles`, ``query_tile`` tokens each, default
    `default_query_tile`), each tile token's key count and the number of KV chunks to read.

    A tile token sees ``min(positions[t] + 1, seq_lens[tile_row])`` keys (`token_kv_lens`: a token of a
    tile is a real token of the tile's row), so the plan needs one token -> row mapping, the tiles'.

    ```
    # query_start_loc [0, 3, 4], positions [5, 6, 7, 2, 0, 0], seq_lens [8, 3], 4 real tokens, tile 4
    #   -> tile_row [0, 1, ..], tokens [[0, 1, 2, T], [3, T, T, T], ..], tile_kv_lens [[6, 7, 8, 0], [3, 0, 0, 0], ..]
    ```
    """
    meta = inputs.attn_metadata
    num_tokens = inputs.num_tokens_padded
    tile = query_tile or default_query_tile(num_tokens, meta.query_start_loc.shape[0] - 1)
    if tile == 1:  # every token its own tile (decode-sized buckets)
        tile_row, kv_lens = token_kv_lens(inputs)
        tokens = jnp.arange(num_tokens, dtype=jnp.int32)
        tokens = jnp.where(tokens < meta.num_actual_tokens, tokens, num_tokens)[:, None]
        tile_kv_lens = kv_lens[:, None]
    else:
        tile_row, tile_start, tile_len = query_tiles(inputs, tile)
        tokens = tile_start[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]  # [N, Q]
        in_tile = jnp.arange(tile, dtype=jnp.int32)[None, :] < tile_len[:, None]
        tokens = jnp.where(in_tile, jnp.clip(tokens, 0, num_tokens - 1), num_tokens)  # num_tokens: not a token
        kv_lens = jnp.minimum(inputs.positions[jnp.minimum(tokens, num_tokens - 1)] + 1,
                              meta.seq_lens[tile_row][:, None])
        tile_kv_lens = jnp.where(in_tile, jnp.maximum(kv_lens, 0), 0)
    chunk_len = block_size * blocks_per_chunk
    num_chunks = (jnp.max(tile_kv_lens) + chunk_len - 1) // chunk_len
    return PagedPlan(tile_row=tile_row, tokens=tokens, tile_kv_lens=tile_kv_lens, num_chunks=num_chunks,
                     block_table=meta.block_table)


def paged_attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, plan: PagedPlan, *,
                 block_size: int, blocks_per_chunk: int = 1) -> jax.Array:
    """Causal grouped-query attention of every token over its row's paged context, in layer ``layer`` of
    the stacked caches ``k_cache``, ``v_cache`` [L, num_slots, K, D] (read where they lie: each chunk's
    slots gathered from the layer, no copy of the layer); q [T, H, D]; the step's `PagedPlan`. Returns
    [T, H, D] in q's dtype, zeros for padded tokens. See `paged_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tokens, tile = plan.tokens, plan.tokens.shape[1]
    chunk_len = block_size * blocks_per_chunk
    scaled = q.astype(jnp.float32)
    groups = (scaled[:, None] if tile == 1 else scaled[jnp.minimum(tokens, num_tokens - 1)]) * (head_dim ** -0.5)
    groups = groups.reshape(tokens.shape + (num_kv_heads, num_heads // num_kv_heads, head_dim))  # [N, Q, K, G, D]

    def chunk_step(chunk, carry):
        slots = chunk_slots(plan.block_table, plan.tile_row, chunk, block_size=block_size,
                            blocks_per_chunk=blocks_per_chunk, num_blocks=k_cache.shape[1] // block_size)
        # one chunk read in the cache's storage dtype, then as values of q's dtype, then float32: only
        # [N, S, K, D] is ever converted, never the whole cache (bf16 bit patterns: jaxprep/_typing.py)
        keys, values = (as_compute(cache[layer, slots], q.dtype).astype(jnp.float32) for cache in (k_cache, v_cache))
        scores = jnp.einsum("nqkgd,nskd->nkgqs", groups, keys, precision=HIGHEST)
        key_positions = chunk * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)
        return online_softmax_step(carry, scores, values, key_positions[None, None, :] < plan.tile_kv_lens[:, :, None])

    acc_shape = (tokens.shape[0], num_kv_heads, num_heads // num_kv_heads, tile, head_dim)
    init = (jnp.full(acc_shape[:-1], MASKED, jnp.float32), jnp.zeros(acc_shape[:-1], jnp.float32),
            jnp.zeros(acc_shape, jnp.float32))
    _, running_sum, acc = jax.lax.fori_loop(0, plan.num_chunks, chunk_step, init)
    out = acc / jnp.where(running_sum > 0, running_sum, 1.0)[..., None]  # [N, K, G, Q, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(tokens.shape + (num_heads, head_dim)).astype(q.dtype)
    if tile == 1:  # tile t is token t
        return jnp.where((tokens < num_tokens)[:, :, None, None], out, 0)[:, 0]
    # each real token lies in exactly one tile; the rest write to index T, dropped
    return jnp.zeros(q.shape, q.dtype).at[tokens].set(out, mode="drop")


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: StepInputs, *,
                    block_size: int, blocks_per_chunk: int = 1, query_tile: int | None = None) -> jax.Array:
    """Causal grouped-query attention of every token of ``inputs`` over its row's paged context.

    q [T, H, D]; ``k_cache``, ``v_cache`` [num_slots, K, D]: one layer's cache, slot = block_id *
    block_size + offset (jaxprep's `KVCache` layout), already holding this step's keys. Query head h
    reads KV head h // (H / K). The queries of a request go in tiles of ``query_tile`` tokens (default
    `default_query_tile`) that share each gathered KV chunk. Returns [T, H, D] in q's dtype; padded
    tokens give zeros. The models' layer loop plans once per step (`paged_plan`) and attends per layer
    (`paged_attend`); this is both for one layer.

    q's dtype is the compute dtype (float32, or bf16); the caches may hold that dtype's storage form
    (bf16 as uint16 bit patterns on XLA:CPU, `jaxprep._typing`): each gathered chunk is bit-cast and
    converted to float32, where the scores, the softmax and the accumulation run (exact for bf16 values).
    """
    plan = paged_plan(inputs, block_size=block_size, blocks_per_chunk=blocks_per_chunk, query_tile=query_tile)
    return paged_attend(q, k_cache[None], v_cache[None], jnp.int32(0), plan, block_size=block_size,
                        blocks_per_chunk=blocks_per_chunk)
