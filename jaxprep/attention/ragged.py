"""jaxprep's ragged paged attention for NVIDIA GPUs: one Pallas (Triton) launch per layer serves a
mixed batch of prefill chunks and decodes, read straight from the prepared step and the stacked cache.

Its XLA twin is `jaxprep.attention.paged.paged_attention`: the same query tiles (`query_tiles`: each
request's real tokens cut into tiles of ``query_tile`` tokens), the same causal bound per token
(`token_kv_lens`: ``min(position + 1, seq_lens[row])``), the same online softmax in float32.
vLLM's counterpart is its Triton backend, `vllm/v1/attention/ops/triton_unified_attention.py`
(query tiles per request, a 3-D split-KV variant for decode batches, the slot-major cache).

Grid ``(num_tiles, num_kv_heads, kv_splits)``; program ``(p, k, s)``:

- holds tile p's queries for the G query heads of KV head k (grouped-query attention: the group
  shares every K/V row it reads) as rows ``r = i * Gp + g``: token ``i`` of the tile, head ``g`` of
  the group, ``Gp`` = G rounded up to a power of 2, at least `MIN_ROWS` rows (Triton's smallest dot);
- walks split s of the tile's context (keys ``0 .. max kv_lens`` of its tokens) in chunks of
  ``kv_chunk`` keys; a chunk's slots come from the block-table row of the tile's request
  (``block_table[row, j // B] * B + j % B``, columns and block ids clamped into the table and the
  cache), and its K and V rows of head k of layer ``layer`` are read once for all the tile's rows;
- scores, the causal mask (key ``j < kv_lens`` of the row's token), the online softmax and the
  accumulation run in float32 (dot inputs in the compute dtype; float32 dots at ``HIGHEST``, IEEE
  in Triton, not TF32);
- ``kv_splits`` 1: writes its rows' output. More (long decodes on a small grid, `default_kv_splits`):
  writes its split's accumulator, running max and sum; `combine_splits` (XLA) merges the splits.

The cache is read where it lies: the stacked ``[num_layers, num_blocks * B, K, D]`` arrays of
`jaxprep.serving.KVCache` (vLLM's flash-attention layout ``[num_blocks, B, K, D]`` per layer), plus
the layer's index, so no layer is sliced out or converted per step. Every read is in bounds: tokens,
rows, columns, block ids and the layer are clamped, and keys past a token's ``kv_lens`` are masked.
Tokens in no tile (the padded tail) are written as zeros by the spare tiles (`ragged_tiles`), so
every output row is written exactly once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxprep._typing import Array, Float32, Int32, as_compute
from jaxprep.attention import ragged_kernel_fits
from jaxprep.attention.paged import MASKED, default_query_tile, query_tiles, token_kv_lens
from jaxprep.metadata import StepInputs

HIGHEST = jax.lax.Precision.HIGHEST
KV_CHUNK = 64
"""Keys per iteration of a program's loop (a power of 2, at least `MIN_ROWS`)."""
MIN_ROWS = 16
"""Triton's smallest side of a dot: the rows of a program (queries x heads) are padded up to it."""
TARGET_PROGRAMS = 256
"""Programs `default_kv_splits` aims for: about two per SM of an H100 (132 SMs)."""
MAX_KV_SPLITS = 16
MAX_ROWS = 64
"""Most rows (queries x heads of a group) of one program: its float32 accumulator stays in registers."""
COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=2)


def _pow2_ceil(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1).

    ```
    # 1 -> 1, 3 -> 4, 16 -> 16
    ```
    """
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    """The largest power of 2 <= n (1 for n <= 1).

    ```
    # 1 -> 1, 12 -> 8, 16 -> 16
    ```
    """
    return 1 << (max(n, 1).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class RaggedSizes:
    """The static sizes one launch is specialised to."""

    num_tokens: int  # T
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # D
    num_layers: int  # L
    num_blocks: int
    block_size: int  # B
    table_width: int  # W, block-table columns
    num_reqs_padded: int  # R
    query_tile: int  # Q, a power of 2
    kv_chunk: int
    kv_splits: int  # S
    interpret: bool

    @property
    def spare_row(self) -> int:
        """Where the lanes of a store that write nothing point. Triton stores no masked-off lane, so on
        CUDA it is any token (T - 1). Pallas' interpreter writes such a lane back with the value it read
        (a scatter, `jax._src.pallas.primitives._swap_discharge_rule`), so two lanes of one store at one
        address race there: its output has one more token row, T, for them, dropped after the call."""
        return self.num_tokens if self.interpret else self.num_tokens - 1

    @property
    def out_tokens(self) -> int:
        return self.spare_row + 1

    @property
    def group(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def group_padded(self) -> int:
        """Gp: G rounded up to a power of 2 (a row's token is then ``r // Gp``)."""
        return _pow2_ceil(self.group)

    @property
    def rows(self) -> int:
        """M: rows of a program, ``Q * Gp``, at least `MIN_ROWS`. # Q 1, G 2 -> 16; Q 8, G 6 -> 64"""
        return max(MIN_ROWS, self.query_tile * self.group_padded)


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """What every layer's launch reads of a step, computed once per step (before the layer loop)."""

    tiles: Int32[Array, "4 num_tiles"]  # rows: tile_row, tile_start, tile_len, tile_span (`ragged_tiles`)
    kv_lens: Int32[Array, " num_tokens_padded"]  # keys each token sees (`token_kv_lens`)
    block_table: Int32[Array, "num_reqs_padded max_blocks_per_req"]
    query_tile: int  # static: tokens per tile, a power of 2


jax.tree_util.register_dataclass(RaggedPlan, data_fields=["tiles", "kv_lens", "block_table"],
                                 meta_fields=["query_tile"])


def ragged_tiles(inputs: StepInputs, tile: int) -> Int32[Array, "4 num_tiles"]:
    """`query_tiles` plus where each spare tile writes zeros: rows ``tile_row, tile_start, tile_len,
    tile_span``. A used tile computes and writes its ``tile_len`` tokens (``span = len``); spare tile u
    (after the used ones) writes zeros to tokens ``num_actual + u * tile ..`` (``span`` of them, up to
    ``tile``, none past T), so the padded tail is covered: ``cdiv(T, tile) + R_pad`` tiles leave at least
    ``cdiv(T - num_actual, tile)`` spare ones.

    ```
    # query_start_loc [0, 5, 6, 6], 6 real tokens of T 8, tile 4 -> 5 tiles:
    #   row [0, 0, 1, ..], start [0, 4, 5, 6, 10], len [4, 1, 1, 0, 0], span [4, 1, 1, 2, 0]
    ```
    """
    tile_row, tile_start, tile_len = query_tiles(inputs, tile)
    num_tiles = tile_row.shape[0]
    used = jnp.sum(tile_len > 0, dtype=jnp.int32)  # the used tiles come first, each with a token
    index = jnp.arange(num_tiles, dtype=jnp.int32)
    spare = index >= used
    start = jnp.where(spare, inputs.attn_metadata.num_actual_tokens + (index - used) * tile, tile_start)
    span = jnp.where(spare, jnp.clip(inputs.num_tokens_padded - start, 0, tile), tile_len)
    return jnp.stack([tile_row, start, tile_len, span])


def default_kv_splits(num_tiles: int, num_kv_heads: int) -> int:
    """Splits of each tile's context: doubled while the grid stays within `TARGET_PROGRAMS` (at most
    `MAX_KV_SPLITS`), so a small decode batch over long contexts still fills the GPU.

    ```
    # 1 tile x 8 heads -> 16 (capped); 8 x 8 -> 4; 32 x 8 -> 1
    ```
    """
    splits = 1
    while splits < MAX_KV_SPLITS and 2 * splits * num_tiles * num_kv_heads <= TARGET_PROGRAMS:
        splits *= 2
    return splits


def kernel_query_tile(num_tokens_padded: int, num_reqs_padded: int, num_heads: int = 1,
                      num_kv_heads: int = 1) -> int:
    """`default_query_tile` rounded down to a power of 2 (a block shape), at most `MAX_ROWS` rows with
    the group's heads. # T 256, R 64 -> 4; T 48, R 4 -> 8; T 256, R 1, G 8 -> 8"""
    group = _pow2_ceil(num_heads // num_kv_heads)
    return min(_pow2_floor(default_query_tile(num_tokens_padded, num_reqs_padded)), max(1, MAX_ROWS // group))


def plan_ragged(inputs: StepInputs, *, num_heads: int = 1, num_kv_heads: int = 1,
                query_tile: int | None = None) -> RaggedPlan:
    """The step's tiles, each token's key count and the block table, for every layer's launch."""
    tile = query_tile or kernel_query_tile(inputs.num_tokens_padded, inputs.num_reqs_padded, num_heads, num_kv_heads)
    _, kv_lens = token_kv_lens(inputs)
    return RaggedPlan(ragged_tiles(inputs, tile), kv_lens, inputs.attn_metadata.block_table, tile)


# --- the kernel ---------------------------------------------------------------------------------

def _rows(tiles_ref, program, sizes: RaggedSizes):
    """Each row's token (clamped, to read at; and where it writes), its query head, whether it is
    computed and whether it is written; a row not written points at `RaggedSizes.spare_row`.

    ```
    # Q 2, G 3 (Gp 4), M 16, tile start 5, len 1, span 1, KV head 1:
    #   rows 0..2 -> token 5, heads 3..5 computed and written; row 3 (g = 3 >= G) and rows 4.. (i >= len) neither
    ```
    """
    start, length, span = tiles_ref[1, program], tiles_ref[2, program], tiles_ref[3, program]
    r = jnp.arange(sizes.rows, dtype=jnp.int32)
    i, g = r // sizes.group_padded, r % sizes.group_padded
    token = start + i
    in_step = (g < sizes.group) & (token >= 0) & (token < sizes.num_tokens)
    computed, written = in_step & (i < length), in_step & (i < span)
    head = pl.program_id(1) * sizes.group + jnp.minimum(g, sizes.group - 1)
    read_at = jnp.clip(token, 0, sizes.num_tokens - 1)
    return read_at, jnp.where(written, read_at, sizes.spare_row), head, computed, written


def _kernel(tiles_ref, kv_lens_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, *out_refs, sizes: RaggedSizes):
    program, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = jnp.clip(tiles_ref[0, program], 0, sizes.num_reqs_padded - 1)
    layer = jnp.clip(layer_ref[0], 0, sizes.num_layers - 1)
    token, write_at, head, computed, written = _rows(tiles_ref, program, sizes)
    width = (sizes.rows, sizes.head_dim)
    # every index an array (Pallas' interpreter takes no mix of arrays and slices): [M, 1] x [1, D]
    dims = jnp.arange(sizes.head_dim, dtype=jnp.int32)[None, :]
    q = plgpu.load(q_ref.at[token[:, None], head[:, None], dims], mask=jnp.broadcast_to(computed[:, None], width),
                   other=0)
    # keys each row sees; at most the table's capacity (bad counts stay bounded)
    kv_lens = jnp.minimum(plgpu.load(kv_lens_ref.at[token], mask=computed, other=0),
                          sizes.table_width * sizes.block_size)
    num_keys = jnp.max(kv_lens)  # the tile's longest context
    num_chunks = (num_keys + sizes.kv_chunk - 1) // sizes.kv_chunk
    per_split = (num_chunks + sizes.kv_splits - 1) // sizes.kv_splits
    first = split * per_split

    def chunk_step(chunk, carry):
        running_max, running_sum, acc = carry
        keys = chunk * sizes.kv_chunk + jnp.arange(sizes.kv_chunk, dtype=jnp.int32)
        # key j of the request lives at slot block_table[row, j // B] * B + j % B (all clamped)
        column = jnp.minimum(keys // sizes.block_size, sizes.table_width - 1)
        blocks = jnp.clip(table_ref[row, column], 0, sizes.num_blocks - 1)
        slots = blocks * sizes.block_size + keys % sizes.block_size
        needed = jnp.broadcast_to((keys < num_keys)[:, None], (sizes.kv_chunk, sizes.head_dim))
        chunk_kv = [as_compute(plgpu.load(ref.at[layer, slots[:, None], kv_head, dims], mask=needed, other=0), q.dtype)
                    for ref in (k_ref, v_ref)]
        scores = jax.lax.dot_general(q, chunk_kv[0], (((1,), (1,)), ((), ())), precision=HIGHEST,
                                     preferred_element_type=jnp.float32) * (sizes.head_dim ** -0.5)
        visible = keys[None, :] < kv_lens[:, None]
        scores = jnp.where(visible, scores, MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))
        probs = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
        correction = jnp.exp(running_max - new_max)
        values = jax.lax.dot_general(probs.astype(q.dtype), chunk_kv[1], (((1,), (0,)), ((), ())), precision=HIGHEST,
                                     preferred_element_type=jnp.float32)
        return new_max, running_sum * correction + jnp.sum(probs, axis=1), acc * correction[:, None] + values

    init = (jnp.full((sizes.rows,), MASKED, jnp.float32), jnp.zeros((sizes.rows,), jnp.float32),
            jnp.zeros(width, jnp.float32))
    running_max, running_sum, acc = jax.lax.fori_loop(first, jnp.minimum(first + per_split, num_chunks), chunk_step,
                                                      init)
    store_mask = jnp.broadcast_to(written[:, None], width)
    rows_at = (write_at[:, None], head[:, None], dims)
    if sizes.kv_splits == 1:
        (out_ref,) = out_refs
        out = acc / jnp.where(running_sum > 0, running_sum, 1.0)[:, None]
        plgpu.store(out_ref.at[rows_at],
                    jnp.where(computed[:, None], out, 0.0).astype(out_ref.dtype), mask=store_mask)
        return
    acc_ref, max_ref, sum_ref = out_refs
    plgpu.store(acc_ref.at[(split,) + rows_at], jnp.where(computed[:, None], acc, 0.0), mask=store_mask)
    plgpu.store(max_ref.at[split, write_at, head], jnp.where(computed, running_max, MASKED), mask=written)
    plgpu.store(sum_ref.at[split, write_at, head], jnp.where(computed, running_sum, 0.0), mask=written)


def combine_splits(acc: Float32[Array, "splits tokens heads head_dim"],
                   running_max: Float32[Array, "splits tokens heads"],
                   running_sum: Float32[Array, "splits tokens heads"]) -> Float32[Array, "tokens heads head_dim"]:
    """The splits' partial softmaxes merged: ``sum_s w_s acc_s / sum_s w_s l_s``, ``w_s = exp(m_s - max_s m_s)``;
    a token no split saw (every ``l_s`` 0) gets zeros."""
    weights = jnp.exp(running_max - jnp.max(running_max, axis=0, keepdims=True))
    total = jnp.sum(weights * running_sum, axis=0)
    out = jnp.sum(weights[..., None] * acc, axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def ragged_attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, plan: RaggedPlan, *,
                  block_size: int, kv_chunk: int = KV_CHUNK, kv_splits: int | None = None,
                  interpret: bool = False) -> jax.Array:
    """Attention [T, H, D] of layer ``layer`` (0-d int32) of the stacked caches [L, num_blocks * B, K, D]
    (their storage dtype: bf16 bit patterns are bit-cast in the kernel), in q's dtype; padded tokens
    give zeros. ``interpret``: Pallas' interpreter (any backend), else Triton (CUDA)."""
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_slots, num_kv_heads, _ = k_cache.shape
    num_tiles = plan.tiles.shape[1]
    if not ragged_kernel_fits(head_dim) or kv_chunk < MIN_ROWS or kv_chunk & (kv_chunk - 1) or \
            plan.query_tile & (plan.query_tile - 1):
        raise ValueError(f"ragged attention: head_dim={head_dim}, kv_chunk={kv_chunk} and query_tile="
                         f"{plan.query_tile} must be powers of 2, head_dim and kv_chunk at least {MIN_ROWS}")
    sizes = RaggedSizes(num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        num_layers=num_layers, num_blocks=num_slots // block_size, block_size=block_size,
                        table_width=plan.block_table.shape[1], num_reqs_padded=plan.block_table.shape[0],
                        query_tile=plan.query_tile, kv_chunk=kv_chunk,
                        kv_splits=kv_splits or default_kv_splits(num_tiles, num_kv_heads), interpret=interpret)
    splits, rows = sizes.kv_splits, (sizes.out_tokens, num_heads)
    out_shape = jax.ShapeDtypeStruct(rows + (head_dim,), q.dtype) if splits == 1 else (
        jax.ShapeDtypeStruct((splits,) + rows + (head_dim,), jnp.float32),
        *[jax.ShapeDtypeStruct((splits,) + rows, jnp.float32)] * 2)
    out = pl.pallas_call(
        functools.partial(_kernel, sizes=sizes), grid=(num_tiles, num_kv_heads, splits), out_shape=out_shape,
        interpret=interpret, name="jaxprep_ragged_attention",
        compiler_params=COMPILER_PARAMS,
    )(plan.tiles, plan.kv_lens, plan.block_table, layer.reshape(1).astype(jnp.int32), q, k_cache, v_cache)
    if splits > 1:
        out = combine_splits(*out).astype(q.dtype)
    return out[:num_tokens]


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: StepInputs, *,
                           block_size: int, query_tile: int | None = None, kv_chunk: int = KV_CHUNK,
                           kv_splits: int | None = None, interpret: bool = False) -> jax.Array:
    """`ragged_attend` over one layer's caches [num_blocks * B, K, D]: the signature of
    `jaxprep.attention.paged_attention`, its twin."""
    plan = plan_ragged(inputs, num_heads=q.shape[1], num_kv_heads=k_cache.shape[1], query_tile=query_tile)
    return ragged_attend(q, k_cache[None], v_cache[None], jnp.int32(0), plan, block_size=block_size,
                         kv_chunk=kv_chunk, kv_splits=kv_splits, interpret=interpret)
