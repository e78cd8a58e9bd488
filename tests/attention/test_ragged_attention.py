"""jaxprep's ragged paged-attention kernel (jaxprep/attention/ragged.py) in Pallas' interpreter on CPU,
against the NumPy oracle and its XLA twin (`paged_attention`), on random mixed steps (decodes, prefill
chunks, holes, sequences ending at max_model_len), with negative controls. Small shapes: each
(bucket, tile, splits) compiles once, in a second or two.

On a GPU (the runbook's suite) the last test runs the compiled Triton kernel against the oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep.attention import paged_attention
from jaxprep.attention.ragged import (
    RaggedPlan,
    default_kv_splits,
    kernel_query_tile,
    plan_ragged,
    ragged_attend,
    ragged_paged_attention,
    ragged_tiles,
)
from support.attention_batches import CONFIG, attention_cases, longer_row, shifted_block, with_metadata

ATOL = 2e-5
B = CONFIG.block_size


@functools.partial(jax.jit, static_argnames=("query_tile", "kv_splits"))
def ragged(q, k_cache, v_cache, inputs, query_tile=None, kv_splits=None):
    return ragged_paged_attention(q, k_cache, v_cache, inputs, block_size=B, query_tile=query_tile, kv_chunk=16,
                                  kv_splits=kv_splits, interpret=True)


@jax.jit
def xla(q, k_cache, v_cache, inputs):
    return paged_attention(q, k_cache, v_cache, inputs, block_size=B)


def row0(inputs) -> slice:
    start, end = (int(x) for x in np.asarray(inputs.attn_metadata.query_start_loc)[:2])
    return slice(start, end)


@pytest.mark.parametrize(("query_tile", "kv_splits"), [(None, 1), (1, 1), (2, 3)])
def test_ragged_kernel_matches_reference_and_the_xla_path(query_tile, kv_splits):
    """The bucket's default tile (8 tokens here), one token per tile, tiles cut inside requests, and the
    context split three ways (partials merged by `combine_splits`): every token equals the oracle and the
    XLA path; padded tokens are zeros. Chunks of 16 keys over blocks of 4: a chunk spans 4 pages."""
    for case in attention_cases(seed=41, count=3):
        out = np.asarray(ragged(case.q, case.k_cache, case.v_cache, case.inputs, query_tile, kv_splits))
        np.testing.assert_allclose(out, case.reference(), atol=ATOL)
        np.testing.assert_allclose(out, np.asarray(xla(case.q, case.k_cache, case.v_cache, case.inputs)), atol=ATOL)
        assert not out[int(case.inputs.attn_metadata.num_actual_tokens):].any()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (2, 2), (8, 1)])
def test_every_group_size(num_heads, num_kv_heads):
    """G 3 (padded to 4 rows per token: the fourth is neither computed nor written), G 1 (multi-head),
    G 8 (one KV head): the oracle's ``h // G`` head mapping."""
    case = next(attention_cases(seed=42, count=1, num_heads=num_heads, num_kv_heads=num_kv_heads))
    np.testing.assert_allclose(np.asarray(ragged(case.q, case.k_cache, case.v_cache, case.inputs)),
                               case.reference(), atol=ATOL)


def test_a_shifted_slot_or_length_changes_the_output():
    """Negative controls: row 0's first block moved, or row 0 one token longer, moves row 0's tokens
    away from the oracle of the true step (with splits, so the combine is covered too)."""
    case = next(attention_cases(seed=43, count=1))
    expected = case.reference()[row0(case.inputs)]
    for shifted in (shifted_block(case.inputs), longer_row(case.inputs)):
        for splits in (1, 3):
            out = np.asarray(ragged(case.q, case.k_cache, case.v_cache, shifted, None, splits))[row0(case.inputs)]
            assert np.abs(out - expected).max() > 1e-3


def test_reads_only_each_tokens_context_and_stays_in_bounds():
    """Every slot no real token may read poisoned with 1e4 (the null block, other requests' blocks, keys
    past each token's causal bound): the output still equals the oracle. Block ids past the cache or
    negative: clamped, a finite output."""
    case = next(attention_cases(seed=44, count=1))
    meta = case.inputs.attn_metadata
    table, qsl, pos, lens = (np.asarray(x) for x in (meta.block_table, meta.query_start_loc, case.inputs.positions,
                                                     meta.seq_lens))
    read = np.zeros(case.k_cache.shape[0], bool)
    for row in range(len(lens)):
        for t in range(qsl[row], min(qsl[row + 1], int(meta.num_actual_tokens))):
            context = np.arange(min(pos[t] + 1, lens[row]))
            read[table[row, context // B] * B + context % B] = True
    poison = jnp.asarray(~read)[:, None, None]
    k_poisoned, v_poisoned = (jnp.where(poison, jnp.float32(1e4), c) for c in (case.k_cache, case.v_cache))
    np.testing.assert_allclose(np.asarray(ragged(case.q, k_poisoned, v_poisoned, case.inputs)), case.reference(),
                               atol=ATOL)
    bad_table = table.copy()
    bad_table[0, 0], bad_table[-1, -1] = 10_000, -7
    bad = with_metadata(case.inputs, block_table=jnp.asarray(bad_table))
    assert np.isfinite(np.asarray(ragged(case.q, case.k_cache, case.v_cache, bad))).all()


def test_it_reads_the_layer_it_is_given_of_the_stacked_cache():
    """Layer 1 of a stack of 3 (the other layers hold other values): the oracle over that layer; the
    same call with layer 0 is the control."""
    case = next(attention_cases(seed=45, count=1))
    rng = np.random.default_rng(0)
    stack = [jnp.stack([jnp.asarray(rng.standard_normal(c.shape), jnp.float32), c,
                        jnp.asarray(rng.standard_normal(c.shape), jnp.float32)]) for c in (case.k_cache, case.v_cache)]

    @jax.jit
    def at_layer(layer, inputs):
        plan = plan_ragged(inputs, num_heads=case.q.shape[1], num_kv_heads=case.k_cache.shape[1])
        return ragged_attend(case.q, *stack, layer, plan, block_size=B, kv_chunk=16, interpret=True)

    np.testing.assert_allclose(np.asarray(at_layer(jnp.int32(1), case.inputs)), case.reference(), atol=ATOL)
    n = int(case.inputs.attn_metadata.num_actual_tokens)
    assert np.abs(np.asarray(at_layer(jnp.int32(0), case.inputs))[:n] - case.reference()[:n]).max() > 1e-3


def test_ragged_tiles_worked_example():
    """query_start_loc [0, 5, 6, 6, 6], 6 real tokens of T 32, tile 4: 12 tiles; the used ones of
    `query_tiles`, then spare tiles writing zeros from token 6 on, 4 tokens each, 2 at the end of T,
    then none."""
    case = next(attention_cases(seed=15, count=1))
    assert case.inputs.num_tokens_padded == 32 and case.inputs.attn_metadata.query_start_loc.shape == (5,)
    inputs = with_metadata(case.inputs, query_start_loc=jnp.asarray([0, 5, 6, 6, 6], jnp.int32),
                           num_actual_tokens=jnp.int32(6))
    tile_row, start, length, span = np.asarray(ragged_tiles(inputs, 4))
    assert tile_row[:3].tolist() == [0, 0, 1]
    assert start.tolist() == [0, 4, 5, 6, 10, 14, 18, 22, 26, 30, 34, 38]
    assert length.tolist() == [4, 1, 1] + [0] * 9
    assert span.tolist() == [4, 1, 1, 4, 4, 4, 4, 4, 4, 2, 0, 0]


def test_tile_and_split_sizes():
    """Tiles: the bucket's tokens per row, a power of 2, at most 64 rows with the group; splits: doubled
    while the grid stays within 256 programs, at most 16."""
    assert [kernel_query_tile(t, r) for t, r in [(8, 8), (256, 64), (48, 4), (256, 1)]] == [1, 4, 8, 16]
    assert kernel_query_tile(256, 1, num_heads=32, num_kv_heads=4) == 8  # G 8: 8 tokens x 8 heads = 64 rows
    assert kernel_query_tile(256, 1, num_heads=12, num_kv_heads=2) == 8  # G 6 -> 8 rows per token
    assert [default_kv_splits(n, 8) for n in (1, 2, 8, 16, 32)] == [16, 16, 4, 2, 1]


def test_a_tile_that_is_not_a_power_of_2_is_refused():
    case = next(attention_cases(seed=46, count=1))
    plan = plan_ragged(case.inputs, query_tile=4)
    plan = RaggedPlan(plan.tiles, plan.kv_lens, plan.block_table, query_tile=3)
    with pytest.raises(ValueError, match="query_tile=3 must be powers of 2"):
        ragged_attend(case.q, case.k_cache[None], case.v_cache[None], jnp.int32(0), plan, block_size=B)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Triton kernel needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_triton_kernel_on_the_gpu_matches_reference(dtype):
    """On a GPU: the kernel compiled by Triton (not interpreted), Triton's shapes (head_dim 32, blocks of
    16), every tile and split setting, against the oracle on the same (bf16-rounded) values; a shifted
    block is the negative control."""
    from jaxprep import PrepConfig
    from support.attention_batches import AttentionCase

    config = PrepConfig(max_num_reqs=4, max_model_len=160, max_num_batched_tokens=64, block_size=16, num_blocks=48)
    for case in attention_cases(seed=47, count=2, head_dim=32, config=config):
        q, k_cache, v_cache = (x.astype(dtype) for x in (case.q, case.k_cache, case.v_cache))
        expected = AttentionCase(case.inputs, *(x.astype(jnp.float32) for x in (q, k_cache, v_cache)),
                                 block_size=16).reference()
        for query_tile, kv_splits in [(None, None), (1, 1), (2, 3)]:
            out = jax.jit(functools.partial(ragged_paged_attention, block_size=16, query_tile=query_tile,
                                            kv_splits=kv_splits))(q, k_cache, v_cache, case.inputs)
            np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected,
                                       atol=ATOL if dtype == "float32" else 2e-2)
        shifted = jax.jit(functools.partial(ragged_paged_attention, block_size=16))(q, k_cache, v_cache,
                                                                                   shifted_block(case.inputs, 48))
        rows = row0(case.inputs)
        assert np.abs(np.asarray(shifted.astype(jnp.float32))[rows] - expected[rows]).max() > 0.1
